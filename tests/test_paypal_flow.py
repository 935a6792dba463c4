"""A refund on a PayPal payment, end to end through the real PayPal adapter and SDK against the
fake PayPal: paid by the worker, settled by PayPal's answer or by the status sync."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.utils import timezone

from refundops import tasks
from refundops.models import Refund, RefundState
from refundops.services import payouts
from tests.conftest import post
from tests.fakes.fixtures import paypal_payment, wait_for
from tests.fakes.paypal_server import FakePayPal

S = RefundState


def status_of(refund_id: str) -> str:
    return Refund.objects.values_list("status", flat=True).get(pk=refund_id)


@pytest.mark.django_db(transaction=True)
def test_an_agent_refund_on_a_paypal_payment_is_paid_by_the_worker_and_settles(api, policy, gateways,
                                                                               paypal_fake: FakePayPal, worker):
    payment = paypal_payment(paypal_fake, "120.00")

    response = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 4_550,
                                             "reason": "customer_request"})

    assert response.status_code == 201
    rf = response.json()["refund"]["id"]
    wait_for(lambda: status_of(rf) == S.SETTLED, what="settled")
    refund = Refund.objects.get(pk=rf)
    on_paypal = paypal_fake.refunds[refund.processor_refund_id]
    assert on_paypal["amount"] == {"currency_code": "USD", "value": "45.50"}
    assert on_paypal["capture_id"] == payment.processor_reference
    assert on_paypal["custom_id"] == f"{rf}|{refund.verdict_id}|customer_request"
    [sent] = [r for r in paypal_fake.received if r.path.endswith("/refund")]
    assert sent.header("PayPal-Request-Id") == payouts.gateway_idempotency_key(refund)
    assert json.loads(sent.body)["amount"]["value"] == "45.50"
    payment.refresh_from_db()
    assert (payment.amount_refunded_minor, payment.amount_reserved_minor) == (4_550, 0)


@pytest.mark.django_db
def test_the_status_sync_settles_a_refund_paypal_completed_later(gateways, paypal_fake: FakePayPal):
    payment = paypal_payment(paypal_fake, "50.00")
    refund = Refund.objects.create(payment=payment, amount_minor=2_000, currency="USD",
                                   reason="customer_request", status=S.APPROVED)
    paypal_fake.next_refund_status = "PENDING"
    refund = payouts.submit_refund(refund_id=refund.pk)
    assert refund.status == S.SUBMITTED
    paypal_fake.set_refund_status(refund.processor_refund_id, "COMPLETED")
    Refund.objects.filter(pk=refund.pk).update(submitted_at=timezone.now() - timedelta(minutes=5))

    assert tasks.sync_submitted_refunds(older_than_seconds=60) == 1

    assert status_of(refund.pk) == S.SETTLED


@pytest.mark.django_db
def test_a_paypal_refund_that_fails_later_frees_its_amount(gateways, paypal_fake: FakePayPal):
    payment = paypal_payment(paypal_fake, "50.00")
    refund = Refund.objects.create(payment=payment, amount_minor=2_000, currency="USD",
                                   reason="customer_request", status=S.APPROVED)
    refund = payouts.submit_refund(refund_id=refund.pk)
    assert refund.status == S.SETTLED
    paypal_fake.set_refund_status(refund.processor_refund_id, "FAILED")

    refund = payouts.sync_refund(refund_id=refund.pk)

    assert refund.status == S.FAILED
    payment.refresh_from_db()
    assert payment.refundable_minor == 5_000
