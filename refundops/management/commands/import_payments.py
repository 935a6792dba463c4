"""``manage.py import_payments --gateway stripe|paypal [--account A] [--since YYYY-MM-DD]``

Brings payments taken before RefundOps (or outside it) in from the gateway with what the gateway
already did to them, so an agent is never told "approved" for money that is gone:

- each payment once (known by its gateway reference, a unique constraint), its customer once;
- every refund made on the gateway directly, recorded as an external refund (through the webhook
  path's own ``record_external_refund``) on the day it was made, so every total counts it; a
  refund RefundOps made itself is left to the worker and the webhooks that own it;
- every dispute, open or closed (through the webhook path's ``apply_dispute_news``);
- an authorisation with its order amount (Stripe: the payment intent's amount), so it can be
  captured; a person may change that amount in the admin before capture.

Running it again imports nothing twice and learns what happened since. A payment and what
happened to it are written in one transaction, so a stop in between leaves nothing half done.
A gateway that stops answering stops the import with the way on ("run again"); a final refusal
quotes the gateway's code and message and exits non-zero. Progress goes to stderr as a bar, the
totals to stdout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import date, datetime, time, timezone
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db import IntegrityError, transaction
from tqdm import tqdm

from audit.services import record_audit
from processors.base import GatewayRefund, ProcessorDeclined, ProcessorError, PaymentRef, WebhookEvent
from processors.money import CURRENCY_EXPONENTS
from processors.registry import UnknownProcessor, get_processor
from processors.stripe import StripeDispute, StripePaymentIntent, StripeProcessor
from refundops.models import Customer, Dispute, GatewayCustomer, Payment, Reason, Refund
from refundops.services.gateway_events import (
    DISPUTE_STATUSES,
    STRIPE_REASONS,
    apply_dispute_news,
    record_external_refund,
)

ACTOR = "system:import"


@dataclass
class Tally:
    seen: int = 0
    created: int = 0
    present: int = 0
    skipped: int = 0
    refunds: int = 0  # made on the gateway directly, newly recorded here
    disputes: int = 0  # newly recorded here

    def count(self, outcome: str) -> None:
        setattr(self, outcome, getattr(self, outcome) + 1)


def import_event(gateway: str, reference: str) -> WebhookEvent:
    """What told us, for the records the webhook path writes: this import, about one object."""
    return WebhookEvent(processor=gateway, event_id=f"import:{reference}", type="import_payments",
                        object_id=reference)


def customer_for(*, gateway: str, account: str, reference: str, email: str, name: str,
                 guest_of: str) -> Customer:
    """The gateway customer's one Customer here; a guest checkout gets a customer of its own."""
    label = {"stripe": "Stripe", "paypal": "PayPal"}[gateway]
    if not reference:
        return Customer.objects.create(name=name or f"{label} guest ({guest_of})", email=email)
    link = GatewayCustomer.objects.select_related("customer").filter(
        processor=gateway, account=account, reference=reference).first()
    if link is not None:
        return link.customer
    customer = Customer.objects.create(name=name or f"{label} customer {reference}", email=email)
    GatewayCustomer.objects.create(processor=gateway, account=account, reference=reference, customer=customer)
    return customer


def find_or_create_payment(*, gateway: str, account: str, reference: str,
                           make: Callable[[], dict[str, Any]]) -> tuple[Payment, bool]:
    """(payment, created). Another import creating the same payment at once is not an error."""
    found = Payment.objects.filter(processor=gateway, processor_account=account, processor_reference=reference).first()
    if found is not None:
        return found, False
    try:
        with transaction.atomic():
            return Payment.objects.create(processor=gateway, processor_account=account,
                                          processor_reference=reference, **make()), True
    except IntegrityError:  # another import took it first
        return Payment.objects.get(processor=gateway, processor_account=account, processor_reference=reference), False


def record_refunds(payment: Payment, refunds: Iterable[GatewayRefund], *, reason_of: Callable[[str], str]) -> int:
    """Record the gateway's refunds of ``payment`` that we do not know yet; how many were new.
    Ours (named by our refund id) are the worker's and the webhooks' to record, and a refund that
    failed or was canceled moved no money."""
    known = set(Refund.objects.filter(payment=payment).exclude(processor_refund_id="")
                .values_list("processor_refund_id", flat=True))
    recorded = 0
    for refund in sorted(refunds, key=lambda r: r.created_at or datetime.min.replace(tzinfo=timezone.utc)):
        if refund.processor_refund_id in known or refund.status not in ("pending", "succeeded"):
            continue
        if refund.our_refund_id and Refund.objects.filter(pk=refund.our_refund_id, payment=payment).exists():
            continue
        record_external_refund(payment_id=payment.pk, result=refund.result, reason=reason_of(refund.reason),
                               event=import_event(payment.processor, refund.processor_refund_id),
                               made_at=refund.created_at)
        recorded += 1
    return recorded


# -- Stripe -------------------------------------------------------------------------------------------

def stripe_payment_fields(intent: StripePaymentIntent, *, account: str) -> dict[str, Any]:
    created = datetime.fromtimestamp(intent.created, tz=timezone.utc)
    common = {
        "customer": customer_for(gateway="stripe", account=account, reference=intent.customer, name="",
                                 email=intent.metadata.get("email", ""), guest_of=intent.id),
        "currency": intent.currency, "method_type": "card", "method_brand": intent.card_brand,
        "method_last4": intent.card_last4,
        # Stripe may capture more than asked (overcapture): what was authorised covers what was taken.
        "amount_authorized_minor": max(intent.amount_minor, intent.received_minor),
        "order_amount_minor": intent.amount_minor,
        "order_reference": intent.metadata.get("order_reference") or intent.metadata.get("order_id", ""),
    }
    if intent.status == "succeeded":
        return {**common, "status": Payment.Status.CAPTURED, "captured_at": created,
                "amount_captured_minor": intent.received_minor}
    return {**common, "status": Payment.Status.AUTHORIZED, "authorization_reference": intent.id}


def import_stripe_intent(processor: StripeProcessor, intent: StripePaymentIntent, *, account: str,
                         tally: Tally) -> None:
    # requires_payment_method, requires_action, processing, canceled: no money to refund or capture.
    if intent.status not in ("succeeded", "requires_capture") or intent.currency not in CURRENCY_EXPONENTS:
        tally.count("skipped")
        return
    ref = PaymentRef(processor="stripe", account=account, reference=intent.id)
    captured = intent.status == "succeeded"
    # The charge says whether there is anything to list; when it does not say, we ask.
    refunds = processor.fetch_payment_book(ref).refunds if captured and intent.refunded_minor != 0 else ()
    disputes = processor.list_disputes(ref) if captured and intent.disputed is not False else []
    with transaction.atomic():
        payment, created = find_or_create_payment(
            gateway="stripe", account=account, reference=intent.id,
            make=lambda: stripe_payment_fields(intent, account=account))
        tally.count("created" if created else "present")
        tally.refunds += record_refunds(payment, refunds,
                                        reason_of=lambda word: STRIPE_REASONS.get(word, Reason.CUSTOMER_REQUEST))
        tally.disputes += sum(record_stripe_dispute(payment, dispute, account=account) for dispute in disputes)


def record_stripe_dispute(payment: Payment, dispute: StripeDispute, *, account: str) -> bool:
    """Record one dispute (or its new state); True when it was not here before."""
    new = not Dispute.objects.filter(payment=payment, processor_dispute_id=dispute.id).exists()
    apply_dispute_news(processor="stripe", account=account, reference=dispute.id,
                       event=import_event("stripe", dispute.id),
                       payment_references=(dispute.payment_intent, dispute.charge),
                       status=DISPUTE_STATUSES.get(dispute.status, Dispute.Status.OPEN), reason=dispute.reason,
                       amount_minor=dispute.amount.amount_minor, currency=dispute.amount.currency,
                       evidence_due_by=dispute.evidence_due_by)
    return new


# -- the command --------------------------------------------------------------------------------------

class Command(BaseCommand):
    help = ("Import existing payments from a gateway (Stripe payment intents, PayPal captures) with their "
            "refunds and disputes. Safe to run again.")

    def add_arguments(self, parser) -> None:
        parser.add_argument("--gateway", required=True, choices=["stripe"])
        parser.add_argument("--account", default="default", help="a configured account of the gateway")
        parser.add_argument("--since", type=date.fromisoformat, help="only payments created on or after (UTC)")
        parser.add_argument("--page-size", type=int, default=100, choices=range(1, 101), metavar="1..100")
        parser.add_argument("--starting-after", default=None, metavar="pi_…",
                            help="Stripe: continue after this payment intent (an import that stopped names it)")

    def handle(self, *args: Any, gateway: str, account: str, since: date | None, page_size: int,
               starting_after: str | None, **options: Any) -> None:
        try:
            processor = get_processor(gateway, account)
        except (UnknownProcessor, KeyError) as missing:
            raise CommandError(f"{gateway} account {account!r} is not configured: {missing}") from None
        assert isinstance(processor, StripeProcessor)
        created_gte = int(datetime.combine(since, time.min, tzinfo=timezone.utc).timestamp()) if since else None
        tally, last = Tally(), starting_after
        bar = tqdm(unit=" payment intents", file=getattr(self.stderr, "_out", self.stderr), dynamic_ncols=True)
        try:
            for intent in processor.list_payment_intents(created_gte=created_gte, limit=page_size,
                                                         starting_after=starting_after):
                import_stripe_intent(processor, intent, account=account, tally=tally)
                tally.seen, last = tally.seen + 1, intent.id
                bar.update(1)
                bar.set_postfix(created=tally.created, present=tally.present, skipped=tally.skipped,
                                refunds=tally.refunds, disputes=tally.disputes, refresh=False)
        except ProcessorError as failure:
            raise CommandError(self._stopped(gateway, failure, tally, resume=last)) from None
        finally:
            bar.close()
            record_audit(actor=ACTOR, action="payments.imported", subject_type="gateway",
                         subject_id=f"{gateway}:{account}",
                         data={**vars(tally), "since": since.isoformat() if since else None})
        self.stdout.write(
            f"{tally.seen} payment intents: {tally.created} created, {tally.present} already here, "
            f"{tally.skipped} skipped (no money taken, or an unsupported currency); "
            f"{_plural(tally.refunds, 'refund')} made on {gateway} recorded, "
            f"{_plural(tally.disputes, 'dispute')} recorded")

    @staticmethod
    def _stopped(gateway: str, failure: ProcessorError, tally: Tally, *, resume: str | None) -> str:
        done = f"{tally.seen} payment intents were imported before it"
        said = f"({failure.code}) {failure.message}"
        if isinstance(failure, ProcessorDeclined):
            return f"{gateway} refused {said}. Retrying will not change that answer; {done}."
        way_on = f"; to skip what is done, add --starting-after {resume}" if resume else ""
        return (f"{gateway} stopped answering {said}; {done}. It may be back soon: run again to continue "
                f"(nothing is imported twice){way_on}.")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"
