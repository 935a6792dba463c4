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

Stripe: payment intents, newest first, each with its latest charge (which says whether there are
refunds or disputes to list). PayPal: the SDK's transaction search, oldest first in windows of at
most 31 days (PayPal's limit; it keeps three years, and a transaction may take up to three hours
to appear there): checkout payments (T00nn) are captures, merchant refunds (T1107) name their
capture; then its disputes API for disputes created since (it lists the last 180 days).
PayPal authorisations not yet captured are not balance-affecting there and are left out.

Running it again imports nothing twice and learns what happened since. A payment and what
happened to it are written in one transaction, so a stop in between leaves nothing half done.
A gateway that stops answering stops the import with the way on ("run again"); a final refusal
quotes the gateway's code and message and exits non-zero. Progress goes to stderr as a bar, the
totals to stdout.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from collections.abc import Iterator
from datetime import date, datetime, time, timedelta, timezone
from typing import Any

from django.core.management.base import BaseCommand, CommandError
from django.db import IntegrityError, transaction
from tqdm import tqdm

from audit.services import record_audit
from processors.base import GatewayRefund, ProcessorDeclined, ProcessorError, PaymentRef, WebhookEvent
from processors.money import CURRENCY_EXPONENTS
from processors.registry import UnknownProcessor, get_processor
from processors.base import RefundStatus
from processors.paypal import PayPalProcessor, PayPalTransaction
from processors.stripe import StripeDispute, StripePaymentIntent, StripeProcessor
from refundops.models import Customer, Dispute, GatewayCustomer, Payment, Reason, Refund
from refundops.services.gateway_events import (
    DISPUTE_STATUSES,
    STRIPE_REASONS,
    apply_dispute_news,
    paypal_dispute_status,
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


# -- PayPal -------------------------------------------------------------------------------------------

PAYPAL_WINDOW = timedelta(days=31) - timedelta(seconds=1)  # one transaction search spans at most 31 days
PAYPAL_HISTORY = timedelta(days=3 * 365)  # how far back the transaction search reaches
PAYPAL_DISPUTE_HISTORY = timedelta(days=180)  # how far back the disputes list reaches
PAYPAL_REFUND_STATUSES: dict[str, RefundStatus] = {"S": "succeeded", "P": "pending", "D": "failed", "V": "canceled"}


def paypal_windows(since: datetime, until: datetime) -> Iterator[tuple[datetime, datetime]]:
    start = since
    while start < until:
        end = min(start + PAYPAL_WINDOW, until)
        yield start, end
        start = end + timedelta(seconds=1)


def import_paypal_capture(txn: PayPalTransaction, *, account: str, tally: Tally) -> None:
    amount = txn.amount
    # Pending (P) or denied (D) took no money yet; a reversed one (V) did, and its refunds follow.
    if amount is None or txn.status not in ("S", "V") or txn.amount_minor <= 0:
        tally.count("skipped")
        return

    def fields() -> dict[str, Any]:
        return {"customer": customer_for(gateway="paypal", account=account, reference=txn.payer_id,
                                         email=txn.payer_email, name=txn.payer_name, guest_of=txn.id),
                "currency": amount.currency, "amount_authorized_minor": amount.amount_minor,
                "amount_captured_minor": amount.amount_minor, "order_amount_minor": amount.amount_minor,
                "status": Payment.Status.CAPTURED, "method_type": "paypal",
                "captured_at": datetime.fromtimestamp(txn.initiated, tz=timezone.utc),
                "order_reference": (txn.invoice or txn.custom)[:100]}

    _, created = find_or_create_payment(gateway="paypal", account=account, reference=txn.id, make=fields)
    tally.count("created" if created else "present")


def import_paypal_refund(txn: PayPalTransaction, *, account: str, tally: Tally) -> None:
    payment = Payment.objects.filter(processor="paypal", processor_account=account,
                                     processor_reference=txn.reference).first()
    if payment is None or txn.amount is None:  # a refund of a payment taken before --since
        return
    custom = txn.custom.split("|")  # ours: "rf_…|vd_…|reason" (PayPalProcessor._custom_id)
    refund = GatewayRefund(processor_refund_id=txn.id, amount=txn.amount,
                           status=PAYPAL_REFUND_STATUSES.get(txn.status, "pending"),
                           our_refund_id=custom[0] if custom[0].startswith("rf_") else "",
                           created_at=datetime.fromtimestamp(txn.initiated, tz=timezone.utc))
    with transaction.atomic():
        tally.refunds += record_refunds(payment, [refund], reason_of=lambda word: Reason.CUSTOMER_REQUEST)


def import_paypal_disputes(processor: PayPalProcessor, *, account: str, since: datetime, tally: Tally) -> None:
    for dispute_id in processor.list_disputes(created_after=since):
        if Dispute.objects.filter(payment__processor="paypal", payment__processor_account=account,
                                  processor_dispute_id=dispute_id).exists():
            continue  # its news come by webhook; known once is enough here
        found = processor.fetch_dispute(dispute_id)
        said = apply_dispute_news(
            processor="paypal", account=account, reference=found.id, event=import_event("paypal", found.id),
            payment_references=found.captures, status=paypal_dispute_status(found), reason=found.reason,
            amount_minor=found.amount.amount_minor if found.amount else None,
            currency=found.amount.currency if found.amount else "", evidence_due_by=found.respond_by)
        tally.disputes += not said.startswith(f"dispute {found.id}: no payment")


# -- the command --------------------------------------------------------------------------------------

class Command(BaseCommand):
    help = ("Import existing payments from a gateway (Stripe payment intents, PayPal captures) with their "
            "refunds and disputes. Safe to run again.")

    def add_arguments(self, parser) -> None:
        parser.add_argument("--gateway", required=True, choices=["stripe", "paypal"])
        parser.add_argument("--account", default="default", help="a configured account of the gateway")
        parser.add_argument("--since", type=date.fromisoformat,
                            help="only payments created on or after (UTC); PayPal: three years back unless given")
        parser.add_argument("--page-size", type=int, default=100, choices=range(1, 501), metavar="1..500",
                            help="Stripe takes at most 100, PayPal 500")
        parser.add_argument("--starting-after", default=None, metavar="pi_…",
                            help="Stripe: continue after this payment intent (an import that stopped names it)")

    def handle(self, *args: Any, gateway: str, account: str, since: date | None, page_size: int,
               starting_after: str | None, **options: Any) -> None:
        try:
            processor = get_processor(gateway, account)
        except (UnknownProcessor, KeyError) as missing:
            raise CommandError(f"{gateway} account {account!r} is not configured: {missing}") from None
        tally = Tally()
        unit = " payment intents" if gateway == "stripe" else " transactions"
        bar = tqdm(unit=unit, file=getattr(self.stderr, "_out", self.stderr), dynamic_ncols=True)

        def progress(n: int = 1) -> None:
            tally.seen += n
            bar.update(n)
            bar.set_postfix(created=tally.created, present=tally.present, skipped=tally.skipped,
                            refunds=tally.refunds, disputes=tally.disputes, refresh=False)

        try:
            if isinstance(processor, StripeProcessor):
                self._import_stripe(processor, account=account, since=since, page_size=min(page_size, 100),
                                    starting_after=starting_after, tally=tally, progress=progress)
            else:
                assert isinstance(processor, PayPalProcessor)
                self._import_paypal(processor, account=account, since=since, page_size=page_size, tally=tally,
                                    progress=progress)
        except ProcessorError as failure:
            raise CommandError(self._stopped(gateway, failure, tally, resume=self.resume)) from None
        finally:
            bar.close()
            record_audit(actor=ACTOR, action="payments.imported", subject_type="gateway",
                         subject_id=f"{gateway}:{account}",
                         data={**vars(tally), "since": since.isoformat() if since else None})
        made = "created" if gateway == "stripe" else "payments created"
        self.stdout.write(
            f"{tally.seen}{unit}: {tally.created} {made}, {tally.present} already here, "
            f"{tally.skipped} skipped (no money taken, or an unsupported currency); "
            f"{_plural(tally.refunds, 'refund')} made on {gateway} recorded, "
            f"{_plural(tally.disputes, 'dispute')} recorded")

    resume: str | None = None  # how to continue, once something is done

    def _import_stripe(self, processor: StripeProcessor, *, account: str, since: date | None, page_size: int,
                       starting_after: str | None, tally: Tally, progress: Callable[[], None]) -> None:
        created_gte = int(datetime.combine(since, time.min, tzinfo=timezone.utc).timestamp()) if since else None
        self.resume = f"--starting-after {starting_after}" if starting_after else None
        for intent in processor.list_payment_intents(created_gte=created_gte, limit=page_size,
                                                     starting_after=starting_after):
            import_stripe_intent(processor, intent, account=account, tally=tally)
            self.resume = f"--starting-after {intent.id}"
            progress()

    def _import_paypal(self, processor: PayPalProcessor, *, account: str, since: date | None, page_size: int,
                       tally: Tally, progress: Callable[[], None]) -> None:
        now = datetime.now(timezone.utc).replace(microsecond=0)
        start = datetime.combine(since, time.min, tzinfo=timezone.utc) if since else now - PAYPAL_HISTORY
        for window_start, window_end in paypal_windows(start, now):
            self.resume = f"--since {window_start.date().isoformat()}"
            page, pages = 1, 1
            while page <= pages:
                found = processor.search_transactions(start=window_start, end=window_end, page=page,
                                                      page_size=page_size)
                pages = found.total_pages
                for txn in found.transactions:
                    if txn.event_code.startswith("T00"):  # a payment received
                        import_paypal_capture(txn, account=account, tally=tally)
                    elif txn.event_code == "T1107":  # a refund the merchant made
                        import_paypal_refund(txn, account=account, tally=tally)
                    progress()
                page += 1
        self.resume = f"--since {max(start, now - PAYPAL_DISPUTE_HISTORY).date().isoformat()}"
        import_paypal_disputes(processor, account=account, since=max(start, now - PAYPAL_DISPUTE_HISTORY),
                               tally=tally)

    @staticmethod
    def _stopped(gateway: str, failure: ProcessorError, tally: Tally, *, resume: str | None) -> str:
        done = f"{tally.seen} were read before it"
        said = f"({failure.code}) {failure.message}"
        if isinstance(failure, ProcessorDeclined):
            return f"{gateway} refused {said}. Retrying will not change that answer; {done}."
        way_on = f"; to skip what is done, add {resume}" if resume else ""
        return (f"{gateway} stopped answering {said}; {done}. It may be back soon: run again to continue "
                f"(nothing is imported twice){way_on}.")


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"
