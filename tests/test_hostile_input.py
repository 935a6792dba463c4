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


# -- numbers JSON has no word for, and keys longer than any column (issue 28, finding 6) ------------

def _posts(world) -> dict[str, tuple[str, dict]]:
    """Every POST of the API, each with a body that would otherwise be decided on."""
    return {
        "refund": ("/api/v1/refunds", {"transaction_id": world.payment.pk, "reason": "duplicate", "amount": 100}),
        "check": ("/api/v1/refunds/check", {"transaction_id": world.payment.pk, "reason": "duplicate", "amount": 100}),
        "void": (f"/api/v1/payments/{world.authorization.pk}/void", {"note": "n"}),
        "capture": (f"/api/v1/payments/{world.authorization.pk}/capture", {"amount": 100}),
        "link": ("/api/v1/payment-links", {"transaction_id": world.authorization.pk, "template": world.template.pk,
                                           "amount": 100}),
        "evidence": (f"/api/v1/disputes/{world.dispute.pk}/evidence-drafts", {"summary": "s"}),
    }


POSTS = ["refund", "check", "void", "capture", "link", "evidence"]


@pytest.fixture
def world(policy, gateways):
    from tests.test_capabilities import build_world
    return build_world()


def _stored_rows() -> dict[str, int]:
    from refundops.models import DisputeEvidenceDraft, IdempotencyRecord, PaymentLink, Refund
    return {model.__name__: model.objects.count() for model in (Refund, IdempotencyRecord, PaymentLink,
                                                                DisputeEvidenceDraft)}


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e999"])
@pytest.mark.parametrize("operation", POSTS)
def test_a_number_json_cannot_spell_is_a_validation_error_and_stores_only_the_refusal(api, world, operation, number):
    from audit.models import Verdict
    path, body = _posts(world)[operation]
    text = json.dumps({**body, "note": "__N__"}).replace('"__N__"', number)
    before = _stored_rows()
    response = api.post(path, data=text, content_type="application/json", HTTP_IDEMPOTENCY_KEY="nan-key")
    assert response.status_code == 400, response.content[:300]
    error = response.json()["error"]
    assert error["code"] == "VALIDATION_ERROR" and "NaN" in error["message"] and error["field"] == "body", error
    assert Verdict.objects.get(pk=error["verdict_id"]).code == "VALIDATION_ERROR"
    assert _stored_rows() == before


@pytest.mark.parametrize("valid_body", [True, False], ids=["valid-body", "invalid-body"])
@pytest.mark.parametrize("operation", POSTS)
def test_an_idempotency_key_longer_than_its_column_is_a_client_error(api, world, operation, valid_body):
    from audit.models import Verdict
    path, body = _posts(world)[operation]
    before = _stored_rows()
    response = api.post(path, data=json.dumps(body if valid_body else {**body, "unknown_field": 1}),
                        content_type="application/json", HTTP_IDEMPOTENCY_KEY="k" * 300)
    error = response.json()["error"]
    assert response.status_code == 400, response.content[:300]
    assert error["code"] == ("IDEMPOTENCY_KEY_REQUIRED" if valid_body else "VALIDATION_ERROR"), error
    if valid_body:
        assert "255" in error["message"] and "300" in error["message"], error
    verdict = Verdict.objects.get(pk=error["verdict_id"])
    assert verdict.code == error["code"] and verdict.idempotency_key == ""
    assert _stored_rows() == before


def test_mcp_in_process_refuses_arguments_nested_past_the_cap_as_rest_does(agent_key, policy):
    """Over stdio (and in process) no HTTP guard parses the message: the tool call refuses it."""
    from audit.models import Verdict
    from tests.test_mcp import call, error_of
    arguments = {"transaction_id": "txn_x", "reason": "duplicate", "idempotency_key": "deep"}
    deep: dict = {"a": 1}
    for _ in range(31):  # the arguments are level 1: agent at level 2 holds 31 more
        deep = {"a": deep}
    error = error_of(call(agent_key[1], "create_refund", {**arguments, "agent": deep}))
    assert error["code"] == "PAYLOAD_TOO_LARGE", error
    assert Verdict.objects.get(pk=error["verdict_id"]).code == "PAYLOAD_TOO_LARGE"


def test_mcp_in_process_answers_a_bug_as_internal_error_without_its_text(agent_key, policy, monkeypatch):
    from refundops.services import refunds
    from tests.test_mcp import call, error_of

    def broken(**kwargs):
        raise RuntimeError("psycopg: relation refundops_refund column secret_note")

    monkeypatch.setattr(refunds, "refund_detail", broken)
    result = call(agent_key[1], "get_refund", {"refund_id": "rf_1"})
    error = error_of(result)
    assert error["code"] == "INTERNAL_ERROR" and error["request_id"] in error["message"], error
    assert "psycopg" not in json.dumps(result.model_dump(mode="json"))


# -- NUL in a page's path or query, before PostgreSQL sees it (issue 28, finding 7) ----------------

@pytest.fixture
def auditor(client):
    from django.contrib.auth.models import User
    from django.core.management import call_command
    User.objects.create_user("read-only", password="pw")
    call_command("grant_role", "read-only", "auditor", stdout=open("/dev/null", "w"))
    client.force_login(User.objects.get(username="read-only"))
    return client


@pytest.mark.parametrize("url,status", [
    ("/admin/refundops/refund/rf_%00/change/", 404),
    ("/admin/refundops/refund/rf_%00/history/", 404),
    ("/admin/audit/verdict/vd_%00/change/", 404),
    ("/admin/refundops/refund/?status__exact=%00", 400),
    ("/admin/refundops/refund/?q=%00", 400),
    ("/admin/refundops/refund/export.csv?status__exact=%00", 400),
    ("/admin/audit/auditentry/export.csv?q=a%00b", 400),
    ("/admin/refundops/refund/?%00=1", 400),
])
def test_a_nul_in_an_admin_path_or_query_is_a_client_error_for_the_read_only_auditor(auditor, url, status):
    response = auditor.get(url)
    assert response.status_code == status, (response.status_code, response.content[:300])
    error = response.json()["error"]
    assert error["code"] == ("NOT_FOUND" if status == 404 else "VALIDATION_ERROR") and "NUL" in error["message"]


def test_a_nul_in_an_admin_form_is_a_validation_error(client):
    from urllib.parse import urlencode

    from django.contrib.auth.models import User
    client.force_login(User.objects.create_superuser("root", "root@example.com", "pw"))
    response = client.post("/admin/refundops/disputeevidencedraft/",
                           urlencode({"action": "submit_to_gateway", "_selected_action": "de_\x00"}),
                           content_type="application/x-www-form-urlencoded")
    assert response.status_code == 400 and response.json()["error"]["code"] == "VALIDATION_ERROR"


def test_a_nul_in_the_payment_page_link_is_not_found_without_signing_in(client):
    response = client.get("/pay/pl_%00")
    assert response.status_code == 404, response.content[:300]


# -- bodies over the site's cap, refused before they are read (issue 28, finding 8; WSGI) ---------

class Unread:
    """A request body that must never be read."""

    def read(self, *args):
        raise AssertionError("the body was read")

    readline = read


class Endless:
    """A chunked body (no Content-Length) that never ends; counts what was read."""

    def __init__(self) -> None:
        self.read_bytes = 0

    def read(self, size: int = -1) -> bytes:
        size = 65_536 if size is None or size < 0 else size
        self.read_bytes += size
        return b"x" * size

    def readline(self, size: int = -1) -> bytes:
        return self.read(size)


@pytest.mark.parametrize("path", ["/api/v1/refunds", "/admin/login/", "/webhooks/stripe/", "/mcp-nowhere"])
def test_a_declared_length_over_the_cap_is_413_before_the_body_is_read(client, settings, path):
    response = client.generic("POST", path, b"", content_type="application/json",
                              CONTENT_LENGTH=str(300 * 1024 * 1024), **{"wsgi.input": Unread()})
    assert response.status_code == 413, response.content[:300]
    error = response.json()["error"]
    assert error["code"].upper() == "PAYLOAD_TOO_LARGE" and str(settings.REQUEST_MAX_BODY_BYTES) in error["message"]


@pytest.mark.parametrize("path", ["/api/v1/refunds", "/admin/login/"])
def test_a_chunked_body_is_read_no_further_than_the_cap(client, settings, path):
    body = Endless()
    response = client.generic("POST", path, b"", content_type="application/json", CONTENT_LENGTH="",
                              HTTP_TRANSFER_ENCODING="chunked", **{"wsgi.input": body})
    assert response.status_code == 413 and response.json()["error"]["code"] == "PAYLOAD_TOO_LARGE"
    assert body.read_bytes <= settings.REQUEST_MAX_BODY_BYTES + 65_536


def test_a_changelist_action_on_an_id_no_row_can_have_changes_nothing_and_says_so(client):
    from urllib.parse import urlencode

    from django.contrib.auth.models import User

    from refundops.models import AgentKey
    from tests.conftest import make_agent_key
    key, _ = make_agent_key()
    client.force_login(User.objects.create_superuser("root", "root@example.com", "pw"))
    response = client.post("/admin/refundops/agentkey/", urlencode(
        {"action": "revoke_selected", "_selected_action": [str(key.pk), "abc"]}, doseq=True),
        content_type="application/x-www-form-urlencoded", follow=True)
    assert response.status_code == 200
    assert "id no row can have" in response.content.decode()
    assert AgentKey.objects.get(pk=key.pk).revoked_at is None


@pytest.mark.parametrize("url", ["/admin/refundops/agentkey/abc/history/",
                                 "/admin/approvals/approvalauthority/abc/history/export.csv",
                                 "/admin/refundops/refundlimits/1/delete/",
                                 "/admin/refundops/refundlimits/abc/delete/"])
def test_an_admin_page_for_an_id_no_row_can_have_is_a_client_answer(client, url):
    from django.contrib.auth.models import User
    client.force_login(User.objects.create_superuser("root", "root@example.com", "pw"))
    response = client.get(url)
    assert 300 <= response.status_code < 500, response.status_code
