"""schemathesis over HTTP: the served OpenAPI document, every operation, against uvicorn on a real
socket and the test database, with every check on (server errors, status codes, content types,
headers, response schemas, auth). Generated path ids and body ids are real ones about half the time
(payments captured and authorised, an order that owes money, an approved template, an open dispute,
refunds), so requests reach decisions, not only PAYMENT_NOT_FOUND. The webhook routes get generated
bodies and headers: a 4xx (or 503 to retry) in their error shape, never a 500.

Bounded for CI (FUZZ_EXAMPLES per operation, default 40: 320 requests, with the MCP and admin fuzzers
about two minutes together on a shared two-core machine). Long runs:
``scripts/fuzz 2000`` prints how many requests it tried."""

from __future__ import annotations

import os
import uuid
from datetime import timedelta

import pytest
import requests
import schemathesis
from django.contrib.auth import get_user_model
from django.utils import timezone
from hypothesis import HealthCheck, given, settings as hypothesis_settings, strategies as st

from schemathesis.specs.openapi.checks import positive_data_acceptance

from refundops.models import Dispute, PaymentLinkTemplate, Refund
from refundops.services.refunds import sync_payment_amounts
from tests.conftest import make_agent_key, make_limits, make_payment, make_rules

pytestmark = pytest.mark.django_db(transaction=True)  # the server sees committed rows only

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "40"))
TRIED: dict[str, int] = {"api": 0, "webhooks": 0}


@pytest.fixture(scope="module")
def tally():
    yield TRIED
    print(f"\nfuzz: tried {TRIED['api']} API requests and {TRIED['webhooks']} webhook deliveries")


@pytest.fixture
def seeds(served, settings):  # noqa: F811
    """Real rows for generated requests to find, and rate limits off (they are tested elsewhere)."""
    settings.RATE_LIMIT_AGENT_PER_MINUTE = settings.RATE_LIMIT_SESSION_PER_MINUTE = 0
    settings.RATE_LIMIT_GLOBAL_PER_MINUTE = settings.RATE_LIMIT_WEBHOOK_PER_MINUTE = 0
    settings.BREAKER_MIN_COUNT, settings.BREAKER_MIN_VALUE = 10**6, 10**12
    make_limits(approval_threshold_minor=5_000)
    make_rules()
    captured = [make_payment(amount=20_000) for _ in range(4)]
    authorised = [make_payment(amount=8_000, captured=False, order_amount_minor=8_000) for _ in range(2)]
    owing = make_payment(order_reference=f"INV-{uuid.uuid4().hex[:6]}", amount_owed_minor=5_000)
    approver = get_user_model().objects.create_user(f"finance-{uuid.uuid4().hex[:6]}", is_staff=True)
    template = PaymentLinkTemplate.objects.create(name="balance", message="Pay $amount for $order_reference: $url",
                                                  approved_by=approver, approved_at=timezone.now())
    dispute = Dispute.objects.create(payment=captured[0], amount_minor=1_000, currency="USD", reason="fraudulent",
                                     evidence_due_by=timezone.now() + timedelta(days=7))
    refund = Refund.objects.create(payment=captured[1], amount_minor=100, currency="USD", reason="duplicate")
    sync_payment_amounts(captured[1])  # the refund reserves its amount, as the services keep it
    _, raw = make_agent_key()
    return {"raw": raw, "txn_id": [p.pk for p in captured + authorised + [owing]], "rf_id": [refund.pk],
            "dp_id": [dispute.pk], "transaction_id": [p.pk for p in captured + authorised + [owing]],
            "template": [template.pk], "order_reference": [owing.order_reference]}


def _seeded(values: dict, seeds: dict):
    """A strategy: ``values`` as generated, or with each id that has seeds replaced by a real one."""
    if not isinstance(values, dict):
        return st.just(values)
    names = [name for name in values if name in seeds]
    if not names:
        return st.just(values)
    return st.fixed_dictionaries({name: st.one_of(st.just(values[name]), st.sampled_from(seeds[name]))
                                  for name in names}).map(lambda real: {**values, **real})


@pytest.fixture
def api_schema(served, seeds):  # noqa: F811
    # Every check on. A schema-valid request may still be refused by a decision (404 for an id that is
    # not one of ours, 409 for a reused key, 413 past the body cap, 422 for the policy, 503 while a
    # gateway is down): those are the answers the document lists, not a rejection of valid input.
    config = schemathesis.config.SchemathesisConfig.from_dict({"checks": {"positive_data_acceptance": {
        "expected-statuses": ["2xx", "401", "403", "404", "409", "413", "422", "429", "503"]}}})
    schema = schemathesis.openapi.from_url(f"{served}/api/v1/schema/?format=json", config=config)

    @schema.hook
    def flatmap_path_parameters(context, path_parameters):
        return _seeded(path_parameters, seeds)

    @schema.hook
    def flatmap_body(context, body):
        return _seeded(body, seeds)

    return schema


# Headers an attacker controls, each sometimes past its column or cap: the idempotency key (255
# characters), the request id (64), the agent key. What HTTP lets a header carry: visible ASCII and
# inner spaces.
def header_text(longest: int):
    return st.from_regex(rf"[!-~]([ -~]{{0,{longest - 2}}}[!-~])?", fullmatch=True)


hostile_headers = st.fixed_dictionaries({}, optional={
    "Idempotency-Key": st.one_of(header_text(40), header_text(1_000).filter(lambda v: len(v) > 200)),
    "X-Request-ID": st.one_of(header_text(64), header_text(500)),
    "Authorization": st.one_of(st.just("Bearer"), header_text(300), header_text(300).map(lambda v: f"Bearer rk_{v}"),
                               header_text(300).map(lambda v: f"Bearer {v}")),
})


POSITIVE_ONLY = [positive_data_acceptance]

OPERATIONS = ["lookup_payment", "check_refund_eligibility", "create_refund", "get_refund", "void_authorization",
              "capture_payment", "send_payment_link", "draft_dispute_evidence"]


def test_the_fuzzed_operations_are_every_operation_served(api_schema):
    served_ids = {result.ok().definition.raw["operationId"] for result in api_schema.get_all_operations()}
    assert served_ids == set(OPERATIONS)


@pytest.mark.parametrize("operation_id", OPERATIONS)
def test_every_operation_answers_within_its_documented_responses(api_schema, operation_id, seeds, served,  # noqa: F811
                                                                tally):
    operation = api_schema.find_operation_by_id(operation_id)
    session = requests.Session()

    tried = 0

    @given(case=operation.as_strategy(), hostile=hostile_headers)
    @hypothesis_settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
                         database=None)
    def call(case, hostile: dict[str, str]) -> None:
        nonlocal tried
        tried += 1
        TRIED["api"] += 1
        headers = {"Authorization": f"Bearer {seeds['raw']}"}
        if case.method.upper() == "POST" and not (case.headers or {}).get("Idempotency-Key"):
            headers["Idempotency-Key"] = uuid.uuid4().hex
        case.headers = {**(case.headers or {}), **hostile}
        # Every check; with a hostile header a schema-valid body may rightly be refused (401, 400).
        case.call_and_validate(base_url=served, session=session, headers={**headers, **hostile},
                               excluded_checks=POSITIVE_ONLY if hostile else None)

    call()
    # In the test that ran it, so it can never be vacuous (a pytest-xdist worker may run no operation).
    assert tried >= EXAMPLES // 2, f"{operation_id}: only {tried} requests tried of {EXAMPLES}"


# -- webhook routes: generated bodies and headers ----------------------------------------------------

json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=30),
                           lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner,
                                                                                     max_size=4), max_leaves=20)
bodies = st.one_of(st.binary(max_size=300), json_values.map(lambda v: __import__("json").dumps(v).encode()),
                   st.fixed_dictionaries({"id": st.text(max_size=20), "type": st.text(max_size=20),
                                          "data": st.fixed_dictionaries({"object": json_values})}
                                         ).map(lambda v: __import__("json").dumps(v).encode()))
header_text = st.from_regex(r"[!-~]([ -~]{0,58}[!-~])?", fullmatch=True)  # what HTTP lets a header carry
webhook_headers = st.dictionaries(st.sampled_from(["Stripe-Signature", "Sandbox-Signature", "PAYPAL-TRANSMISSION-ID",
                                                   "PAYPAL-TRANSMISSION-TIME", "PAYPAL-TRANSMISSION-SIG",
                                                   "PAYPAL-CERT-URL", "PAYPAL-AUTH-ALGO"]), header_text, max_size=7)


@pytest.mark.parametrize("route", ["stripe", "paypal", "sandbox", "stripe/default", "paypal/nope"])
def test_webhook_routes_answer_generated_deliveries_with_a_client_error(served, seeds, gateways, route, tally):  # noqa: F811
    session = requests.Session()

    @given(body=bodies, headers=webhook_headers)
    @hypothesis_settings(max_examples=max(EXAMPLES // 6, 20), deadline=None,
                         suppress_health_check=list(HealthCheck), database=None)
    def deliver(body: bytes, headers: dict[str, str]) -> None:
        TRIED["webhooks"] += 1
        response = session.post(f"{served}/webhooks/{route}/", data=body,
                                headers={"Content-Type": "application/json", **headers}, timeout=30)
        assert response.status_code in (400, 404, 413, 429, 503), (response.status_code, response.text[:300])
        error = response.json()["error"]
        assert set(error) == {"code", "message"} and error["code"] and error["message"]

    deliver()
