"""Who may call what, over every REST endpoint; and every contract error code, through the API."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command
from django.utils import timezone
from rest_framework.test import APIClient

from audit.models import Verdict
from refundops.access import KEY_PREFIX_LENGTH
from refundops.callers import Caller
from refundops.errors import CONTRACT_CODES, ERROR_STATUS
from refundops.inputs import MAX_BODY_BYTES
from refundops.models import AgentKey, Capability, Dispute, Payment, PaymentLinkTemplate, Refund
from refundops.services import agents, payments
from tests.conftest import make_agent_key, make_limits, make_payment, post

pytestmark = pytest.mark.django_db


@dataclass
class World:
    payment: Payment  # captured, refundable
    authorization: Payment  # uncaptured, with a confirmed order amount and money owed
    refund: Refund
    dispute: Dispute
    template: PaymentLinkTemplate


@pytest.fixture
def world(policy) -> World:
    return build_world()


def build_world() -> World:
    payment = make_payment(amount=10_000)
    authorization = make_payment(amount=8_000, captured=False, order_reference="ord-1",
                                 order_amount_minor=8_000, amount_owed_minor=8_000)
    refund = Refund.objects.create(payment=payment, amount_minor=100, currency="USD", reason="duplicate")
    dispute = Dispute.objects.create(payment=payment, amount_minor=10_000, currency="USD",
                                     reason="product_not_received",
                                     evidence_due_by=timezone.now() + timedelta(days=7))
    approver = get_user_model().objects.create_user("approver", is_staff=True)
    template = PaymentLinkTemplate.objects.create(name="balance due", message="Please pay $amount: $url",
                                                  approved_by=approver, approved_at=timezone.now())
    return World(payment, authorization, refund, dispute, template)


@dataclass(frozen=True)
class Endpoint:
    method: str
    path: Callable[[World], str]
    body: Callable[[World], dict[str, Any] | None]
    capability: str


ENDPOINTS: dict[str, Endpoint] = {
    "lookup_payment": Endpoint("get", lambda w: f"/api/v1/payments/{w.payment.pk}", lambda w: None,
                               Capability.PAYMENTS_READ),
    "check_refund_eligibility": Endpoint(
        "post", lambda w: "/api/v1/refunds/check",
        lambda w: {"transaction_id": w.payment.pk, "amount": 100, "reason": "duplicate"}, Capability.REFUNDS_CREATE),
    "create_refund": Endpoint(
        "post", lambda w: "/api/v1/refunds",
        lambda w: {"transaction_id": w.payment.pk, "amount": 100, "reason": "duplicate"}, Capability.REFUNDS_CREATE),
    "get_refund": Endpoint("get", lambda w: f"/api/v1/refunds/{w.refund.pk}", lambda w: None,
                           Capability.REFUNDS_CREATE),
    "void_authorization": Endpoint("post", lambda w: f"/api/v1/payments/{w.authorization.pk}/void",
                                   lambda w: {}, Capability.AUTHORIZATIONS_VOID),
    "capture_payment": Endpoint("post", lambda w: f"/api/v1/payments/{w.authorization.pk}/capture",
                                lambda w: {"amount": 8_000}, Capability.PAYMENTS_CAPTURE),
    "send_payment_link": Endpoint(
        "post", lambda w: "/api/v1/payment-links",
        lambda w: {"order_reference": "ord-1", "template": w.template.pk, "amount": 8_000},
        Capability.PAYMENT_LINKS_SEND),
    "draft_dispute_evidence": Endpoint(
        "post", lambda w: f"/api/v1/disputes/{w.dispute.pk}/evidence-drafts",
        lambda w: {"summary": "Delivered on the 3rd; signed for."}, Capability.DISPUTES_DRAFT),
}


def call(name: str, world: World, raw: str | None):
    endpoint = ENDPOINTS[name]
    client = APIClient()
    if raw is not None:
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    if endpoint.method == "get":
        return client.get(endpoint.path(world))
    return post(client, endpoint.path(world), endpoint.body(world))


def error_code(response) -> str:
    return response.json()["error"]["code"]


@pytest.mark.parametrize("name", ENDPOINTS)
def test_key_with_the_capability_is_answered(world, name):
    _, raw = make_agent_key(ENDPOINTS[name].capability)
    response = call(name, world, raw)
    assert response.status_code < 300, response.json()


@pytest.mark.parametrize("name", ENDPOINTS)
def test_key_lacking_the_capability_is_refused(world, name):
    others = [c for c in Capability.values if c != ENDPOINTS[name].capability]
    _, raw = make_agent_key(*others)
    response = call(name, world, raw)
    assert response.status_code == 403 and error_code(response) == "CAPABILITY_NOT_GRANTED"
    assert response.json()["error"]["capability"] == ENDPOINTS[name].capability


def _no_key(key: AgentKey, raw: str) -> str | None:
    return None


def _unknown_key(key: AgentKey, raw: str) -> str:
    return raw[:-4] + "zzzz"


def _revoked(key: AgentKey, raw: str) -> str:
    AgentKey.objects.filter(pk=key.pk).update(revoked_at=timezone.now())
    return raw


def _expired(key: AgentKey, raw: str) -> str:
    AgentKey.objects.filter(pk=key.pk).update(expires_at=timezone.now() - timedelta(seconds=1))
    return raw


def _agent_disabled(key: AgentKey, raw: str) -> str:
    key.agent.is_active = False
    key.agent.save()
    return raw


def _all_agents_off(key: AgentKey, raw: str) -> str:
    agents.set_agents_disabled(disabled=True, actor="cli:test")
    return raw


@pytest.mark.parametrize("break_key", [_no_key, _unknown_key, _revoked, _expired, _agent_disabled,
                                       _all_agents_off], ids=lambda f: f.__name__.strip("_"))
@pytest.mark.parametrize("name", ENDPOINTS)
def test_no_live_key_is_unauthenticated(world, name, break_key):
    key, raw = make_agent_key()
    response = call(name, world, break_key(key, raw))
    assert response.status_code == 401 and error_code(response) == "UNAUTHENTICATED"
    assert response.json()["error"]["verdict_id"] is None


def _revoke_key_by_service(key: AgentKey, capability: str) -> None:
    agents.revoke_key(prefix=key.prefix, actor="cli:test")


def _revoke_key_by_command(key: AgentKey, capability: str) -> None:
    call_command("revoke_key", key.prefix[:KEY_PREFIX_LENGTH], stdout=None)


def _revoke_capability_by_service(key: AgentKey, capability: str) -> None:
    agents.revoke_capability(agent_name_or_id=key.agent.name, capability=capability, actor="cli:test")


def _revoke_capability_by_command(key: AgentKey, capability: str) -> None:
    call_command("revoke_capability", key.agent.pk, capability, stdout=None)


@pytest.mark.parametrize("revoke,expected", [
    (_revoke_key_by_service, 401), (_revoke_key_by_command, 401),
    (_revoke_capability_by_service, 403), (_revoke_capability_by_command, 403),
], ids=lambda v: v.__name__.strip("_") if callable(v) else str(v))
@pytest.mark.parametrize("name", ENDPOINTS)
def test_revoking_is_refused_on_the_very_next_call(world, name, revoke, expected):
    key, raw = make_agent_key()
    assert call(name, world, raw).status_code < 300
    revoke(key, ENDPOINTS[name].capability)
    response = call(name, world, raw)
    assert response.status_code == expected
    assert error_code(response) == ("UNAUTHENTICATED" if expected == 401 else "CAPABILITY_NOT_GRANTED")


# -- every contract code, through the API ------------------------------------------------------------

def _refund(api, payment, **body):
    return post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "reason": "duplicate", **body})


def _window_expired(api, world):
    return _refund(api, make_payment(captured_days_ago=91))


def _max_refunds(api, world):
    make_limits(max_refunds_per_payment=1)
    _refund(api, world.payment, amount=100)  # the world's refund already counts as one
    return _refund(api, world.payment, amount=100)


def _daily_limit(api, world):
    make_limits(customer_daily_amount_minor=500)
    return _refund(api, world.payment, amount=600)


def _reason_not_allowed(api, world):
    make_limits(allowed_reasons=["duplicate"])
    return _refund(api, world.payment, reason="fraudulent")


def _payment_not_refundable(api, world):
    return _refund(api, world.authorization)


def _destination(api, world):
    return _refund(api, world.payment, destination="card_4000")


def _circuit_open(api, world):
    agents.set_killswitch(on=True, actor="cli:test")
    return _refund(api, world.payment, amount=100)


def _rate_limited(api, world):
    api.get(f"/api/v1/payments/{world.payment.pk}")  # the test sets a limit of one call a minute
    return api.get(f"/api/v1/payments/{world.payment.pk}")


def _key_reused(api, world):
    body = {"transaction_id": world.payment.pk, "reason": "duplicate", "amount": 1}
    post(api, "/api/v1/refunds", body, key="one-key")
    return post(api, "/api/v1/refunds", {**body, "amount": 2}, key="one-key")


CONTRACT_REFUSALS: dict[str, Callable] = {
    "VALIDATION_ERROR": lambda api, w: _refund(api, w.payment, amount="100"),
    "IDEMPOTENCY_KEY_REQUIRED": lambda api, w: api.post(
        "/api/v1/refunds", {"transaction_id": w.payment.pk, "reason": "duplicate"}, format="json"),
    "UNAUTHENTICATED": lambda api, w: APIClient().get(f"/api/v1/payments/{w.payment.pk}"),
    "CAPABILITY_NOT_GRANTED": lambda api, w: call("lookup_payment", w, make_agent_key("refunds.create")[1]),
    "PAYMENT_NOT_FOUND": lambda api, w: post(api, "/api/v1/refunds", {"transaction_id": "txn_missing",
                                                                      "reason": "duplicate"}),
    "IDEMPOTENCY_KEY_REUSED": _key_reused,
    "REFUND_WINDOW_EXPIRED": _window_expired,
    "MAX_REFUNDS_REACHED": _max_refunds,
    "AMOUNT_EXCEEDS_REFUNDABLE": lambda api, w: _refund(api, w.payment, amount=10_001),
    "DAILY_LIMIT_REACHED": _daily_limit,
    "REASON_NOT_ALLOWED": _reason_not_allowed,
    "DESTINATION_NOT_ALLOWED": _destination,
    "PAYMENT_NOT_REFUNDABLE": _payment_not_refundable,
    "RATE_LIMITED": _rate_limited,
    "CIRCUIT_OPEN": _circuit_open,
    "PAYLOAD_TOO_LARGE": lambda api, w: post(api, "/api/v1/refunds", {
        "transaction_id": w.payment.pk, "reason": "duplicate", "note": "x" * (MAX_BODY_BYTES + 1)}),
}


@pytest.mark.parametrize("body", [
    "[" * 60_000 + "]" * 60_000,  # deeper than Python's own recursion limit
    '{"transaction_id": "txn_x", "reason": "duplicate", "agent": ' + '{"a": ' * 40 + "1" + "}" * 41,
])
def test_json_nested_too_deep_is_payload_too_large_and_recorded(world, api, body):
    refunds = Refund.objects.count()
    response = api.post("/api/v1/refunds", body, content_type="application/json", HTTP_IDEMPOTENCY_KEY="k")
    error = response.json()["error"]
    assert response.status_code == 413 and error["code"] == "PAYLOAD_TOO_LARGE", error
    assert Verdict.objects.get(pk=error["verdict_id"]).code == "PAYLOAD_TOO_LARGE"
    assert Refund.objects.count() == refunds


def test_the_table_covers_every_code_of_the_contract():
    assert set(CONTRACT_REFUSALS) == CONTRACT_CODES
    # Beside a checkout of the steering repo, the contract itself is read too, so the two cannot drift.
    contract = Path(__file__).resolve().parents[2] / "shared" / "docs" / "CONTRACT.md"
    if contract.exists():
        table = re.findall(r"^\| `([A-Z_]+)` \| (\d{3}) \|", contract.read_text(), re.MULTILINE)
        assert {code for code, _ in table} == CONTRACT_CODES
        assert all(ERROR_STATUS[code] == int(status) for code, status in table)


@pytest.mark.parametrize("code", CONTRACT_REFUSALS)
def test_every_contract_code_is_answered_through_the_api(world, api, settings, code):
    settings.RATE_LIMIT_AGENT_PER_MINUTE = 1
    if code != "RATE_LIMITED":
        settings.RATE_LIMIT_AGENT_PER_MINUTE = 0  # off: the other scenarios make several calls
    response = CONTRACT_REFUSALS[code](api, world)
    error = response.json()["error"]
    assert error["code"] == code and response.status_code == ERROR_STATUS[code], error
    assert error["message"]
    if code == "RATE_LIMITED":
        assert int(response["Retry-After"]) >= 1
    if code not in ("UNAUTHENTICATED", "CAPABILITY_NOT_GRANTED", "RATE_LIMITED"):
        # Past the key, every refusal is a recorded verdict.
        verdict = Verdict.objects.get(pk=error["verdict_id"])
        assert verdict.outcome == Verdict.Outcome.DENIED and verdict.code == code


def test_refund_to_another_destination_is_refused_and_recorded(world, api):
    response = _destination(api, world)
    verdict = Verdict.objects.get(pk=response.json()["error"]["verdict_id"])
    assert verdict.operation == "refund.create" and verdict.payment_id == world.payment.pk
    assert verdict.request["destination"] == "card_4000"
    assert [c["name"] for c in verdict.checks if c["result"] == "fail"] == ["destination"]
    assert Refund.objects.get(pk=response.json()["error"]["refund_id"]).status == "denied"


@pytest.mark.parametrize("name", [n for n, e in ENDPOINTS.items() if e.method == "post"])
def test_nul_characters_are_a_validation_error_not_a_server_error(world, name):
    _, raw = make_agent_key()
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    endpoint = ENDPOINTS[name]
    for body in ({**endpoint.body(world), "note\u0000": 1}, {**endpoint.body(world), "agent": {"model": "m\u0000"}}):
        response = post(client, endpoint.path(world), body)
        assert response.status_code == 400 and error_code(response) == "VALIDATION_ERROR"
        assert response.json()["error"]["field"] == "body"


def test_nul_characters_reaching_a_service_directly_are_refused_and_recorded(world):
    key, _ = make_agent_key()
    answer = payments.void_authorization(caller=Caller.for_key(key), txn_id=world.authorization.pk,
                                         data={"note": "x\u0000"}, idempotency_key="k")
    assert answer.status == 400 and answer.code == "VALIDATION_ERROR"
    assert Verdict.objects.get(pk=answer.body["error"]["verdict_id"]).operation == "payment.void"
