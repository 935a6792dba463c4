"""``manage.py import_payments``: Stripe payment intents in, through the real adapter against the
fake Stripe, page by page, each once however often it runs, with what Stripe already did to them:
refunds made there (external refunds, counted in every total), disputes open and closed, the
order amount of an authorisation. Errors say whether running it again can help."""

from __future__ import annotations

import io
import time
from datetime import datetime, timedelta, timezone

import pytest
from django.core.management import CommandError, call_command

from audit.models import AuditEntry
from refundops.models import Customer, Dispute, GatewayCustomer, Payment, Refund, RefundState
from refundops.services import payouts
from tests.conftest import make_limits, post
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

    assert "6 payment intents" in err and "created=5" in err  # the progress bar's last state
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

    with pytest.raises(CommandError, match="run again to continue") as stopped:
        run()

    assert "Stripe is temporarily unavailable" in str(stopped.value)
    assert not Payment.objects.exists()


def test_an_import_stopped_midway_resumes_where_it_stopped(gateways, stripe_fake):
    intents = seed(stripe_fake)
    stripe_fake.refuse_next(503, "Stripe is temporarily unavailable.", type="api_error", after=1)

    with pytest.raises(CommandError) as stopped:
        run("--page-size", "2")

    message = str(stopped.value)
    assert "run again to continue" in message
    # The newest two came in; the way on starts after the last one imported.
    assert Payment.objects.count() == 1
    resume = message.split("--starting-after ")[1].split()[0].rstrip(".;,)")
    assert resume == intents["authorised"] or resume == intents["abandoned"]
    out, _ = run("--page-size", "2", "--starting-after", resume)
    assert Payment.objects.count() == 5
    assert "4 payment intents: 4 created" in out


def test_a_bad_key_is_final_and_quotes_stripes_code_and_message(gateways, settings, stripe_fake):
    seed(stripe_fake)
    settings.PROCESSORS["stripe"]["default"]["api_key"] = "sk_test_wrong"

    with pytest.raises(CommandError) as refused:
        run()

    message = str(refused.value)
    assert "Invalid API Key provided" in message and "authentication_failed" in message
    assert "run again" not in message
    assert not Payment.objects.exists()


def test_a_refused_parameter_is_final_and_quotes_stripes_code_and_message(gateways, stripe_fake):
    seed(stripe_fake)
    stripe_fake.refuse_next(400, "Invalid timestamp: must be an integer Unix timestamp in the past.",
                            code="parameter_invalid_integer", param="created[gte]")

    with pytest.raises(CommandError) as refused:
        run()

    message = str(refused.value)
    assert "parameter_invalid_integer" in message and "Invalid timestamp" in message
    assert "run again" not in message


def test_the_command_exits_non_zero_when_stripe_refuses(gateways, stripe_fake):
    stripe_fake.refuse_next(400, "Received unknown parameter: created", code="parameter_unknown")

    with pytest.raises(SystemExit) as exited:
        from django.core.management import ManagementUtility
        ManagementUtility(["manage.py", "import_payments", "--gateway", "stripe"]).execute()

    assert exited.value.code != 0


# -- what Stripe already did -------------------------------------------------------------------------

def test_refunds_made_on_stripe_are_imported_as_external_refunds_and_nothing_more_is_refundable(
        gateways, stripe_fake, api, policy):
    intent = stripe_fake.add_payment_intent(900, customer="cus_alice")
    stripe_fake.refund_directly(intent, 900, reason="requested_by_customer")

    out, _ = run()

    payment = Payment.objects.get(processor_reference=intent)
    assert (payment.amount_captured_minor, payment.amount_refunded_minor, payment.refundable_minor) == (900, 900, 0)
    refund = payment.refunds.get()
    assert (refund.origin, refund.status, refund.amount_minor, refund.reason) == (
        Refund.Origin.EXTERNAL, RefundState.SETTLED, 900, "customer_request")
    assert "1 refund made on stripe recorded" in out
    response = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 800,
                                             "reason": "customer_request"})
    assert response.status_code == 422
    assert response.json()["error"]["code"] in ("PAYMENT_NOT_REFUNDABLE", "AMOUNT_EXCEEDS_REFUNDABLE")
    assert stripe_fake.refund_count == 1


def test_a_partly_refunded_payment_keeps_the_rest_refundable(gateways, stripe_fake):
    intent = stripe_fake.add_payment_intent(5_000)
    stripe_fake.refund_directly(intent, 1_000, reason="duplicate")
    stripe_fake.refund_directly(intent, 500, status="pending")
    stripe_fake.refund_directly(intent, 700, status="failed")

    run()

    payment = Payment.objects.get(processor_reference=intent)
    assert sorted(payment.refunds.values_list("amount_minor", "status", "reason")) == [
        (500, RefundState.SUBMITTED, "customer_request"), (1_000, RefundState.SETTLED, "duplicate")]
    assert payment.refundable_minor == 3_500


def test_refunds_imported_count_in_the_customers_running_totals_on_the_day_they_were_made(
        gateways, stripe_fake, api, rules):
    make_limits(customer_30d_amount_minor=1_000)
    three_days_ago = int(time.time()) - 3 * 86_400
    refunded = stripe_fake.add_payment_intent(5_000, customer="cus_alice", created=three_days_ago - 60)
    stripe_fake.refund_directly(refunded, 900, created=three_days_ago)
    other = stripe_fake.add_payment_intent(5_000, customer="cus_alice")

    run()

    refund = Refund.objects.get(origin=Refund.Origin.EXTERNAL)
    assert refund.created_at.date() == datetime.fromtimestamp(three_days_ago, tz=timezone.utc).date()
    payment = Payment.objects.get(processor_reference=other)
    response = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 200,
                                             "reason": "customer_request"})
    assert response.status_code == 422 and response.json()["error"]["code"] == "DAILY_LIMIT_REACHED"


def test_open_and_closed_disputes_come_in_with_their_payments(gateways, stripe_fake):
    open_intent = stripe_fake.add_payment_intent(3_000)
    won_intent = stripe_fake.add_payment_intent(4_000)
    open_dispute = stripe_fake.add_dispute(stripe_fake.payment_intents[open_intent]["latest_charge"],
                                           reason="product_not_received")
    won = stripe_fake.add_dispute(stripe_fake.payment_intents[won_intent]["latest_charge"])
    stripe_fake.close_dispute(won, "won")

    out, _ = run()

    disputed = Payment.objects.get(processor_reference=open_intent)
    assert (disputed.dispute_status, disputed.dispute_reference) == ("open", open_dispute)
    dispute = disputed.disputes.get()
    assert (dispute.status, dispute.reason, dispute.amount_minor, dispute.processor_dispute_id) == (
        Dispute.Status.OPEN, "product_not_received", 3_000, open_dispute)
    assert dispute.evidence_due_by is not None
    assert Payment.objects.get(processor_reference=won_intent).dispute_status == "won"
    assert "2 disputes recorded" in out


def test_running_it_again_records_each_refund_and_dispute_once_and_learns_new_ones(gateways, stripe_fake):
    intent = stripe_fake.add_payment_intent(5_000)
    stripe_fake.refund_directly(intent, 1_000)
    stripe_fake.add_dispute(stripe_fake.payment_intents[intent]["latest_charge"])
    run()
    stripe_fake.refund_directly(intent, 2_000)

    out, _ = run()

    payment = Payment.objects.get(processor_reference=intent)
    assert sorted(payment.refunds.values_list("amount_minor", flat=True)) == [1_000, 2_000]
    assert payment.disputes.count() == 1 and payment.amount_refunded_minor == 3_000
    assert "1 refund made on stripe recorded" in out and "0 disputes recorded" in out


def test_a_refund_refundops_made_itself_is_not_recorded_again(gateways, stripe_fake):
    intent = stripe_fake.add_payment_intent(5_000)
    run()
    payment = Payment.objects.get(processor_reference=intent)
    refund = Refund.objects.create(payment=payment, amount_minor=1_000, currency="USD", reason="duplicate",
                                   status=RefundState.APPROVED)
    # Paid at Stripe, its answer not yet recorded here (the worker or the webhook records it).
    stripe_fake.refund_directly(intent, 1_000, metadata={"refund_id": refund.pk, "verdict_id": "vd_1"})

    run()

    assert list(payment.refunds.values_list("pk", flat=True)) == [refund.pk]


def test_an_imported_authorisation_has_the_payment_intents_amount_as_its_order_and_can_be_captured(
        gateways, stripe_fake, api):
    intent = stripe_fake.add_payment_intent(9_000, captured=False, customer="cus_bob")

    run()

    payment = Payment.objects.get(processor_reference=intent)
    assert (payment.status, payment.order_amount_minor) == (Payment.Status.AUTHORIZED, 9_000)
    response = post(api, f"/api/v1/payments/{payment.pk}/capture", {"amount": 9_000})
    assert response.status_code == 200, response.json()
    assert stripe_fake.payment_intents[intent]["status"] == "succeeded"


def test_the_cards_brand_and_last_four_come_from_the_charge(gateways, stripe_fake):
    intent = stripe_fake.add_payment_intent(1_000)

    run()

    payment = Payment.objects.get(processor_reference=intent)
    assert (payment.method_type, payment.method_brand, payment.method_last4) == ("card", "visa", "4242")

def test_an_account_that_is_not_configured_is_refused(gateways):
    with pytest.raises(CommandError, match="not configured"):
        run("--account", "nowhere")
