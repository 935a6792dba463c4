"""POST /api/v1/refunds and friends, as an agent sees them."""

from __future__ import annotations

import json

import pytest

from audit.models import Verdict
from refundops.models import IdempotencyRecord, Refund, RefundState
from tests.conftest import make_payment, post

pytestmark = pytest.mark.django_db


def test_refund_within_limits_is_approved_and_answers_the_contract_shape(api, policy):
    payment = make_payment(amount=5_000)
    response = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 1_999,
                                             "reason": "customer_request",
                                             "agent": {"session_id": "s1", "model": "m", "reasoning": "r"}})
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["refund"]["status"] == "approved"  # eager Celery has not run: on_commit waits
    assert body["refund"]["amount"] == 1_999 and body["refund"]["currency"] == "USD"
    assert body["refund"]["id"].startswith("rf_") and body["verdict"]["id"].startswith("vd_")
    assert body["verdict"]["outcome"] == "approved"
    assert [c["name"] for c in body["verdict"]["checks"]][:3] == ["payment_refundable", "destination", "reason"]
    assert body["context"]["transaction_remaining_amount"] == 3_001
    assert body["context"]["customer_refunds_today"] == 1
    assert "19.99 USD" in body["context"]["suggested_message"]
    assert body["deduplicated"] is False
    refund = Refund.objects.get(pk=body["refund"]["id"])
    assert refund.verdict_id == body["verdict"]["id"] and refund.agent_session_id == "s1"
    payment.refresh_from_db()
    assert payment.amount_reserved_minor == 1_999


def test_omitted_amount_refunds_the_whole_refundable_amount(api, policy):
    payment = make_payment(amount=4_200)
    body = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "reason": "duplicate"}).json()
    assert body["refund"]["amount"] == 4_200


@pytest.mark.parametrize("field,value", [
    ("amount", "100"), ("amount", 10.5), ("amount", 0), ("amount", -5), ("amount", True),
    ("reason", "because"), ("reason", None), ("transaction_id", None), ("transaction_id", 12),
    ("note", 5), ("agent", "x"), ("ammount", 100),
])
def test_bad_input_is_a_validation_error_naming_the_field_and_writes_only_a_verdict(api, policy, field, value):
    payment = make_payment()
    body = {"transaction_id": payment.pk, "amount": 100, "reason": "customer_request", field: value}
    if value is None:
        body.pop(field)
    response = post(api, "/api/v1/refunds", body)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "VALIDATION_ERROR" and error["field"] == field
    assert field in error["message"]
    assert Verdict.objects.get(pk=error["verdict_id"]).code == "VALIDATION_ERROR"
    assert not Refund.objects.exists() and not IdempotencyRecord.objects.exists()


def test_same_key_same_body_replays_and_other_body_is_refused(api, policy):
    payment = make_payment()
    body = {"transaction_id": payment.pk, "amount": 100, "reason": "customer_request"}
    first = post(api, "/api/v1/refunds", body, key="k1")
    again = post(api, "/api/v1/refunds", body, key="k1")
    assert again.status_code == first.status_code == 201
    assert again.json()["deduplicated"] is True
    assert again.json()["refund"]["id"] == first.json()["refund"]["id"]
    other = post(api, "/api/v1/refunds", {**body, "amount": 101}, key="k1")
    assert other.status_code == 409 and other.json()["error"]["code"] == "IDEMPOTENCY_KEY_REUSED"
    assert Refund.objects.count() == 1


def test_the_first_answer_is_sent_as_stored_and_as_drf_renders_it(api, policy):
    """The response's bytes are the stored first answer's text (encoded once), byte for byte what
    DRF's JSONRenderer makes of the same body, line separators escaped; an Accept that asks for
    another rendering (indent=) still gets DRF's."""
    from rest_framework.renderers import JSONRenderer

    from refundops.answers import encoded

    payment = make_payment()
    note = "caf\u00e9 \u2028 \u2029 \U0001f600 \"quoted\" \\ back"
    body = {"transaction_id": payment.pk, "amount": 100, "reason": "customer_request", "note": note,
            "agent": {"session_id": "s\u00e9", "model": "m"}}
    response = post(api, "/api/v1/refunds", body, key="k-encoded")
    assert response.status_code == 201 and response["Content-Type"] == "application/json"
    sent = response.json()
    assert response.content == JSONRenderer().render(sent, "application/json")
    odd = {"text": note, "n": [1, None, True], "nested": {"\u00e9": "\u2029"}}
    assert encoded(odd) == JSONRenderer().render(odd, "application/json")
    record = IdempotencyRecord.objects.get(key="k-encoded")
    assert record.response_body == sent and record.response_status == 201
    indented = api.post("/api/v1/refunds", {**body, "amount": 101}, format="json", HTTP_ACCEPT="application/json; indent=2",
                        HTTP_IDEMPOTENCY_KEY="k-indented")
    assert indented.status_code == 201 and indented.content.startswith(b'{\n  "refund"')
    assert indented.content == JSONRenderer().render(indented.json(), "application/json; indent=2")


def test_post_without_idempotency_key_is_refused(api, policy):
    payment = make_payment()
    response = api.post("/api/v1/refunds", {"transaction_id": payment.pk, "reason": "duplicate"}, format="json")
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "IDEMPOTENCY_KEY_REQUIRED"
    assert not Refund.objects.exists()


def test_unknown_payment_is_not_found(api, policy):
    response = post(api, "/api/v1/refunds", {"transaction_id": "txn_nope", "reason": "duplicate"})
    assert response.status_code == 404
    assert response.json()["error"]["code"] == "PAYMENT_NOT_FOUND"
    assert response.json()["error"]["verdict_id"].startswith("vd_")


def test_more_than_refundable_is_refused_and_recorded_as_denied(api, policy):
    payment = make_payment(amount=1_000)
    response = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 1_001, "reason": "duplicate"})
    assert response.status_code == 422
    error = response.json()["error"]
    assert error["code"] == "AMOUNT_EXCEEDS_REFUNDABLE"
    assert Refund.objects.get(pk=error["refund_id"]).status == RefundState.DENIED
    payment.refresh_from_db()
    assert payment.amount_reserved_minor == 0


def test_other_destination_is_refused(api, policy):
    payment = make_payment()
    response = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "reason": "duplicate",
                                             "destination": "card_4000"})
    assert response.status_code == 422
    assert response.json()["error"]["code"] == "DESTINATION_NOT_ALLOWED"


def test_check_gives_the_verdict_without_writing_a_refund(api, policy):
    payment = make_payment(amount=1_000)
    response = post(api, "/api/v1/refunds/check", {"transaction_id": payment.pk, "amount": 500,
                                                   "reason": "duplicate"})
    assert response.status_code == 200
    body = response.json()
    assert body["would_be"] == "approved" and body["verdict"]["outcome"] == "approved"
    assert not Refund.objects.exists()
    assert Verdict.objects.get(pk=body["verdict"]["id"]).dry_run is True


def test_get_refund_and_payment(api, policy):
    payment = make_payment(amount=1_000)
    created = post(api, "/api/v1/refunds/", {"transaction_id": payment.pk, "amount": 300, "reason": "duplicate"})
    rf = created.json()["refund"]["id"]
    detail = api.get(f"/api/v1/refunds/{rf}")
    assert detail.status_code == 200 and detail.json()["refund"]["status"] == "approved"
    assert detail.json()["verdict"]["id"] == created.json()["verdict"]["id"]
    lookup = api.get(f"/api/v1/payments/{payment.pk}/").json()
    assert lookup["amount_refundable"] == 700 and lookup["method"]["last4"] == "4242"
    assert api.get("/api/v1/refunds/rf_missing").json()["error"]["code"] == "REFUND_NOT_FOUND"


@pytest.mark.parametrize("text", ["a\\ud800b", "\\udfff", "note \\ud83d"])
def test_an_unpaired_surrogate_is_a_validation_error_not_a_500_without_a_verdict(api, agent_key, policy, text):
    """JSON's \\uXXXX escapes spell a lone surrogate, which UTF-8 (so PostgreSQL) cannot hold: refused
    like a NUL, by the API's parser and by the service (the MCP and admin faces), with a verdict.
    Fails before: a 500 when the first row was encoded, and no verdict."""
    from refundops.callers import Caller
    from refundops.services.refunds import request_refund

    payment = make_payment()
    raw = '{"transaction_id": "%s", "amount": 100, "reason": "duplicate", "agent": {"reasoning": "%s"}}' % (
        payment.pk, text)
    response = api.post("/api/v1/refunds", data=raw, content_type="application/json", HTTP_IDEMPOTENCY_KEY="k-s")
    assert response.status_code == 400 and response.json()["error"]["code"] == "VALIDATION_ERROR"
    answer = request_refund(caller=Caller.for_key(agent_key[0]), idempotency_key="k-s2",
                            data={"transaction_id": payment.pk, "reason": "duplicate",
                                  "note": json.loads(f'"{text}"')})
    assert answer.status == 400 and answer.code == "VALIDATION_ERROR"
    assert Verdict.objects.filter(pk=answer.body["error"]["verdict_id"], code="VALIDATION_ERROR").exists()
    assert not Refund.objects.exists() and not IdempotencyRecord.objects.exists()


def test_nul_characters_are_refused_by_the_service_for_every_face(agent_key, policy):
    from refundops.callers import Caller
    from refundops.services.refunds import request_refund

    payment = make_payment()
    answer = request_refund(caller=Caller.for_key(agent_key[0]), idempotency_key="k-nul",
                            data={"transaction_id": payment.pk, "reason": "duplicate", "note": "a\x00b"})
    assert answer.status == 400 and answer.code == "VALIDATION_ERROR"
    assert not Refund.objects.exists() and not IdempotencyRecord.objects.exists()
