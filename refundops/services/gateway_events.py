"""Applying verified gateway events to our records: refunds (ours and those made on the gateway
directly), disputes, and Stripe payment links paid.

Events arrive late, twice, and out of order, so none is trusted for *where things stand*: each
handler asks the gateway for the object's current state (``fetch_refund``, each gateway's
``fetch_dispute``) and moves our records to match it. Applying the same state twice changes
nothing, which is what makes a duplicate delivery harmless and the order of events irrelevant.
What an event is *about* (which payment, which of our refunds) is read from its verified body.
The gateway is asked before any lock is taken; the records change in one short transaction.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from datetime import timezone as dt_timezone
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from audit.models import Verdict
from audit.services import record_audit
from processors.base import ProcessorUnavailable, RefundResult, WebhookEvent
from processors.paypal import PayPalDispute, PayPalProcessor
from processors.registry import get_processor
from processors.stripe import StripeProcessor
from refundops import outbound
from refundops.locks import lock_payment, lock_scopes
from refundops.models import (
    COUNTING_STATES,
    Dispute,
    GatewayAttempt,
    LedgerDiscrepancy,
    Payment,
    PaymentLink,
    Reason,
    Refund,
    RefundState,
)
from refundops.services import attempts
from refundops.services.payments import mark_payment_link_paid
from refundops.services.payouts import mark_paid_twice_if_disputed, record_gateway_result
from refundops.services.reconciliation import raise_discrepancy
from refundops.services.refunds import estimate_arrival, sync_payment_amounts

log = logging.getLogger(__name__)
ACTOR = "system:gateway"
NOT_READY_RETRY_SECONDS = 60

# Events whose object is a refund (or, for charge.refunded, a charge listing its refunds).
REFUND_EVENTS: dict[str, frozenset[str]] = {
    "stripe": frozenset({"charge.refund.updated", "refund.created", "refund.updated", "refund.failed"}),
    "paypal": frozenset({"PAYMENT.CAPTURE.REFUNDED", "PAYMENT.CAPTURE.REVERSED",
                         "PAYMENT.REFUND.PENDING", "PAYMENT.REFUND.FAILED", "PAYMENT.REFUND.CANCELLED"}),
    "sandbox": frozenset({"refund.created", "refund.updated", "refund.succeeded", "refund.failed",
                          "refund.canceled"}),
}
STRIPE_DISPUTE_EVENTS = frozenset({"charge.dispute.created", "charge.dispute.updated", "charge.dispute.closed",
                                   "charge.dispute.funds_withdrawn", "charge.dispute.funds_reinstated"})
SANDBOX_DISPUTE_EVENTS = frozenset({"dispute.created", "dispute.updated", "dispute.closed"})
PAYPAL_DISPUTE_EVENTS = frozenset({"CUSTOMER.DISPUTE.CREATED", "CUSTOMER.DISPUTE.UPDATED",
                                   "CUSTOMER.DISPUTE.RESOLVED"})
# A Checkout Session paid later (bank debits) completes unpaid and reports the money separately.
STRIPE_LINK_SESSION_EVENTS = frozenset({"checkout.session.completed", "checkout.session.async_payment_succeeded"})
STRIPE_REASONS = {"duplicate": Reason.DUPLICATE, "fraudulent": Reason.FRAUDULENT,
                  "requested_by_customer": Reason.CUSTOMER_REQUEST}
# Stripe's dispute statuses, as our payment's dispute state. An inquiry closed without a
# chargeback (warning_closed) and a prevented dispute cost nothing: won.
DISPUTE_STATUSES = {"won": Dispute.Status.WON, "lost": Dispute.Status.LOST,
                    "warning_closed": Dispute.Status.WON, "prevented": Dispute.Status.WON}
# How a resolved PayPal dispute ended, for the merchant. With a payout, PayPal paid the buyer
# from its own funds (seller protection): the merchant keeps the money, so it is won. Any
# other or unknown outcome is taken as lost, the reading that never hides money gone.
PAYPAL_OUTCOMES = {"RESOLVED_SELLER_FAVOUR": Dispute.Status.WON, "CANCELED_BY_BUYER": Dispute.Status.WON,
                   "DENIED": Dispute.Status.WON, "RESOLVED_WITH_PAYOUT": Dispute.Status.WON}


class NotReady(ProcessorUnavailable):
    """The event names our refund while the worker is still recording the gateway's first answer
    for it: ask the gateway to send the event again later, when it can be matched."""

    def __init__(self, message: str) -> None:
        super().__init__(message, code="not_ready", retry_after=NOT_READY_RETRY_SECONDS)


@dataclass(frozen=True, slots=True)
class RefundClues:
    """What a verified event says a refund is about; its state is asked of the gateway."""

    refund_reference: str
    payment_references: tuple[str, ...]
    our_refund_id: str  # from the metadata we sent with it; "" for a refund made elsewhere
    reason: str


def apply_event(event: WebhookEvent, *, account: str) -> str:
    """Apply one verified event; answer what it did, in words, for the inbound event's record.
    Raises ProcessorUnavailable when the gateway cannot be asked (the sender should retry)."""
    if event.type in REFUND_EVENTS.get(event.processor, ()):
        return apply_refund_news(processor=event.processor, account=account,
                                 clues=_refund_clues(event.processor, event.data), event=event)
    if event.processor == "stripe" and event.type == "charge.refunded":
        listed = (event.data.get("refunds") or {}).get("data") or []
        if not listed:
            return "the charge lists no refunds; each refund's own event carries it"
        return "; ".join(
            apply_refund_news(processor="stripe", account=account, event=event,
                              clues=_refund_clues("stripe", {"charge": event.object_id,
                                                             "payment_intent": event.data.get("payment_intent"),
                                                             **refund}))
            for refund in listed)
    if event.processor == "stripe" and event.type in STRIPE_DISPUTE_EVENTS:
        processor = get_processor("stripe", account)
        assert isinstance(processor, StripeProcessor)
        dispute = processor.fetch_dispute(event.object_id)
        return apply_dispute_news(
            processor="stripe", account=account, reference=dispute.id, event=event,
            payment_references=(dispute.payment_intent, dispute.charge),
            status=DISPUTE_STATUSES.get(dispute.status, Dispute.Status.OPEN), reason=dispute.reason,
            amount_minor=dispute.amount.amount_minor, currency=dispute.amount.currency,
            evidence_due_by=dispute.evidence_due_by)
    if event.processor == "paypal" and event.type in PAYPAL_DISPUTE_EVENTS:
        processor = get_processor("paypal", account)
        assert isinstance(processor, PayPalProcessor)
        found = processor.fetch_dispute(event.object_id)
        return apply_dispute_news(
            processor="paypal", account=account, reference=found.id, event=event,
            payment_references=found.captures, status=paypal_dispute_status(found), reason=found.reason,
            amount_minor=found.amount.amount_minor if found.amount else None,
            currency=found.amount.currency if found.amount else "", evidence_due_by=found.respond_by)
    if event.processor == "stripe" and (event.type in STRIPE_LINK_SESSION_EVENTS
                                        or event.type == "payment_intent.succeeded"):
        return apply_payment_link_news(account=account, event=event)
    if event.processor == "sandbox" and event.type in SANDBOX_DISPUTE_EVENTS:
        # The sandbox keeps no disputes of its own to ask: its signed event is the record.
        data = event.data
        return apply_dispute_news(
            processor="sandbox", account=account, reference=event.object_id, event=event,
            payment_references=(str(data.get("charge") or ""),),
            status=DISPUTE_STATUSES.get(str(data.get("status")), Dispute.Status.OPEN),
            reason=str(data.get("reason") or ""), amount_minor=int(data["amount"]) if data.get("amount") else None,
            currency=str(data.get("currency") or "").upper(), evidence_due_by=data.get("evidence_due_by"))
    return f"not an event RefundOps acts on ({event.type})"


def paypal_dispute_status(dispute: PayPalDispute) -> str:
    if dispute.status != "RESOLVED":
        return Dispute.Status.OPEN
    return PAYPAL_OUTCOMES.get(dispute.outcome, Dispute.Status.LOST)


def apply_payment_link_news(*, account: str, event: WebhookEvent) -> str:
    """A customer paid through one of our Stripe payment links. A Checkout Session names the link
    (``payment_link``); the payment intent it made carries our link id in its metadata, which
    ``create_payment_link`` put there. Paid is final on Stripe, so the verified event suffices."""
    data = event.data
    if event.type == "payment_intent.succeeded":
        link_id = str((data.get("metadata") or {}).get("payment_link_id") or "")
        links = PaymentLink.objects.filter(pk=link_id) if link_id else PaymentLink.objects.none()
    else:
        if data.get("payment_status") != "paid":
            return f"checkout session {event.object_id} is {data.get('payment_status')}: not paid yet"
        links = PaymentLink.objects.filter(processor_link_id=str(data.get("payment_link") or ""))
    link = links.filter(payment__processor="stripe", payment__processor_account=account) \
        .exclude(processor_link_id="").first()
    if link is None:
        return f"{event.object_id}: not paid through a payment link of ours"
    before = link.status
    link = mark_payment_link_paid(link_id=link.pk, actor="system:webhook")
    return f"{link.pk}: already paid" if before == PaymentLink.Status.PAID else f"{link.pk}: paid"


def _refund_clues(processor: str, data: Mapping[str, Any]) -> RefundClues:
    if processor == "paypal":
        # Our custom_id is "rf_…|vd_…|reason"; the capture is the refund's "up" link.
        custom = str(data.get("custom_id") or "").split("|")
        capture = next((link["href"].rstrip("/").rsplit("/", 1)[-1] for link in data.get("links") or []
                        if link.get("rel") == "up" and "/captures/" in str(link.get("href"))), "")
        return RefundClues(refund_reference=str(data["id"]), payment_references=(capture,),
                           our_refund_id=custom[0] if custom[0].startswith("rf_") else "",
                           reason=Reason.CUSTOMER_REQUEST)
    metadata = data.get("metadata") or {}
    return RefundClues(
        refund_reference=str(data["id"]),
        payment_references=tuple(str(ref) for ref in (data.get("payment_intent"), data.get("charge")) if ref),
        our_refund_id=str(metadata.get("refund_id") or ""),
        reason=STRIPE_REASONS.get(str(data.get("reason")), Reason.CUSTOMER_REQUEST))


def _find_payment(processor: str, account: str, references: tuple[str, ...]) -> Payment | None:
    references = tuple(ref for ref in references if ref)
    if not references:
        return None
    return Payment.objects.filter(processor=processor, processor_account=account,
                                  processor_reference__in=references).first()


def _our_refund(processor: str, account: str, clues: RefundClues, result: RefundResult) -> Refund | None:
    gateway_refunds = Refund.objects.filter(payment__processor=processor, payment__processor_account=account)
    known = gateway_refunds.filter(processor_refund_id=result.processor_refund_id).first()
    if known is not None:
        return known
    if clues.our_refund_id and result.status in ("pending", "succeeded"):
        # Ours, before the worker recorded the gateway's answer. A failed or canceled refund
        # named only by metadata may be an earlier attempt of a resubmitted refund: the worker
        # records its own attempt's answer. Metadata can be copied or typed on the gateway's
        # dashboard: only a refund of our refund's own payment, for its amount, is taken for it;
        # any other is recorded where its money left.
        return gateway_refunds.filter(
            pk=clues.our_refund_id, processor_refund_id="",
            payment__processor_reference__in=[ref for ref in clues.payment_references if ref],
            amount_minor=result.amount.amount_minor, currency=result.amount.currency).first()
    return None


def apply_refund_news(*, processor: str, account: str, clues: RefundClues, event: WebhookEvent) -> str:
    result = get_processor(processor, account).fetch_refund(clues.refund_reference)
    ours = _our_refund(processor, account, clues, result)
    if ours is None and result.status not in ("pending", "succeeded") and clues.our_refund_id:
        if Refund.objects.filter(pk=clues.our_refund_id, status=RefundState.APPROVED, processor_refund_id="").exists():
            raise NotReady(f"{clues.our_refund_id} is still being submitted; its own answer comes first")
        # No longer waiting: the worker may have recorded this very gateway refund since the
        # first look, and its failure must not be dropped as someone else's.
        ours = _our_refund(processor, account, clues, result)
    if ours is not None:
        before = ours.status
        after = record_gateway_result(refund_id=ours.pk, result=result).status
        return f"{ours.pk}: {before} → {after}" if after != before else f"{ours.pk}: already {after}"
    if result.status not in ("pending", "succeeded"):
        return f"{result.processor_refund_id} is {result.status} and was never ours: nothing to record"
    payment = _find_payment(processor, account, clues.payment_references)
    if payment is None:
        return f"{result.processor_refund_id}: no payment of ours for {', '.join(clues.payment_references) or '?'}"
    return record_external_refund(payment_id=payment.pk, result=result, reason=clues.reason, event=event)


@transaction.atomic
def record_external_refund(*, payment_id: str, result: RefundResult, reason: str, event: WebhookEvent,
                           made_at: datetime | None = None) -> str:
    """A refund made on the gateway directly (its dashboard, another system): record it so every
    running total and the refundable amount count it. Under the payment lock, once. ``made_at``
    (when the gateway made it, if known) dates it, so the totals count it on the day it happened.

    The gateway's refund is a fact. Where it does not fit beside ours (our refunds + it > captured),
    ours that have not reached the gateway are canceled to make room; where even that cannot make
    room (ours at the gateway, or on their way, already take it), our books and the gateway's
    differ: that is raised to a person as a ledger discrepancy, and the event counts as applied."""
    payment = lock_payment(payment_id)
    assert payment is not None
    # After the payment, as refund decisions take them: the customer's and the currency's running
    # totals change here, so no decision may be taken on totals without this refund (the currency's
    # lock exclusively: it waits for the decisions in flight, and later ones see this refund). The
    # payment's currency: a refund in another fits nowhere (a discrepancy, below), and a book of
    # refunds recorded in one transaction then never holds one currency while it waits for another.
    lock_scopes(customer_id=payment.customer_id, agent_id=None, currency=payment.currency, exclusive=True)
    existing = Refund.objects.filter(payment=payment, processor_refund_id=result.processor_refund_id).first()
    if existing is not None:  # a concurrent delivery got here first
        return f"{existing.pk}: already recorded"
    to_cancel = _waiting_refunds_to_make_room(payment, result)
    if to_cancel is None:
        discrepancy = _raise_external_that_does_not_fit(payment, result, event=event)
        return (f"{result.processor_refund_id} of {result.amount} does not fit in what {payment.pk} has left: "
                f"raised as ledger discrepancy {discrepancy.pk}")
    now = made_at or timezone.now()
    settled = result.status == "succeeded"
    message = (f"Refund {result.processor_refund_id} of {result.amount} was made on {payment.processor} "
               f"directly, not through RefundOps; learned from its event {event.event_id} ({event.type}).")
    verdict = Verdict.objects.create(
        operation="refund.external", outcome=Verdict.Outcome.APPROVED, message=message,
        payment_id=payment.pk, amount_minor=result.amount.amount_minor, currency=result.amount.currency,
        request={"event_id": event.event_id, "event_type": event.type, "processor": payment.processor},
        gateway_response={"processor_refund_id": result.processor_refund_id, "status": result.status})
    refund = Refund(
        payment=payment, amount_minor=result.amount.amount_minor, currency=result.amount.currency,
        reason=reason, origin=Refund.Origin.EXTERNAL, verdict=verdict,
        status=RefundState.SETTLED if settled else RefundState.SUBMITTED,
        processor_refund_id=result.processor_refund_id, submitted_at=now, settled_at=now if settled else None,
        estimated_arrival=estimate_arrival(payment, now.date()),
        note=f"Made on {payment.processor} directly; learned from event {event.event_id}.")
    refund._change_reason = f"learned from {payment.processor} event {event.event_id}"
    refund.save()
    outbound.announce_refund(refund, previous=None)
    if made_at is not None:  # created_at is set on insert; the running totals count it from when it was made
        Refund.objects.filter(pk=refund.pk).update(created_at=made_at, counted_at=made_at)
    Verdict.objects.filter(pk=verdict.pk).update(refund_id=refund.pk)
    for waiting in to_cancel:
        _cancel_to_make_room(waiting, event=event)
    sync_payment_amounts(payment)
    mark_paid_twice_if_disputed(refund, actor=ACTOR)  # a person paid it on the gateway, disputed or not
    record_audit(actor=ACTOR, action="refund.external_recorded", subject_type="refund", subject_id=refund.pk,
                 data={"payment_id": payment.pk, "processor_refund_id": result.processor_refund_id,
                       "amount_minor": refund.amount_minor, "currency": refund.currency,
                       "status": refund.status, "event_id": event.event_id, "verdict_id": verdict.pk})
    return f"{refund.pk}: recorded external refund {result.processor_refund_id} ({refund.status})"


def _may_be_at_gateway(refund: Refund) -> bool:
    """Submitted or settled, or approved with a gateway call in flight or unanswered: the money may have left."""
    return refund.status in (RefundState.SUBMITTED, RefundState.SETTLED) or attempts.may_be_at_gateway(refund)


def _waiting_refunds_to_make_room(payment: Payment, result: RefundResult) -> list[Refund] | None:
    """Ours to cancel (newest first, only as many as needed) so the gateway's refund fits in what was
    captured; None when it cannot fit even with all of them canceled. Only refunds that have not
    reached the gateway are candidates: the gateway would refuse them anyway, and one whose call may
    be on its way could be paid whatever we decide here."""
    if result.amount.currency != payment.currency:
        return None
    refunds = list(payment.refunds.select_for_update().filter(status__in=COUNTING_STATES).order_by("created_at", "pk"))
    at_gateway = sum(r.amount_minor for r in refunds if _may_be_at_gateway(r))
    if at_gateway + result.amount.amount_minor > payment.amount_captured_minor:
        return None
    excess = sum(r.amount_minor for r in refunds) + result.amount.amount_minor - payment.amount_captured_minor
    to_cancel = []
    for waiting in reversed([r for r in refunds if not _may_be_at_gateway(r)]):
        if excess <= 0:
            break
        to_cancel.append(waiting)
        excess -= waiting.amount_minor
    return to_cancel


def _cancel_to_make_room(waiting: Refund, *, event: WebhookEvent) -> None:
    before = waiting.status
    waiting.cancel(message="The payment was refunded on the gateway directly; this refund no "
                           "longer fits in what was captured.")
    waiting._change_reason = f"made room for an external refund ({event.event_id})"
    waiting.save()
    outbound.announce_refund(waiting, previous=before)
    record_audit(actor=ACTOR, action="refund.canceled", subject_type="refund", subject_id=waiting.pk,
                 data={"from": before, "why": "external refund on the gateway", "event_id": event.event_id})


def _raise_external_that_does_not_fit(payment: Payment, result: RefundResult, *,
                                      event: WebhookEvent) -> LedgerDiscrepancy:
    ours = [{"refund_id": r.pk, "amount_minor": r.amount_minor, "status": r.status,
             "processor_refund_id": r.processor_refund_id}
            for r in payment.refunds.filter(status__in=COUNTING_STATES).order_by("created_at", "pk")]
    return raise_discrepancy(
        payment=payment, kind=LedgerDiscrepancy.Kind.UNKNOWN_REFUND, actor=ACTOR,
        gateway_reference=result.processor_refund_id,
        ours={"captured_minor": payment.amount_captured_minor, "refunded_minor": payment.amount_refunded_minor,
              "reserved_minor": payment.amount_reserved_minor, "currency": payment.currency, "refunds": ours},
        theirs={"processor_refund_id": result.processor_refund_id, "amount_minor": result.amount.amount_minor,
                "currency": result.amount.currency, "status": result.status, "event_id": event.event_id},
        detail=f"{payment.processor} refund {result.processor_refund_id} of {result.amount} was made on the "
               f"gateway directly, and our refunds at the gateway or on their way leave no room for it in the "
               f"{payment.captured} captured. Find which of ours the gateway did not pay (or refund the "
               f"difference back), then resolve with a note.")


@transaction.atomic
def apply_dispute_news(*, processor: str, account: str, reference: str, event: WebhookEvent,
                       payment_references: tuple[str, ...], status: str, reason: str,
                       amount_minor: int | None, currency: str, evidence_due_by: int | None) -> str:
    """A dispute opened, moved or closed: our dispute record and the payment's dispute state
    follow it. A closed dispute stays closed, so a late "created" cannot reopen it."""
    found = _find_payment(processor, account, payment_references)
    if found is None:
        return f"dispute {reference}: no payment of ours for {', '.join(r for r in payment_references if r) or '?'}"
    payment = lock_payment(found.pk)
    assert payment is not None
    dispute = Dispute.objects.select_for_update().filter(payment=payment, processor_dispute_id=reference).first()
    if dispute is None:
        dispute = Dispute(payment=payment, processor_dispute_id=reference, status=status, reason=reason[:60],
                          amount_minor=amount_minor or payment.amount_captured_minor,
                          currency=currency or payment.currency)
    elif dispute.status != Dispute.Status.OPEN or dispute.status == status:
        return f"dispute {dispute.pk}: already {dispute.status}"
    dispute.status = status
    if evidence_due_by:
        dispute.evidence_due_by = datetime.fromtimestamp(int(evidence_due_by), tz=dt_timezone.utc)
    dispute._change_reason = f"{processor} event {event.event_id}"
    dispute.save()
    before, was_paid_twice = payment.dispute_status, payment.paid_twice
    payment.dispute_status, payment.dispute_reference = _standing(payment)
    payment.paid_twice = _paid_twice(payment, dispute)
    payment._change_reason = f"dispute {reference}: {status}"
    payment.save(update_fields=["dispute_status", "dispute_reference", "paid_twice"])
    action = "dispute.opened" if status == Dispute.Status.OPEN else f"dispute.{status}"
    record_audit(actor=ACTOR, action=action, subject_type="payment", subject_id=payment.pk,
                 data={"dispute_id": dispute.pk, "processor_dispute_id": reference, "from": before,
                       "to": payment.dispute_status, "event_id": event.event_id})
    if payment.paid_twice != was_paid_twice:
        record_audit(actor=ACTOR, action="payment.paid_twice" if payment.paid_twice else "payment.paid_twice_cleared",
                     subject_type="payment", subject_id=payment.pk,
                     data={"dispute_id": dispute.pk, "amount_refunded_minor": payment.amount_refunded_minor,
                           "amount_reserved_minor": payment.amount_reserved_minor, "event_id": event.event_id})
    if payment.paid_twice and not was_paid_twice:
        log.error("payment %s: disputed after it was refunded; it may be paid back twice", payment.pk)
    return f"dispute {dispute.pk}: {before} → {payment.dispute_status}"


def _standing(payment: Payment) -> tuple[str, str]:
    """The payment's dispute state over all its disputes: open while any is open (money is still
    at stake), else lost if any was lost, else won; with the dispute that decides it."""
    disputes = list(payment.disputes.order_by("-created_at"))
    for status in (Dispute.Status.OPEN, Dispute.Status.LOST, Dispute.Status.WON):
        deciding = next((d for d in disputes if d.status == status), None)
        if deciding is not None:
            return status, deciding.processor_dispute_id
    return Payment.Dispute.NONE, ""


def _paid_twice(payment: Payment, changed: Dispute) -> bool:
    """Refunded by us and disputed too: the customer may get the money back twice.

    Set when a dispute opens or is lost on a payment with a refund at the gateway. Cleared only
    when the dispute that moved is won and no other dispute of the payment is lost (the money
    went back twice) or still open (it may yet): a won dispute settles only itself."""
    # A refund whose call's answer is unknown (whatever our books say of it) may have been paid too.
    refunded = payment.refunds.filter(
        Q(status__in=(RefundState.SUBMITTED, RefundState.SETTLED))
        | Q(attempts__outcome__in=(GatewayAttempt.Outcome.LIVE, GatewayAttempt.Outcome.UNKNOWN))).exists()
    if changed.status in (Dispute.Status.OPEN, Dispute.Status.LOST):
        return payment.paid_twice or refunded
    others_at_stake = payment.disputes.exclude(pk=changed.pk).filter(
        status__in=(Dispute.Status.OPEN, Dispute.Status.LOST)).exists()
    return payment.paid_twice and others_at_stake
