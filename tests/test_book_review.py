"""Hostile review of the incomplete-book fixes (issue 27, findings 1, 3, 4): the paths around a
call whose answer was lost on a PayPal capture PayPal cannot list the refunds of. Through the
official PayPal SDK against the fake PayPal and the worker's own services."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.urls import include, path

from processors.base import ProcessorUnavailable
from refundops.models import GatewayAttempt, LedgerDiscrepancy, Refund, RefundState
from refundops.services import payouts
from tests.conftest import post
from tests.fakes.paypal_server import FakePayPal
from tests.test_incomplete_books import orderless_paypal_payment, send_dispute_event

urlpatterns = [path("", include("refundops.urls")), path("webhooks/", include("refundops.webhook_urls"))]
pytestmark = [pytest.mark.urls(__name__), pytest.mark.django_db]
S = RefundState


def test_a_lost_answer_is_not_sent_again_once_paypal_no_longer_keeps_its_request_id(
        api, policy, gateways, paypal_fake: FakePayPal):
    """PayPal pays, the answer is lost, a dispute forbids sending again; the dispute is won after
    PayPal's 45 days of request ids. Sending the same PayPal-Request-Id then is a new refund."""
    payment = orderless_paypal_payment(paypal_fake, "50.00")
    refund_id = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 2_000,
                                              "reason": "customer_request"}).json()["refund"]["id"]
    paypal_fake.set_mode("drop_after", requests=1, path="/refund")  # PayPal pays; the answer is lost
    with pytest.raises(ProcessorUnavailable):
        payouts.submit_refund(refund_id=refund_id)
    dispute_id = paypal_fake.add_dispute(payment.processor_reference)
    send_dispute_event(paypal_fake, "CUSTOMER.DISPUTE.CREATED", dispute_id)
    try:
        payouts.submit_refund(refund_id=refund_id)  # looked up in vain; the dispute forbids a resend
    except ProcessorUnavailable:
        pass
    assert paypal_fake.refund_count == 1

    # Two months on: the dispute is won, and PayPal has long forgotten the request id.
    GatewayAttempt.objects.filter(refund_id=refund_id).update(
        started_at=payouts.timezone.now() - timedelta(days=60))
    paypal_fake.forget_request_ids()
    paypal_fake.resolve_dispute(dispute_id, "RESOLVED_SELLER_FAVOUR")
    send_dispute_event(paypal_fake, "CUSTOMER.DISPUTE.RESOLVED", dispute_id)
    try:  # the stalled sweep's retry
        payouts.submit_refund(refund_id=refund_id)
    except ProcessorUnavailable:
        pass

    assert paypal_fake.refund_count == 1  # the customer is refunded once
    refund = Refund.objects.get(pk=refund_id)
    assert refund.status == S.APPROVED  # may be paid: stays reserved, for a person
    assert LedgerDiscrepancy.objects.filter(refund_id=refund_id, kind=LedgerDiscrepancy.Kind.UNVERIFIABLE,
                                            status=LedgerDiscrepancy.Status.OPEN).exists()
