"""What an attacker sends (with an agent key or without one) gets a contract error, never a 500:
NUL bytes and junk in path parameters, JSON nested past any parser's depth on every face, webhook
bodies nobody signed. Each case here once answered 500."""

from __future__ import annotations

import hashlib
import json

import pytest
from django.db import connection
from django.test import Client
from django.test.utils import CaptureQueriesContext
from django.urls import include, path

from processors.models import InboundEvent
from tests.conftest import post

urlpatterns = [path("", include("refundops.urls")), path("webhooks/", include("refundops.webhook_urls"))]
pytestmark = [pytest.mark.urls(__name__), pytest.mark.django_db]

DEEP = "[" * 60_000 + "]" * 60_000  # 120,000 bytes: over the API's size cap as well as any depth
DEEP_SMALL = "[" * 30_000 + "]" * 30_000  # under 64 KiB: only the depth cap stops it


@pytest.mark.parametrize("path,code", [
    ("/api/v1/payments/txn_%00abc", "PAYMENT_NOT_FOUND"),
    ("/api/v1/refunds/rf_%00abc", "REFUND_NOT_FOUND"),
    ("/api/v1/payments/" + "x" * 5000, "PAYMENT_NOT_FOUND"),
    ("/api/v1/refunds/rf_%ff%fe", "REFUND_NOT_FOUND"),
])
def test_an_id_that_cannot_exist_is_not_found_before_any_query(api, policy, path, code):
    with CaptureQueriesContext(connection) as queries:
        response = api.get(path)
    assert response.status_code == 404 and response.json()["error"]["code"] == code, response.content
    looked_up = [q["sql"] for q in queries if "refundops_payment" in q["sql"] or "refundops_refund" in q["sql"]]
    assert looked_up == []


@pytest.mark.parametrize("path", ["/api/v1/payments/txn_%00abc/void", "/api/v1/payments/txn_%00abc/capture",
                                  "/api/v1/disputes/dp_%00x/evidence-drafts"])
def test_a_nul_in_the_path_of_a_post_is_a_validation_error(api, policy, path):
    response = post(api, path, {})
    assert response.status_code in (400, 404) and response.json()["error"]["code"] in (
        "VALIDATION_ERROR", "PAYMENT_NOT_FOUND", "DISPUTE_NOT_FOUND"), response.content


@pytest.mark.parametrize("body", [DEEP, DEEP_SMALL, '{"a":' * 20_000 + "1" + "}" * 20_000])
def test_deep_json_on_the_api_is_payload_too_large(api, policy, body):
    response = api.post("/api/v1/refunds", data=body, content_type="application/json", HTTP_IDEMPOTENCY_KEY="k")
    assert response.status_code == 413 and response.json()["error"]["code"] == "PAYLOAD_TOO_LARGE"


@pytest.fixture
def web() -> Client:
    return Client(enforce_csrf_checks=True)


@pytest.mark.parametrize("gateway", ["sandbox", "stripe", "paypal"])
@pytest.mark.parametrize("body", [DEEP, DEEP_SMALL])
def test_deep_json_on_a_webhook_is_refused_and_recorded(web, gateways, gateway, body):
    response = web.post(f"/webhooks/{gateway}/", data=body, content_type="application/json")
    assert response.status_code in (400, 413), response.content
    assert response.json()["error"]["code"] in ("invalid_signature", "malformed", "payload_too_large")
    event = InboundEvent.objects.get(processor=gateway, verified=False)
    assert len(event.payload) <= 4096


def test_an_unverified_webhook_body_with_nul_is_recorded_and_refused(web, gateways):
    body = b'{"id": "evt_1", "type": "charge.refunded", "x": "\x00\x00"}'
    response = web.post("/webhooks/sandbox/", data=body, content_type="application/json",
                        HTTP_SANDBOX_SIGNATURE="t=1,v1=00")
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_signature"
    event = InboundEvent.objects.get(processor="sandbox", verified=False)
    assert "\x00" not in event.payload and event.payload.startswith('{"id": "evt_1"')
    assert (event.payload_bytes, event.payload_sha256) == (len(body), hashlib.sha256(body).hexdigest())


def test_a_header_with_nul_on_an_unverified_webhook_is_recorded_too(web, gateways):
    response = web.post("/webhooks/stripe/", data=b"{}", content_type="application/json",
                        HTTP_STRIPE_SIGNATURE="t=1,v1=\x00")
    assert response.status_code == 400
    event = InboundEvent.objects.get(processor="stripe", verified=False)
    assert "\x00" not in json.dumps(event.headers).replace("\\u0000", "\x00")


def test_a_webhook_body_over_the_cap_is_413_and_recorded_as_a_prefix(web, gateways, settings):
    body = json.dumps({"id": "evt_big", "type": "x", "pad": "a" * (settings.WEBHOOK_MAX_BODY_BYTES + 10)})
    response = web.post("/webhooks/stripe/", data=body, content_type="application/json")
    assert response.status_code == 413 and response.json()["error"]["code"] == "payload_too_large"
    event = InboundEvent.objects.get(processor="stripe", verified=False)
    assert len(event.payload) <= 4096 and event.payload_bytes == len(body)
