"""``manage.py import_payments``: Stripe payment intents in, through the real adapter against the
fake Stripe, page by page, each once however often it runs."""

from __future__ import annotations

import io
import time
from datetime import datetime, timedelta, timezone

import pytest
from django.core.management import CommandError, call_command

from audit.models import AuditEntry
from refundops.models import Customer, GatewayCustomer, Payment, Refund, RefundState
from refundops.services import payouts
from tests.fakes.stripe_server import FakeStripe

pytestmark = pytest.mark.django_db

def run(*args: str) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    call_command("import_payments", "--gateway", "stripe", *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()

def seed(fake: FakeStripe) -> dict[str, str]:
    now = int(time.time())
    intents = {
        "alice_1": fake.add_payment_intent(5_000, customer="cus_alice", created=now - 60),
        "alice_2": fake.add_payment_intent(7_000, customer="cus_alice", created=now - 50),
        "bob": fake.add_payment_intent(1_999, "eur", customer="cus_bob", created=now - 40),
        "guest": fake.add_payment_intent(2_500, created=now - 30),
        "authorised": fake.add_payment_intent(9_000, captured=False, customer="cus_bob", created=now - 20),
        "abandoned": fake.add_payment_intent(3_000, created=now - 10),
    }
    fake.payment_intents[intents["abandoned"]].update(status="requires_payment_method", amount_received=0)
    return intents

def test_payment_intents_are_imported_page_by_page_with_their_customers(gateways, stripe_fake):
    intents = seed(stripe_fake)

    out, err = run("--page-size", "2")

    assert err.splitlines() == [
        "page 1: 2 payment intents; so far 1 created, 0 already here, 1 skipped",
        "page 2: 2 payment intents; so far 3 created, 0 already here, 1 skipped",
        "page 3: 2 payment intents; so far 5 created, 0 already here, 1 skipped",
    ]
    assert "6 payment intents: 5 created, 0 already here, 1 skipped" in out
    imported = {p.processor_reference: p for p in Payment.objects.filter(processor="stripe")}
    assert set(imported) == {intents[k] for k in ("alice_1", "alice_2", "bob", "guest", "authorised")}
    alice_1, bob, authorised = (imported[intents[k]] for k in ("alice_1", "bob", "authorised"))
    assert (alice_1.status, alice_1.amount_captured_minor, alice_1.currency) == ("captured", 5_000, "USD")
    assert (bob.currency, bob.amount_captured_minor) == ("EUR", 1_999)
    assert (authorised.status, authorised.amount_captured_minor, authorised.authorization_reference) == (
        "authorized", 0, intents["authorised"])
    assert imported[intents["alice_2"]].customer_id == alice_1.customer_id
    assert authorised.customer_id == bob.customer_id != alice_1.customer_id
    assert Customer.objects.count() == 3 and GatewayCustomer.objects.count() == 2
    assert AuditEntry.objects.filter(action="payments.imported", subject_id="stripe:default").exists()

def test_running_it_again_imports_nothing_twice(gateways, stripe_fake):
    seed(stripe_fake)
    run()

    out, _ = run()

    assert "6 payment intents: 0 created, 5 already here, 1 skipped" in out
    assert Payment.objects.count() == 5 and Customer.objects.count() == 3

def test_since_takes_only_payments_created_from_that_day(gateways, stripe_fake):
    old = int((datetime.now(timezone.utc) - timedelta(days=40)).timestamp())
    stripe_fake.add_payment_intent(4_000, customer="cus_old", created=old)
    recent = stripe_fake.add_payment_intent(6_000, customer="cus_new")

    run("--since", (datetime.now(timezone.utc) - timedelta(days=7)).date().isoformat())

    assert list(Payment.objects.values_list("processor_reference", flat=True)) == [recent]

def test_an_imported_payment_can_be_refunded_through_stripe(gateways, stripe_fake):
    intent = stripe_fake.add_payment_intent(5_000, customer="cus_alice")
    run()
    payment = Payment.objects.get(processor_reference=intent)
    refund = Refund.objects.create(payment=payment, amount_minor=1_000, currency="USD", reason="duplicate",
                                   status=RefundState.APPROVED)

    refund = payouts.submit_refund(refund_id=refund.pk)

    assert refund.status == RefundState.SETTLED
    assert stripe_fake.refunds[refund.processor_refund_id]["payment_intent"] == intent

def test_a_gateway_that_stops_answering_stops_the_import_with_a_way_on(gateways, stripe_fake):
    seed(stripe_fake)
    stripe_fake.set_mode("down")

    with pytest.raises(CommandError, match="run again to continue"):
        run()

    assert not Payment.objects.exists()

def test_an_account_that_is_not_configured_is_refused(gateways):
    with pytest.raises(CommandError, match="not configured"):
        run("--account", "nowhere")
