"""Voids and captures whose answer is lost (issue 8, finding 3): a timeout or a dropped connection
after the gateway acted is never recorded as "nothing changed". The operation is ``unknown`` until
the payment is looked up at the gateway; a retry with the same key looks it up instead of replaying
a failure; a process that died mid-call leaves nothing pending forever. Through the fake Stripe and
PayPal servers, spoken to by the official SDKs."""

from __future__ import annotations

import uuid
from datetime import timedelta
from decimal import Decimal

import pytest
from django.utils import timezone

from audit.models import AuditEntry, Verdict
from processors.base import OutcomeUnknown, request_may_have_been_sent
from processors.money import Money
from refundops.models import Payment, PaymentOperation
from refundops.services import payments
from tests.conftest import make_customer, post
from tests.fakes.fixtures import paypal_account, stripe_account
from tests.fakes.paypal_server import FakePayPal
from tests.fakes.stripe_server import FakeStripe

pytestmark = pytest.mark.django_db
Status = PaymentOperation.Status


@pytest.fixture
def impatient(settings, stripe_fake: FakeStripe, paypal_fake: FakePayPal):
    """Both gateways, with a client timeout short enough for the fakes' slow answers to outlast."""
    settings.PROCESSORS = {"stripe": {"default": {**stripe_account(stripe_fake), "timeout": 0.5}},
                           "paypal": {"default": {**paypal_account(paypal_fake), "timeout": 0.5}}}


def stripe_authorisation(fake: FakeStripe, amount: int = 8_000) -> Payment:
    intent = fake.add_payment_intent(amount, captured=False)
    return Payment.objects.create(
        customer=make_customer(), processor="stripe", processor_reference=intent, authorization_reference=intent,
        currency="USD", amount_authorized_minor=amount, order_amount_minor=amount,
        status=Payment.Status.AUTHORIZED, method_type="card")


def paypal_authorisation(fake: FakePayPal, value: str = "80.00") -> Payment:
    authorization_id = fake.add_authorization(value)
    minor = int(Decimal(value) * 100)
    return Payment.objects.create(
        customer=make_customer(), processor="paypal", processor_reference=authorization_id,
        authorization_reference=authorization_id, currency="USD", amount_authorized_minor=minor,
        order_amount_minor=minor, status=Payment.Status.AUTHORIZED, method_type="paypal")


def writes(fake, verb: str) -> int:
    """How many void or capture requests reached the fake."""
    return sum(1 for r in fake.received if r.method == "POST" and r.path.endswith(f"/{verb}"))


# -- the answer lost, the gateway looked up at once ----------------------------------------------------

@pytest.mark.parametrize("mode", ["slow_after", "drop_after"])
def test_a_stripe_capture_whose_answer_is_lost_is_looked_up_and_recorded_done(api, impatient, stripe_fake, mode):
    payment = stripe_authorisation(stripe_fake)
    stripe_fake.set_mode(mode, slow_seconds=1.5, requests=1)  # Stripe captures; the answer never comes

    response = post(api, f"/api/v1/payments/{payment.pk}/capture", {"amount": 8_000})

    assert response.status_code == 200, response.json()
    assert response.json()["operation"]["status"] == "succeeded"
    payment.refresh_from_db()
    assert (payment.status, payment.amount_captured_minor) == (Payment.Status.CAPTURED, 8_000)
    assert writes(stripe_fake, "capture") == 1
    operation = PaymentOperation.objects.get(payment=payment)
    assert operation.gateway_reference == payment.authorization_reference
    assert AuditEntry.objects.get(action="payment.capture_succeeded").data["resolved_by_lookup"] is True


def test_a_paypal_void_whose_connection_drops_after_paypal_voided_is_recorded_voided(api, impatient, paypal_fake):
    payment = paypal_authorisation(paypal_fake)
    paypal_fake.set_mode("drop_after", requests=1, path="/void")  # PayPal voids; the answer never comes

    response = post(api, f"/api/v1/payments/{payment.pk}/void", {})

    assert response.status_code == 200, response.json()
    payment.refresh_from_db()
    assert payment.status == Payment.Status.VOIDED
    assert paypal_fake.authorizations[payment.authorization_reference]["status"] == "VOIDED"


def test_a_paypal_capture_looked_up_after_a_timeout_takes_the_amount_paypal_captured(api, impatient, paypal_fake):
    payment = paypal_authorisation(paypal_fake, "80.00")
    paypal_fake.set_mode("slow_after", slow_seconds=1.5, requests=1, path="/capture")

    response = post(api, f"/api/v1/payments/{payment.pk}/capture", {"amount": 8_000})

    assert response.status_code == 200, response.json()
    operation = PaymentOperation.objects.get(payment=payment)
    capture_ids = [c["id"] for c in paypal_fake.captures.values()
                   if c["authorization_id"] == payment.authorization_reference]
    assert operation.status == Status.SUCCEEDED and operation.gateway_reference == capture_ids[0]
    payment.refresh_from_db()
    assert payment.amount_captured_minor == 8_000


# -- the gateway cannot be asked either: unknown, then settled by the same key ---------------------------

def test_an_unknown_capture_answers_202_unknown_and_the_same_key_later_learns_it_succeeded(
        api, impatient, stripe_fake):
    payment = stripe_authorisation(stripe_fake)
    stripe_fake.set_mode("slow_after", slow_seconds=1.5)  # the look-up times out too
    key = uuid.uuid4().hex

    first = post(api, f"/api/v1/payments/{payment.pk}/capture", {"amount": 8_000}, key=key)

    assert first.status_code == 202, first.json()
    assert first.json()["operation"]["status"] == "unknown"
    payment.refresh_from_db()
    assert payment.status == Payment.Status.AUTHORIZED  # not known to be captured: not recorded so
    other = post(api, f"/api/v1/payments/{payment.pk}/void", {})  # nothing else while unknown
    assert other.status_code == 422 and other.json()["error"]["code"] == "PAYMENT_NOT_VOIDABLE"

    stripe_fake.set_mode("up")
    again = post(api, f"/api/v1/payments/{payment.pk}/capture", {"amount": 8_000}, key=key)

    assert again.status_code == 200, again.json()
    assert again.json()["operation"]["status"] == "succeeded" and again.json()["deduplicated"] is True
    assert writes(stripe_fake, "capture") == 1  # looked up, never sent again
    payment.refresh_from_db()
    assert payment.status == Payment.Status.CAPTURED
    replay = post(api, f"/api/v1/payments/{payment.pk}/capture", {"amount": 8_000}, key=key)
    assert replay.status_code == 200  # the settled answer is the key's answer from now on


def test_an_unknown_void_that_the_gateway_never_made_fails_and_frees_the_payment(api, impatient, stripe_fake):
    payment = stripe_authorisation(stripe_fake)
    key = uuid.uuid4().hex
    stripe_fake.set_mode("unreachable")  # the request read, the connection closed: nobody knows

    first = post(api, f"/api/v1/payments/{payment.pk}/void", {}, key=key)

    assert first.status_code == 202 and first.json()["operation"]["status"] == "unknown"
    stripe_fake.set_mode("up")
    again = post(api, f"/api/v1/payments/{payment.pk}/void", {}, key=key)

    assert again.status_code == 503, again.json()
    error = again.json()["error"]
    assert (error["code"], error["gateway_code"]) == ("GATEWAY_UNAVAILABLE", "not_made")
    assert "new Idempotency-Key" in error["message"]
    fresh = post(api, f"/api/v1/payments/{payment.pk}/void", {})
    assert fresh.status_code == 200 and stripe_fake.payment_intents[payment.authorization_reference][
        "status"] == "canceled"


# -- never reached: plain unavailable, nothing changed ----------------------------------------------------

def test_a_gateway_that_refuses_the_connection_is_unavailable_and_nothing_changed(api, settings, stripe_fake):
    payment = stripe_authorisation(stripe_fake)
    stripe_fake.stop()  # nothing listens on its port any more: the request is never sent
    settings.PROCESSORS = {"stripe": {"default": {**stripe_account(stripe_fake), "timeout": 0.5}}}

    response = post(api, f"/api/v1/payments/{payment.pk}/capture", {"amount": 8_000})

    assert response.status_code == 503, response.json()
    assert response.json()["error"]["code"] == "GATEWAY_UNAVAILABLE"
    assert PaymentOperation.objects.get(payment=payment).status == Status.FAILED


def test_a_refused_connection_is_never_sent_and_a_read_timeout_may_have_been():
    import requests

    with pytest.raises(requests.ConnectionError) as refused:
        requests.post("http://127.0.0.1:9/", timeout=0.5)  # discard port: nothing listens
    assert request_may_have_been_sent(refused.value) is False
    assert request_may_have_been_sent(requests.exceptions.ReadTimeout("read timed out")) is True


# -- a process that died mid-call ------------------------------------------------------------------------

def stalled_capture(payment: Payment, *, lease_over: bool = True) -> PaymentOperation:
    """What a process leaves that died after deciding a capture and before recording the answer."""
    verdict = Verdict.objects.create(operation="payment.capture", outcome="approved", payment_id=payment.pk)
    lease = timezone.now() + (timedelta(seconds=-1) if lease_over else timedelta(minutes=2))
    return PaymentOperation.objects.create(payment=payment, kind="capture", amount_minor=8_000, currency="USD",
                                           verdict=verdict, lease_until=lease)


def test_the_resolver_settles_a_capture_left_pending_by_a_dead_process_from_the_gateways_books(
        impatient, stripe_fake):
    captured, untouched, in_lease = (stripe_authorisation(stripe_fake) for _ in range(3))
    gone = stalled_capture(captured)
    stripe_fake.payment_intents[captured.authorization_reference].update(  # it reached Stripe before dying
        status="succeeded", amount_received=8_000, amount_capturable=0)
    never = stalled_capture(untouched)
    live = stalled_capture(in_lease, lease_over=False)

    assert payments.resolve_stalled_operations() == 2

    statuses = [PaymentOperation.objects.get(pk=o.pk).status for o in (gone, never, live)]
    assert statuses == [Status.SUCCEEDED, Status.FAILED, Status.PENDING]
    captured.refresh_from_db()
    untouched.refresh_from_db()
    assert (captured.status, captured.amount_captured_minor) == (Payment.Status.CAPTURED, 8_000)
    assert untouched.status == Payment.Status.AUTHORIZED


def test_the_resolver_leaves_an_operation_unknown_while_the_gateway_cannot_be_asked(impatient, stripe_fake):
    payment = stripe_authorisation(stripe_fake)
    operation = stalled_capture(payment)
    stripe_fake.set_mode("down")

    assert payments.resolve_stalled_operations() == 0
    assert payments.resolve_stalled_operations() == 0  # asked again next time, recorded once

    operation.refresh_from_db()
    assert operation.status == Status.UNKNOWN
    assert AuditEntry.objects.filter(action="payment.capture_unknown").count() == 1
    stripe_fake.set_mode("up")
    assert payments.resolve_stalled_operations() == 1
    assert PaymentOperation.objects.get(pk=operation.pk).status == Status.FAILED


def test_an_sdk_timeout_after_a_write_is_an_unknown_outcome(impatient, stripe_fake):
    from processors.registry import get_processor
    from refundops.services.payouts import payment_ref

    payment = stripe_authorisation(stripe_fake)
    stripe_fake.set_mode("slow_after", slow_seconds=1.5, requests=1)
    with pytest.raises(OutcomeUnknown):
        get_processor("stripe").capture(payment_ref(payment), Money(8_000, "USD"),
                                        idempotency_key="k-1", verdict_id="vd_1")
    assert get_processor("stripe").fetch_payment_state(payment_ref(payment)).status == "captured"


# -- the MCP descriptions say what the service does -------------------------------------------------------

def test_the_mcp_descriptions_tell_agents_the_same_key_for_unknown_and_a_new_key_when_unavailable():
    from refundops.mcp_server import TOOLS

    for name in ("void_authorization", "capture_payment"):
        description = next(spec.tool.description for spec in TOOLS if spec.tool.name == name)
        assert "'unknown'" in description and "SAME idempotency_key" in description
        assert "GATEWAY_UNAVAILABLE means the gateway was not reached" in description
        assert "NEW idempotency_key" in description
        assert "retry later with the same idempotency_key" not in description
