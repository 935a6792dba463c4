"""A refund that may be at the gateway is never announced canceled (issue 27, finding 4).

A worker's lease runs out while its PayPal call is still on its way (PayPal is slow); a dispute
opens; another worker looks the refund up, finds nothing at PayPal yet, and must not take that for
"never paid": the first call may still land. Through the official PayPal SDK against the fake.
"""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.db import transaction
from django.test import Client
from django.urls import include, path
from django.utils import timezone

from processors.base import ProcessorUnavailable, RefundRequest
from processors.registry import get_processor
from refundops.models import GatewayAttempt, MerchantEndpoint, Refund, RefundState, WebhookDelivery
from refundops.services import attempts, payouts
from tests.conftest import post
from tests.fakes.fixtures import PAYPAL_WEBHOOK_ID, paypal_payment
from tests.fakes.paypal_server import FakePayPal

urlpatterns = [path("", include("refundops.urls")), path("webhooks/", include("refundops.webhook_urls"))]
pytestmark = [pytest.mark.urls(__name__), pytest.mark.django_db]
S = RefundState


def open_dispute(fake: FakePayPal, capture_id: str) -> None:
    dispute_id = fake.add_dispute(capture_id)
    event = fake.dispute_event("CUSTOMER.DISPUTE.CREATED", dispute_id)
    headers = {f"HTTP_{k.upper().replace('-', '_')}": v
               for k, v in fake.sign_webhook(event, webhook_id=PAYPAL_WEBHOOK_ID).items()}
    answer = Client().post("/webhooks/paypal/", data=json.dumps(event), content_type="application/json", **headers)
    assert answer.status_code == 200


def test_a_lease_that_runs_out_during_a_slow_paypal_call_on_a_disputed_payment_never_announces_canceled(
        api, policy, gateways, paypal_fake: FakePayPal):
    endpoint = MerchantEndpoint.objects.create(url="https://merchant.example/hooks")
    payment = paypal_payment(paypal_fake, "50.00")
    refund_id = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 3_000,
                                              "reason": "customer_request"}).json()["refund"]["id"]
    # Worker A opens its attempt and sends the call; PayPal has not acted yet (it is slow).
    with transaction.atomic():
        attempt = attempts.open_attempt(Refund.objects.select_for_update().get(pk=refund_id))
    GatewayAttempt.objects.filter(pk=attempt.pk).update(lease_until=timezone.now() - timedelta(seconds=1))
    open_dispute(paypal_fake, payment.processor_reference)

    try:  # worker B: A's lease ran out; it looks the refund up at PayPal and finds nothing yet
        payouts.submit_refund(refund_id=refund_id)
    except ProcessorUnavailable:
        pass  # "not now" is an acceptable answer
    # A's call lands at last: PayPal pays, and A records the answer.
    refund = Refund.objects.select_related("payment").get(pk=refund_id)
    result = get_processor("paypal").refund(RefundRequest(
        payment=payouts.payment_ref(refund.payment), amount=refund.money, reason=refund.reason,
        idempotency_key=attempt.idempotency_key, refund_id=refund.pk, verdict_id=refund.verdict_id or ""))
    refund = payouts.record_gateway_result(refund_id=refund_id, result=result, attempt=attempt)

    assert refund.status == S.SETTLED and paypal_fake.refund_count == 1
    history = list(refund.history.order_by("history_date").values_list("status", flat=True))
    assert S.CANCELED not in history, history
    assert not WebhookDelivery.objects.filter(endpoint=endpoint, event_type="refund.canceled").exists()
