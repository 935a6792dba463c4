"""``manage.py import_payments --gateway stripe [--account default] [--since YYYY-MM-DD]``

Brings payments taken before RefundOps (or outside it) in from the gateway, so refunds can be
asked for on them. Idempotent: a payment is known by its gateway reference (a unique constraint),
so running it again, or two at once, creates each payment once. Progress goes to stderr, a line a
page; the totals to stdout.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import date, datetime, time, timezone
from itertools import islice
from typing import Any, TypeVar

from django.core.management.base import BaseCommand, CommandError
from django.db import IntegrityError, transaction

from audit.services import record_audit
from processors.base import ProcessorError
from processors.money import CURRENCY_EXPONENTS
from processors.registry import UnknownProcessor, get_processor
from processors.stripe import StripeProcessor, StripePaymentIntent
from refundops.models import Customer, GatewayCustomer, Payment

ACTOR = "system:import"
T = TypeVar("T")


@dataclass
class Tally:
    seen: int = 0
    created: int = 0
    present: int = 0
    skipped: int = 0


def pages(items: Iterable[T], size: int) -> Iterator[list[T]]:
    iterator = iter(items)
    while page := list(islice(iterator, size)):
        yield page


def customer_for(intent: StripePaymentIntent, *, account: str) -> Customer:
    """The Stripe customer's one Customer here; a guest checkout gets a customer of its own."""
    email = intent.metadata.get("email", "")
    if not intent.customer:
        return Customer.objects.create(name=f"Stripe guest ({intent.id})", email=email)
    link = GatewayCustomer.objects.select_related("customer").filter(
        processor="stripe", account=account, reference=intent.customer).first()
    if link is not None:
        return link.customer
    customer = Customer.objects.create(name=f"Stripe customer {intent.customer}", email=email)
    GatewayCustomer.objects.create(processor="stripe", account=account, reference=intent.customer,
                                   customer=customer)
    return customer


def payment_fields(intent: StripePaymentIntent) -> dict[str, Any] | None:
    """Our payment for a Stripe payment intent, or None for one that took no money yet."""
    captured_at = datetime.fromtimestamp(intent.created, tz=timezone.utc)
    common = {"currency": intent.amount.currency, "amount_authorized_minor": intent.amount.amount_minor,
              "order_reference": intent.metadata.get("order_reference") or intent.metadata.get("order_id", "")}
    if intent.status == "succeeded":
        return {**common, "status": Payment.Status.CAPTURED, "captured_at": captured_at,
                "amount_captured_minor": intent.amount_received.amount_minor}
    if intent.status == "requires_capture":
        return {**common, "status": Payment.Status.AUTHORIZED, "authorization_reference": intent.id}
    return None  # requires_payment_method, requires_action, processing, canceled: nothing to refund


def import_payment_intent(intent: StripePaymentIntent, *, account: str) -> str:
    """"created", "present" or "skipped"."""
    if Payment.objects.filter(processor="stripe", processor_account=account, processor_reference=intent.id).exists():
        return "present"
    fields = payment_fields(intent)
    if fields is None or intent.amount.currency not in CURRENCY_EXPONENTS:
        return "skipped"
    try:
        with transaction.atomic():
            Payment.objects.create(customer=customer_for(intent, account=account), processor="stripe",
                                   processor_account=account, processor_reference=intent.id,
                                   method_type="card", **fields)
    except IntegrityError:  # another import took it first
        return "present"
    return "created"


class Command(BaseCommand):
    help = "Import existing payments from a gateway (Stripe payment intents). Safe to run again."

    def add_arguments(self, parser) -> None:
        parser.add_argument("--gateway", required=True, choices=["stripe"])
        parser.add_argument("--account", default="default", help="a configured account of the gateway")
        parser.add_argument("--since", type=date.fromisoformat, help="only payments created on or after (UTC)")
        parser.add_argument("--page-size", type=int, default=100, choices=range(1, 101), metavar="1..100")

    def handle(self, *args: Any, gateway: str, account: str, since: date | None, page_size: int,
               **options: Any) -> None:
        try:
            processor = get_processor(gateway, account)
        except (UnknownProcessor, KeyError) as missing:
            raise CommandError(f"{gateway} account {account!r} is not configured: {missing}") from None
        assert isinstance(processor, StripeProcessor)
        created_gte = int(datetime.combine(since, time.min, tzinfo=timezone.utc).timestamp()) if since else None
        tally = Tally()
        try:
            for number, page in enumerate(pages(processor.list_payment_intents(created_gte=created_gte,
                                                                               limit=page_size), page_size), 1):
                for intent in page:
                    outcome = import_payment_intent(intent, account=account)
                    setattr(tally, outcome, getattr(tally, outcome) + 1)
                tally.seen += len(page)
                self.stderr.write(f"page {number}: {len(page)} payment intents; so far {tally.created} created, "
                                  f"{tally.present} already here, {tally.skipped} skipped")
        except ProcessorError as failure:
            raise CommandError(f"{gateway} stopped answering after {tally.seen} payment intents "
                               f"({failure.code}): run again to continue; nothing is imported twice") from None
        finally:
            record_audit(actor=ACTOR, action="payments.imported", subject_type="gateway",
                         subject_id=f"{gateway}:{account}",
                         data={**vars(tally), "since": since.isoformat() if since else None})
        self.stdout.write(f"{tally.seen} payment intents: {tally.created} created, {tally.present} already here, "
                          f"{tally.skipped} skipped (no money taken, or an unsupported currency)")
