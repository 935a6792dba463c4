"""The OpenAPI document: valid, complete for the contract, and truthful: every response it documents,
each error code included, is one the operation really gives (each is produced here, live)."""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import schemathesis
from django.contrib.staticfiles import finders
from django.core.signals import request_finished, request_started
from django.db import close_old_connections
from django.core.wsgi import get_wsgi_application
from hypothesis import HealthCheck, settings as hypothesis_settings
from openapi_spec_validator import validate
from rest_framework.test import APIClient

from processors import sandbox
from processors.models import SandboxCharge
from refundops.errors import ERROR_STATUS
from refundops.models import Capability, Dispute, Payment
from tests.conftest import make_agent_key, make_limits, make_payment, post
from tests.test_capabilities import CONTRACT_REFUSALS, ENDPOINTS, World, build_world
from tests.fakes.fixtures import stripe_account, wait_for
from tests.fakes.stripe_server import FakeStripe

pytestmark = pytest.mark.django_db

CONTRACT_PATHS = {
    ("get", "/api/v1/payments/{txn_id}"), ("post", "/api/v1/refunds/check"), ("post", "/api/v1/refunds"),
    ("get", "/api/v1/refunds/{rf_id}"), ("post", "/api/v1/payments/{txn_id}/void"),
    ("post", "/api/v1/payments/{txn_id}/capture"), ("post", "/api/v1/payment-links"),
    ("post", "/api/v1/disputes/{dp_id}/evidence-drafts"),
}


@pytest.fixture
def world(policy) -> World:
    return build_world()


@pytest.fixture
def document(db) -> dict[str, Any]:
    response = APIClient().get("/api/v1/schema/?format=json")
    assert response.status_code == 200
    return response.json()


def operations(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {op["operationId"]: op for methods in document["paths"].values() for op in methods.values()}


def documented_codes(response: dict[str, Any]) -> list[str]:
    match = re.fullmatch(r"Codes: ([A-Z_, ]+)", response["description"])
    return match.group(1).split(", ") if match else []


def test_document_is_valid_openapi(document):
    validate(document)
    assert document["openapi"].startswith("3.")


def test_document_has_exactly_the_contract_operations_and_the_mcp_tool_names(document):
    served = {(method, path) for path, methods in document["paths"].items() for method in methods}
    assert served == CONTRACT_PATHS
    assert set(operations(document)) == set(ENDPOINTS)


def test_every_operation_needs_an_agent_key_and_every_post_an_idempotency_key(document):
    assert document["components"]["securitySchemes"]["agentKey"] == {
        "type": "http", "scheme": "bearer", "bearerFormat": "rk_…",
        "description": "An agent key (rk_…), shown once when an operator creates it."}
    for path, methods in document["paths"].items():
        for method, op in methods.items():
            assert op["security"] == [{"agentKey": []}], path
            headers = {p["name"]: p["required"] for p in op.get("parameters", []) if p["in"] == "header"}
            assert headers == ({"Idempotency-Key": True} if method == "post" else {}), path


def test_each_documented_error_status_lists_only_codes_of_that_status(document):
    for op_id, op in operations(document).items():
        for status, response in op["responses"].items():
            if int(status) >= 400:
                codes = documented_codes(response)
                assert codes and all(ERROR_STATUS[code] == int(status) for code in codes), (op_id, status)


# -- every documented response, produced live --------------------------------------------------------

def _pairs() -> list[tuple[str, str]]:
    """(operation id, success status or error code) for every response the served document lists."""
    doc = APIClient().get("/api/v1/schema/?format=json").json()  # needs no database
    pairs = []
    for op_id, op in operations(doc).items():
        for status, response in op["responses"].items():
            pairs += [(op_id, code) for code in (documented_codes(response) if int(status) >= 400 else [status])]
    return sorted(pairs)


@dataclass
class Ctx:
    op: str
    world: World
    raw: str  # a key with every capability
    settings: Any
    stripe: FakeStripe  # the fake Stripe server, spoken to by the official SDK

    def body(self, **changes: Any) -> dict[str, Any]:
        return {**(ENDPOINTS[self.op].body(self.world) or {}), **changes}

    def call(self, *, raw: str | None | bool = True, body: dict[str, Any] | None = None, path: str | None = None,
             key: str | None = None, idempotency: bool = True):
        endpoint = ENDPOINTS[self.op]
        client = APIClient()
        raw = self.raw if raw is True else raw
        if raw:
            client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
        path = path or endpoint.path(self.world)
        if endpoint.method == "get":
            return client.get(path)
        body = self.body() if body is None else body
        if not idempotency:
            return client.post(path, body, format="json")
        return post(client, path, body, key=key)

    def use_stripe(self) -> None:
        """The world's authorisation (and its order) at the fake Stripe, as an uncaptured payment intent."""
        intent = self.stripe.add_payment_intent(self.world.authorization.amount_authorized_minor, captured=False)
        Payment.objects.filter(pk=self.world.authorization.pk).update(
            processor="stripe", processor_reference=intent, authorization_reference=intent)


def _rate_limited(ctx: Ctx):
    ctx.settings.RATE_LIMIT_AGENT_PER_MINUTE = 1
    ctx.call()
    return ctx.call()


def _redis_away(ctx: Ctx):
    ctx.settings.REDIS_URL = "redis://127.0.0.1:1/0"  # nothing listens there: writes fail closed
    return ctx.call()


def _reused(ctx: Ctx):
    ctx.call(key="same-key")
    return ctx.call(key="same-key", body=ctx.body(agent={"session_id": "another"}))


def _outcome_unknown(ctx: Ctx):
    """Stripe acts, then answers after the client gave up, and cannot be asked either: unknown."""
    ctx.use_stripe()
    ctx.settings.PROCESSORS = {**ctx.settings.PROCESSORS,
                               "stripe": {"default": {**stripe_account(ctx.stripe), "timeout": 0.5}}}
    ctx.stripe.set_mode("slow_after", slow_seconds=1.5)
    response = ctx.call()
    assert response.json()["operation"]["status"] == "unknown"
    return response


def _in_flight_replay(ctx: Ctx):
    """The same request again while the first one's call to the fake Stripe is still running (the
    test is transactional, so the first runs in a thread of its own)."""
    import threading

    from django.db import connection

    ctx.use_stripe()
    ctx.stripe.set_mode("slow", slow_seconds=3, path="/v1/payment_links")

    def first() -> None:
        try:
            ctx.call(key="in-flight")
        finally:
            connection.close()

    thread = threading.Thread(target=first)
    thread.start()
    wait_for(lambda: any(r.path == "/v1/payment_links" for r in ctx.stripe.received), what="the first call")
    reply = ctx.call(key="in-flight")
    thread.join(timeout=10)
    assert reply.json()["deduplicated"] is True
    return reply


def _decline_at_sandbox(ctx: Ctx):
    SandboxCharge.objects.filter(reference=ctx.world.authorization.processor_reference).update(
        voided=True, captured_minor=1)
    return ctx.call()


def _sandbox_down(ctx: Ctx):
    sandbox.set_mode("down")
    return ctx.call()


def _stripe_declines_the_link(ctx: Ctx):
    ctx.use_stripe()
    ctx.stripe.refuse_next(400, "Payment links are not enabled for this currency.", code="invalid_request")
    return ctx.call()


def _stripe_down(ctx: Ctx):
    ctx.use_stripe()
    ctx.stripe.set_mode("down")
    return ctx.call()


def _held_refund(ctx: Ctx):
    make_limits(approval_threshold_minor=50)
    return ctx.call()


def _contract_refusal(code: str) -> Callable[[Ctx], Any]:
    def produce(ctx: Ctx):
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {ctx.raw}")
        return CONTRACT_REFUSALS[code](client, ctx.world)
    return produce


def _then_call(change: Callable[[World], Any]) -> Callable[[Ctx], Any]:
    def produce(ctx: Ctx):
        change(ctx.world)
        return ctx.call()
    return produce


GENERIC: dict[str, Callable[[Ctx], Any]] = {
    "UNAUTHENTICATED": lambda ctx: ctx.call(raw=None),
    "CAPABILITY_NOT_GRANTED": lambda ctx: ctx.call(
        raw=make_agent_key(*[c for c in Capability.values if c != ENDPOINTS[ctx.op].capability])[1]),
    "RATE_LIMITED": _rate_limited,
    "SERVICE_UNAVAILABLE": _redis_away,
    "VALIDATION_ERROR": lambda ctx: ctx.call(body=ctx.body(unexpected=1)),
    "IDEMPOTENCY_KEY_REQUIRED": lambda ctx: ctx.call(idempotency=False),
    "IDEMPOTENCY_KEY_REUSED": _reused,
    "PAYLOAD_TOO_LARGE": lambda ctx: ctx.call(body=ctx.body(note="x" * 70_000)),
}

SPECIFIC: dict[tuple[str, str], Callable[[Ctx], Any]] = {
    ("lookup_payment", "PAYMENT_NOT_FOUND"): lambda ctx: ctx.call(path="/api/v1/payments/txn_x"),
    ("get_refund", "REFUND_NOT_FOUND"): lambda ctx: ctx.call(path="/api/v1/refunds/rf_x"),
    ("check_refund_eligibility", "PAYMENT_NOT_FOUND"): lambda ctx: ctx.call(body=ctx.body(transaction_id="txn_x")),
    ("create_refund", "202"): _held_refund,
    ("void_authorization", "202"): _outcome_unknown,
    ("void_authorization", "PAYMENT_NOT_FOUND"): lambda ctx: ctx.call(path="/api/v1/payments/txn_x/void"),
    ("void_authorization", "PAYMENT_NOT_VOIDABLE"): lambda ctx: ctx.call(
        path=f"/api/v1/payments/{ctx.world.payment.pk}/void"),
    ("void_authorization", "GATEWAY_DECLINED"): _decline_at_sandbox,
    ("void_authorization", "GATEWAY_UNAVAILABLE"): _sandbox_down,
    ("capture_payment", "202"): _outcome_unknown,
    ("capture_payment", "PAYMENT_NOT_FOUND"): lambda ctx: ctx.call(path="/api/v1/payments/txn_x/capture"),
    ("capture_payment", "PAYMENT_NOT_CAPTURABLE"): lambda ctx: ctx.call(
        path=f"/api/v1/payments/{ctx.world.payment.pk}/capture"),
    ("capture_payment", "AMOUNT_EXCEEDS_ORDER"): lambda ctx: ctx.call(body=ctx.body(amount=8_001)),
    ("capture_payment", "GATEWAY_DECLINED"): _decline_at_sandbox,
    ("capture_payment", "GATEWAY_UNAVAILABLE"): _sandbox_down,
    ("send_payment_link", "202"): _in_flight_replay,
    ("send_payment_link", "PAYMENT_NOT_FOUND"): lambda ctx: ctx.call(body=ctx.body(transaction_id="txn_none", order_reference=None)),
    ("send_payment_link", "ORDER_NOT_FOUND"): lambda ctx: ctx.call(body=ctx.body(order_reference="ord-none", transaction_id=None)),
    ("send_payment_link", "TEMPLATE_NOT_APPROVED"): lambda ctx: ctx.call(body=ctx.body(template="tpl_x")),
    ("send_payment_link", "AMOUNT_NOT_OWED"): lambda ctx: ctx.call(body=ctx.body(amount=8_001)),
    ("send_payment_link", "PAYMENT_LINKS_UNSUPPORTED"): _then_call(
        lambda w: Payment.objects.filter(pk=w.authorization.pk).update(processor="paypal")),
    ("send_payment_link", "GATEWAY_DECLINED"): _stripe_declines_the_link,
    ("send_payment_link", "GATEWAY_UNAVAILABLE"): _stripe_down,
    ("draft_dispute_evidence", "DISPUTE_NOT_FOUND"): lambda ctx: ctx.call(
        path="/api/v1/disputes/dp_x/evidence-drafts"),
    ("draft_dispute_evidence", "DISPUTE_NOT_OPEN"): _then_call(
        lambda w: Dispute.objects.filter(pk=w.dispute.pk).update(status="won")),
}
for _code in ("PAYMENT_NOT_FOUND", "REFUND_WINDOW_EXPIRED", "MAX_REFUNDS_REACHED", "AMOUNT_EXCEEDS_REFUNDABLE",
              "DAILY_LIMIT_REACHED", "REASON_NOT_ALLOWED", "DESTINATION_NOT_ALLOWED", "PAYMENT_NOT_REFUNDABLE",
              "CIRCUIT_OPEN"):
    SPECIFIC[("create_refund", _code)] = _contract_refusal(_code)


def producer(op_id: str, code: str) -> Callable[[Ctx], Any]:
    if (op_id, code) in SPECIFIC:
        return SPECIFIC[(op_id, code)]
    if code in GENERIC:
        return GENERIC[code]
    assert code.isdigit() and int(code) < 300, f"nothing here produces {code} for {op_id}: add a way"
    return lambda ctx: ctx.call()  # the endpoint's own success


# Produced by two requests at once: the first must commit for the second to see it.
CONCURRENT = {("send_payment_link", "202")}


@pytest.mark.parametrize("op_id,code", [
    pytest.param(*pair, marks=pytest.mark.django_db(transaction=True)) if pair in CONCURRENT else pair
    for pair in _pairs()])
def test_every_documented_response_is_one_the_operation_gives(world, settings, gateways, stripe_fake, op_id, code):
    settings.RATE_LIMIT_AGENT_PER_MINUTE = 0  # off, except where the limit is the point
    _, raw = make_agent_key()
    response = producer(op_id, code)(Ctx(op_id, world, raw, settings, stripe_fake))
    if code.isdigit():
        assert response.status_code == int(code), response.json()
    else:
        error = response.json()["error"]
        assert (response.status_code, error["code"]) == (ERROR_STATUS[code], code), error


# -- Swagger UI, offline -----------------------------------------------------------------------------

def test_swagger_page_renders_with_every_asset_served_locally(db):
    response = APIClient().get("/api/v1/docs/")
    assert response.status_code == 200
    page = response.content.decode()
    assets = re.findall(r'(?:src|href)="([^"]+)"', page)
    assert assets and not [a for a in assets if re.match(r"(https?:)?//", a)], assets
    for asset in assets:
        assert asset.startswith("/static/") and finders.find(asset.removeprefix("/static/")), asset


# -- schemathesis, in process, on the refund operations ---------------------------------------------

fuzzed = schemathesis.openapi.from_wsgi("/api/v1/schema/?format=json", get_wsgi_application()).include(
    path_regex=r"^/api/v1/refunds")


@pytest.fixture
def in_process_wsgi():
    """Django's test client keeps the test's connection open across requests; a bare WSGI call
    would close it at the end of each request (close_old_connections), losing the test transaction."""
    request_started.disconnect(close_old_connections)
    request_finished.disconnect(close_old_connections)
    yield
    request_started.connect(close_old_connections)
    request_finished.connect(close_old_connections)


@fuzzed.parametrize()
@hypothesis_settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_refund_operations_never_answer_a_server_error(case, db, policy, in_process_wsgi):
    _, raw = make_agent_key()
    make_payment()
    case.call_and_validate(headers={"Authorization": f"Bearer {raw}", "Idempotency-Key": uuid.uuid4().hex},
                           checks=[schemathesis.checks.not_a_server_error])
