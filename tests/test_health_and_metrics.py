"""What a platform engineer's probes and Prometheus read: /healthz, /readyz (503 naming what is
down) and /metrics behind a bearer token. (Issue 13, finding 7.)

Redis "down" is a URL pointing at a port nobody listens on: the shared Redis keeps running."""

from __future__ import annotations

import re
import socket
from datetime import timedelta

import pytest
from django.test import Client
from django.utils import timezone

from processors import sandbox
from refundops.models import PlatformState, Refund, RefundState
from tests.conftest import make_payment, post

pytestmark = pytest.mark.django_db

TOKEN = "metrics-token-for-tests-0123456789"


def dead_redis_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"  # closed again: nothing answers there


def test_healthz_answers_while_the_process_runs():
    answer = Client().get("/healthz")
    assert answer.status_code == 200 and answer.json()["status"] == "ok"


def test_readyz_is_200_when_database_redis_and_broker_answer():
    answer = Client().get("/readyz")
    assert answer.status_code == 200, answer.content
    assert answer.json()["checks"] == {"database": "ok", "redis": "ok", "broker": "ok"}


def test_readyz_is_503_naming_redis_when_redis_is_unreachable(settings):
    settings.REDIS_URL = dead_redis_url()
    settings.CELERY_BROKER_URL = settings.REDIS_URL
    answer = Client().get("/readyz")
    assert answer.status_code == 503
    body = answer.json()
    assert body["status"] == "unavailable" and body["checks"]["database"] == "ok"
    assert "redis" in body["down"] and "broker" in body["down"]
    assert "Redis" in body["message"]


def metrics(**headers) -> tuple[int, str]:
    answer = Client().get("/metrics", **headers)
    return answer.status_code, answer.content.decode()


def test_metrics_refuse_without_the_token_and_answer_with_it(settings):
    settings.METRICS_TOKEN = TOKEN
    status, body = metrics()
    assert status == 401 and "METRICS_TOKEN" in body
    assert metrics(HTTP_AUTHORIZATION="Bearer wrong")[0] == 401
    assert metrics(HTTP_AUTHORIZATION=f"Bearer {TOKEN}")[0] == 200


def test_without_a_token_metrics_answer_loopback_only_in_development(settings):
    settings.METRICS_TOKEN = ""
    assert metrics()[0] == 200  # the test client is 127.0.0.1
    assert metrics(REMOTE_ADDR="10.1.2.3")[0] == 401
    settings.PRODUCTION = True
    assert metrics()[0] == 401


def sample(body: str, name: str, **labels: str) -> float:
    """The value of one series, with at least these labels."""
    for line in body.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            found = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}")[0])) if "{" in line else {}
            if all(found.get(k) == v for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} {labels} in:\n{body}")


@pytest.mark.django_db(transaction=True)
def test_metrics_carry_the_series_operators_alert_on(settings, api, policy):
    settings.METRICS_TOKEN = TOKEN
    sandbox.set_mode("up", settle_delay_seconds=0)
    approved = post(api, "/api/v1/refunds", {"transaction_id": make_payment(amount=5_000).pk, "amount": 500,
                                             "reason": "product_issue"})
    assert approved.status_code == 201  # eager tasks: submitted to the sandbox in this process
    held = post(api, "/api/v1/refunds", {"transaction_id": make_payment(amount=900_000).pk, "amount": 800_000,
                                         "reason": "product_issue"})
    assert held.status_code == 202, held.json()
    Refund.objects.filter(pk=held.json()["refund"]["id"]).update(created_at=timezone.now() - timedelta(hours=2))
    denied = post(api, "/api/v1/refunds", {"transaction_id": "txn_nope", "amount": 1, "reason": "duplicate"})
    assert denied.status_code == 404
    PlatformState.objects.filter(pk=PlatformState.current().pk).update(refunds_paused=True)

    status, body = metrics(HTTP_AUTHORIZATION=f"Bearer {TOKEN}")
    assert status == 200
    assert sample(body, "refundops_verdicts_total", outcome="approved", code="") >= 1
    assert sample(body, "refundops_verdicts_total", outcome="denied", code="PAYMENT_NOT_FOUND") == 1
    hold_reason = Refund.objects.get(status=RefundState.HELD).hold_reasons[0]
    assert sample(body, "refundops_holds_total", reason=hold_reason) == 1
    assert sample(body, "refundops_refunds", status="held", gateway="sandbox") == 1
    assert sample(body, "refundops_oldest_held_refund_age_seconds") >= 7000
    assert sample(body, "refundops_gateway_request_seconds_count", gateway="sandbox", outcome="ok") >= 1
    assert sample(body, "refundops_gateway_errors_total", gateway="sandbox", kind="unavailable") == 0
    assert sample(body, "refundops_queue_depth", queue="payments.stripe") == 0
    assert sample(body, "refundops_gateway_breaker_open", gateway="sandbox", account="default") == 0
    assert sample(body, "refundops_refunds_paused") == 1
    assert sample(body, "refundops_agents_disabled") == 0
    assert sample(body, "refundops_agent_breaker_open") == 0
    assert sample(body, "refundops_webhook_delivery_lag_seconds") == 0
    assert sample(body, "refundops_http_requests_total", method="POST", route="refund-create", status="201") >= 1


def test_request_series_name_only_known_methods_whatever_a_client_sends(api):
    """A method is the client's text: each new one made new series for ever (a counter's and a
    histogram's buckets), so a client could grow every web process's memory and every scrape at
    will. Fails before: the methods below were series of their own."""
    from refundops.metrics import HTTP_REQUESTS

    before = {labels for labels in HTTP_REQUESTS._metrics}
    for method in ("BREW", "PROPFIND", "XXXXXXXXXXXXXXXXXXXX"):
        assert api.generic(method, "/api/v1/refunds").status_code == 405
    made = {labels for labels in HTTP_REQUESTS._metrics} - before
    # The one series they share may exist already (an earlier test in this process sent one).
    assert made <= {("other", "refund-create", "405")} and ("other", "refund-create", "405") in HTTP_REQUESTS._metrics
    api.generic("GET", "/api/v1/payments/txn_nope")
    assert ("GET", "payment-detail", "404") in HTTP_REQUESTS._metrics
