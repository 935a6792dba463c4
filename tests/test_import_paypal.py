"""``manage.py import_payments --gateway paypal``: captures in through the SDK's transaction search
against the fake PayPal, window by window (PayPal answers 31 days at a time), with the refunds
made on PayPal (external refunds) and its disputes, each once however often it runs."""

from __future__ import annotations

import io
from datetime import datetime, timedelta, timezone

import pytest
from django.core.management import CommandError, call_command

from refundops.models import Customer, GatewayCustomer, Payment, Refund, RefundState
from tests.fakes.paypal_server import FakePayPal

pytestmark = pytest.mark.django_db

NOW = datetime.now(timezone.utc)
ALICE = {"account_id": "ALICE00000001", "email_address": "alice@example.com", "name": "Alice Liddell"}


def run(*args: str) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    call_command("import_payments", "--gateway", "paypal", *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def since(days: int) -> str:
    return (NOW - timedelta(days=days)).date().isoformat()


def test_captures_come_in_with_their_payers_and_the_refunds_made_on_paypal(gateways, paypal_fake: FakePayPal):
    first = paypal_fake.add_capture("50.00", payer=ALICE, invoice_id="INV-1", created=NOW - timedelta(days=3))
    second = paypal_fake.add_capture("30.00", payer=ALICE, created=NOW - timedelta(days=2))
    yen = paypal_fake.add_capture("500", "JPY", created=NOW - timedelta(days=1))
    paypal_fake.refund_directly(first, "20.00", created=NOW - timedelta(days=1))

    out, err = run("--since", since(10))

    payments = {p.processor_reference: p for p in Payment.objects.filter(processor="paypal")}
    assert set(payments) == {first, second, yen}
    alice = payments[first]
    assert (alice.status, alice.amount_captured_minor, alice.currency, alice.method_type, alice.order_reference) == (
        Payment.Status.CAPTURED, 5_000, "USD", "paypal", "INV-1")
    assert (payments[yen].amount_captured_minor, payments[yen].currency) == (500, "JPY")
    assert alice.customer_id == payments[second].customer_id != payments[yen].customer_id
    assert (alice.customer.email, alice.customer.name) == ("alice@example.com", "Alice Liddell")
    assert GatewayCustomer.objects.get(processor="paypal").reference == "ALICE00000001"
    refund = alice.refunds.get()
    assert (refund.origin, refund.status, refund.amount_minor) == (Refund.Origin.EXTERNAL, RefundState.SETTLED, 2_000)
    assert refund.created_at.date() == (NOW - timedelta(days=1)).date()
    assert (alice.amount_refunded_minor, alice.refundable_minor) == (2_000, 3_000)
    assert "4 transactions: 3 payments created" in out and "1 refund made on paypal recorded" in out
    assert "transactions" in err


def test_a_long_range_is_walked_in_windows_of_31_days_at_most(gateways, paypal_fake):
    old = paypal_fake.add_capture("10.00", created=NOW - timedelta(days=70))
    recent = paypal_fake.add_capture("20.00", created=NOW - timedelta(hours=1))

    run("--since", since(75))

    assert set(Payment.objects.values_list("processor_reference", flat=True)) == {old, recent}
    searches = [r for r in paypal_fake.received if r.path == "/v1/reporting/transactions"]
    assert len(searches) == 3


def test_running_it_again_imports_nothing_twice_and_learns_new_refunds(gateways, paypal_fake):
    capture = paypal_fake.add_capture("50.00", created=NOW - timedelta(days=2))
    paypal_fake.refund_directly(capture, "5.00")
    run("--since", since(5))
    paypal_fake.refund_directly(capture, "7.00")

    out, _ = run("--since", since(5))

    payment = Payment.objects.get()
    assert sorted(payment.refunds.values_list("amount_minor", flat=True)) == [500, 700]
    assert "0 payments created, 1 already here" in out and "1 refund made on paypal recorded" in out
    assert Customer.objects.count() == 1


def test_a_refund_refundops_made_is_left_to_its_own_records(gateways, paypal_fake):
    capture = paypal_fake.add_capture("50.00", created=NOW - timedelta(days=2))
    run("--since", since(5))
    payment = Payment.objects.get()
    ours = Refund.objects.create(payment=payment, amount_minor=1_000, currency="USD", reason="duplicate",
                                 status=RefundState.APPROVED)
    paypal_fake.refund_directly(capture, "10.00", custom_id=f"{ours.pk}|vd_1|duplicate")

    run("--since", since(5))

    assert list(payment.refunds.values_list("pk", flat=True)) == [ours.pk]


def test_paypal_disputes_come_in_with_their_payments(gateways, paypal_fake):
    capture = paypal_fake.add_capture("50.00", created=NOW - timedelta(days=2))
    won_capture = paypal_fake.add_capture("40.00", created=NOW - timedelta(days=2))
    open_dispute = paypal_fake.add_dispute(capture)
    won = paypal_fake.add_dispute(won_capture)
    paypal_fake.resolve_dispute(won, "RESOLVED_SELLER_FAVOUR")

    out, _ = run("--since", since(5))

    disputed = Payment.objects.get(processor_reference=capture)
    assert (disputed.dispute_status, disputed.dispute_reference) == ("open", open_dispute)
    assert Payment.objects.get(processor_reference=won_capture).dispute_status == "won"
    assert "2 disputes recorded" in out


def test_paypal_refusing_the_credentials_is_final_and_quotes_paypal(gateways, settings, paypal_fake):
    settings.PROCESSORS["paypal"]["default"]["client_secret"] = "wrong"

    with pytest.raises(CommandError) as refused:
        run("--since", since(5))

    message = str(refused.value)
    assert "run again" not in message and "refused" in message
    assert "invalid_client" in message or "AUTHENTICATION_FAILURE" in message


def test_paypal_down_stops_the_import_with_the_window_to_continue_from(gateways, paypal_fake):
    paypal_fake.add_capture("50.00", created=NOW - timedelta(days=2))
    paypal_fake.set_mode("down")

    with pytest.raises(CommandError) as stopped:
        run("--since", since(40))

    message = str(stopped.value)
    assert "run again to continue" in message and f"--since {since(40)}" in message
    assert not Payment.objects.exists()
