"""Nothing a caller sends is stored unbounded: verdicts keep the validated request with long free
text cut to STORED_TEXT_LIMIT characters (its length and SHA-256 kept), a session id past its limit
names no Redis window, webhook routes are rate limited per source, and compose's Redis refuses to
evict (rate-limit windows, breaker state and queued payouts are never dropped silently)."""

from __future__ import annotations

import hashlib
import json
from datetime import UTC, datetime
from pathlib import Path

import pytest
import redis
import yaml
from django.test import Client
from django.urls import include, path

from audit.models import Verdict
from processors.models import InboundEvent
from processors.redis_client import redis_key
from refundops.callers import Caller
from refundops.inputs import STORED_TEXT_LIMIT
from tests.conftest import make_payment, post

urlpatterns = [path("", include("refundops.urls")), path("webhooks/", include("refundops.webhook_urls"))]
pytestmark = [pytest.mark.urls(__name__), pytest.mark.django_db]
ROOT = Path(__file__).resolve().parent.parent


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def test_a_refused_body_is_kept_bounded_with_the_size_and_hash_of_what_was_cut(api, policy):
    junk = "x" * 60_000
    response = post(api, "/api/v1/refunds", {"transaction_id": "txn_1", "reason": "duplicate", "junk": junk})
    assert response.status_code == 400 and response.json()["error"]["field"] == "junk"
    verdict = Verdict.objects.get(pk=response.json()["error"]["verdict_id"])
    assert len(json.dumps(verdict.request)) < 2 * STORED_TEXT_LIMIT
    assert verdict.request["junk"] == {"truncated": junk[:STORED_TEXT_LIMIT], "length": 60_000, "sha256": sha(junk)}
    assert verdict.request["transaction_id"] == "txn_1"


def test_long_reasoning_is_cut_in_the_verdict_and_kept_whole_on_the_refund(api, policy):
    payment = make_payment()
    reasoning = "because " * 2_500  # 20,000 characters: the most the contract takes
    response = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "reason": "duplicate", "amount": 100,
                                             "agent": {"reasoning": reasoning, "session_id": "s1"}})
    assert response.status_code == 201, response.json()
    verdict = Verdict.objects.get(pk=response.json()["verdict"]["id"])
    assert verdict.request["agent"]["reasoning"] == {"truncated": reasoning[:STORED_TEXT_LIMIT],
                                                     "length": len(reasoning), "sha256": sha(reasoning)}
    assert verdict.request["agent"]["session_id"] == "s1"
    assert payment.refunds.get().agent_reasoning == reasoning


def test_a_deep_body_is_kept_to_a_bounded_depth(api, policy):
    body = {"transaction_id": "txn_1", "reason": "duplicate", "agent": {"model": [[[[[[[[["SECRET"]]]]]]]]]}}
    response = post(api, "/api/v1/refunds", body)
    assert response.status_code == 400
    verdict = Verdict.objects.get(pk=response.json()["error"]["verdict_id"])
    assert "SECRET" not in json.dumps(verdict.request)


def test_a_session_id_past_its_limit_names_no_redis_window_of_its_own(api, policy, settings):
    settings.RATE_LIMIT_SESSION_PER_MINUTE = 100
    payment = make_payment()
    response = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "reason": "duplicate",
                                             "agent": {"session_id": "s" * 5_000}})
    assert response.status_code == 400 and response.json()["error"]["field"] == "agent.session_id"
    client = redis.Redis.from_url(settings.REDIS_URL)
    # The request counts in the key's session for this hour (as one naming no session), not in one
    # named after the 5,000 characters.
    hour = Caller.for_key(api.key).session_id_for("", datetime.now(UTC))
    expected = redis_key(f"rl:session:{api.key.agent_id}:{hashlib.sha256(hour.encode()).hexdigest()[:32]}")
    assert [k.decode() for k in client.scan_iter(match=redis_key("rl:session:*"))] == [expected]
    assert list(client.scan_iter(match=redis_key("rl:agent:*")))  # the agent's window counted it


@pytest.fixture
def web() -> Client:
    return Client(enforce_csrf_checks=True)


def test_webhook_routes_are_rate_limited_per_source(web, gateways, settings):
    settings.RATE_LIMIT_WEBHOOK_PER_MINUTE = 3
    answers = [web.post("/webhooks/stripe/", data=b"{}", content_type="application/json",
                        REMOTE_ADDR="203.0.113.7").status_code for _ in range(5)]
    assert answers == [400, 400, 400, 429, 429]
    assert InboundEvent.objects.filter(processor="stripe").count() == 3
    other = web.post("/webhooks/stripe/", data=b"{}", content_type="application/json", REMOTE_ADDR="203.0.113.8")
    assert other.status_code == 400
    throttled = web.post("/webhooks/stripe/", data=b"{}", content_type="application/json", REMOTE_ADDR="203.0.113.7")
    assert throttled.json()["error"]["code"] == "rate_limited" and int(throttled["Retry-After"]) >= 1


def test_compose_redis_has_a_memory_cap_and_never_evicts():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    command = compose["services"]["redis"]["command"]
    assert command[command.index("--maxmemory") + 1].endswith(("mb", "gb"))
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"
