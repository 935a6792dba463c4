"""A refund on a Stripe payment, end to end through the real Stripe adapter and SDK against the
fake Stripe: routed to the account that took the payment, paid by the worker, settled by the
gateway's answer or by the status sync."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from urllib.parse import parse_qsl

import pytest
from django.utils import timezone

from refundops import tasks
from refundops.models import Refund, RefundState
from refundops.services import payouts
from tests.conftest import post
from tests.fakes.fixtures import stripe_account, stripe_payment, wait_for
from tests.fakes.stripe_server import FakeStripe

S = RefundState


def status_of(refund_id: str) -> str:
    return Refund.objects.values_list("status", flat=True).get(pk=refund_id)


def refund_posts(fake: FakeStripe) -> list[dict[str, str]]:
    with fake.lock:
        return [dict(parse_qsl(r.body.decode())) | {"idempotency-key": r.header("Idempotency-Key") or ""}
                for r in fake.received if r.method == "POST" and r.path == "/v1/refunds"]


@pytest.mark.django_db(transaction=True)
def test_an_agent_refund_on_a_stripe_payment_is_paid_by_the_worker_and_settles(api, policy, gateways,
                                                                               stripe_fake, worker):
    payment = stripe_payment(stripe_fake, 8_000)

    response = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 2_500,
                                             "reason": "product_issue"})

    assert response.status_code == 201
    rf = response.json()["refund"]["id"]
    wait_for(lambda: status_of(rf) == S.SETTLED, what="settled")
    refund = Refund.objects.get(pk=rf)
    assert [h.status for h in refund.history.order_by("history_date")] == [
        S.REQUESTED, S.APPROVED, S.SUBMITTED, S.SETTLED]
    on_stripe = stripe_fake.refunds[refund.processor_refund_id]
    assert (on_stripe["payment_intent"], on_stripe["amount"], on_stripe["reason"]) == (
        payment.processor_reference, 2_500, "requested_by_customer")
    assert on_stripe["metadata"] == {"refund_id": rf, "verdict_id": refund.verdict_id, "our_reason": "product_issue"}
    [sent] = refund_posts(stripe_fake)
    assert sent["idempotency-key"] == payouts.gateway_idempotency_key(refund)
    payment.refresh_from_db()
    assert (payment.amount_refunded_minor, payment.amount_reserved_minor) == (2_500, 0)


@pytest.fixture
def eu_stripe() -> Iterator[FakeStripe]:
    fake = FakeStripe(api_key="sk_test_eu_account").start()
    yield fake
    fake.stop()


@pytest.mark.django_db
def test_a_refund_goes_to_the_stripe_account_that_took_the_payment(gateways, stripe_fake, eu_stripe):
    gateways["stripe"]["eu"] = stripe_account(eu_stripe, webhook_secret="whsec_eu")
    payment = stripe_payment(eu_stripe, 6_000, account="eu")
    refund = Refund.objects.create(payment=payment, amount_minor=1_000, currency="USD", reason="duplicate",
                                   status=S.APPROVED)

    refund = payouts.submit_refund(refund_id=refund.pk)

    assert refund.status == S.SETTLED
    assert refund.processor_refund_id in eu_stripe.refunds
    assert eu_stripe.refund_count == 1 and stripe_fake.refund_count == 0
    assert {r.header("Authorization") for r in eu_stripe.received} == {"Bearer sk_test_eu_account"}


@pytest.mark.django_db
def test_the_status_sync_settles_a_refund_stripe_finished_later(settings, gateways, stripe_fake):
    settings.REFUND_SYNC_AFTER_SECONDS = 60
    payment = stripe_payment(stripe_fake, 6_000)
    refund = Refund.objects.create(payment=payment, amount_minor=1_000, currency="USD", reason="duplicate",
                                   status=S.APPROVED)
    stripe_fake.next_refund_status = "pending"
    refund = payouts.submit_refund(refund_id=refund.pk)
    assert refund.status == S.SUBMITTED
    stripe_fake.set_refund_status(refund.processor_refund_id, "succeeded")

    assert tasks.sync_submitted_refunds() == 0  # submitted just now: its own follow-ups look first
    Refund.objects.filter(pk=refund.pk).update(submitted_at=timezone.now() - timedelta(minutes=5))
    assert tasks.sync_submitted_refunds() == 1

    assert status_of(refund.pk) == S.SETTLED


@pytest.mark.django_db
def test_a_refund_stripe_declines_fails_with_stripes_code(gateways, stripe_fake):
    payment = stripe_payment(stripe_fake, 1_000)
    refund = Refund.objects.create(payment=payment, amount_minor=1_000, currency="USD", reason="duplicate",
                                   status=S.APPROVED)
    stripe_fake.charges[stripe_fake.payment_intents[payment.processor_reference]["latest_charge"]][
        "amount_refunded"] = 1_000  # refunded in Stripe's dashboard before we got there

    refund = payouts.submit_refund(refund_id=refund.pk)

    assert refund.status == S.FAILED and refund.failure_code == "charge_already_refunded"
