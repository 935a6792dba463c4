"""Structured JSON logs: one request id from the agent's call through the worker, the gateway call
and the merchant webhook, returned as a response header; no secret or card number in any line.
(Issue 13, finding 7.)"""

from __future__ import annotations

import io
import json
import logging
import logging.config
import uuid

import pytest
import structlog
from django.conf import settings
from hypothesis import HealthCheck, example, given, settings as hypothesis_settings, strategies as st

from processors import sandbox
from refundops.logs import _redact_each, redact_text
from refundops.models import MerchantEndpoint, Refund, RefundState
from tests.conftest import make_payment
from tests.fakes.fixtures import wait_for
from tests.test_plain_worker import plain_worker  # noqa: F401 - the fixture

pytestmark = pytest.mark.django_db


def formatted_lines(emit) -> list[dict]:
    """Run ``emit()`` with a handler that formats exactly as settings.LOGGING does."""
    formatter = logging.config.DictConfigurator({}).configure_formatter(
        dict(settings.LOGGING["formatters"]["structured"]))
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger("refundops")
    root.addHandler(handler)
    try:
        emit()
    finally:
        root.removeHandler(handler)
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


def test_the_response_carries_the_request_id_it_was_given_or_made(api):
    given = api.get("/api/v1/payments/txn_nope", HTTP_X_REQUEST_ID="req-abc-123")
    assert given["X-Request-ID"] == "req-abc-123"
    made = api.get("/api/v1/payments/txn_nope")
    assert len(made["X-Request-ID"]) == 32
    hostile = api.get("/api/v1/payments/txn_nope", HTTP_X_REQUEST_ID="x\" injected\n{" * 3)
    assert hostile["X-Request-ID"] != "x\" injected\n{" * 3  # only a safe id is echoed


def test_the_web_logs_each_request_as_json_with_its_id(api):
    lines = formatted_lines(lambda: api.get("/api/v1/payments/txn_nope", HTTP_X_REQUEST_ID="req-web-1"))
    request = [line for line in lines if line.get("logger") == "refundops.request"]
    assert request and request[0]["request_id"] == "req-web-1" and request[0]["status"] == 404
    assert request[0]["route"] == "payment-detail" and "timestamp" in request[0]


SECRETS = ["rk_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789", "sk_live_51HxyzSECRETsecret", "whsec_abcdef123456",
           "4242 4242 4242 4242", "4000056655665556"]


def test_no_key_secret_or_card_number_reaches_a_log_line():
    def emit():
        logging.getLogger("refundops.test").warning(
            "agent key %s, stripe %s, webhook secret %s, card %s / %s", *SECRETS)
        structlog.get_logger("refundops.test").info(
            "call", api_key="sk_test_plainvalue", headers={"Authorization": "Bearer rk_AbCdEfGhIjKlMnOp"},
            card_number="5555555555554444", client_secret="pp-secret", url="https://x/?client_secret=abc&y=1",
            order="ORD-1042", amount=1999)
        try:
            raise ValueError(f"gateway said no for {SECRETS[0]}")
        except ValueError:
            logging.getLogger("refundops.test").exception("failed")

    lines = formatted_lines(emit)
    text = "\n".join(json.dumps(line, ensure_ascii=False) for line in lines)
    for secret in [*SECRETS, "sk_test_plainvalue", "rk_AbCdEfGhIjKlMnOp", "5555555555554444", "pp-secret",
                   "client_secret=abc"]:
        assert secret not in text, secret
    assert "rk_AbCdEfGh…[redacted]" in text  # the key's prefix still names it
    assert "ORD-1042" in text and '"amount": 1999' in text  # what is not secret stays


FRAGMENTS = ["rk_", "RK_", "sk_live_", "pk_test_", "whsec_", "Bearer ", "basic\t", "BEARER", "secret=",
             "Client_Secret=", "PASSWORD=", "4242", " 4242", "-", "4242-4242-4242-4242", "5555555555554444",
             "1234567890123", "abc", "AbCdEfGhIjKl", "&", "=", " ", "\n", "é", "٣", "T04:53:05.331258Z"]


@hypothesis_settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=12)), max_size=12).map("".join))
@example("POST refund-create 2026-12-01T04:53:05.331258Z e9f4c40c9f2e48689cd97cd7392c8683")
@example("card 4000 0566 5566 5556 and key rk_AbCdEfGhIjKlMnOp, Basic dXNlcjpwdw==")
def test_redaction_skips_only_texts_none_of_its_patterns_can_match(text):
    """redact_text scans once for what every pattern needs and skips the six scans without it: it
    redacts exactly what running every pattern redacts."""
    assert redact_text(text) == _redact_each(text)


@pytest.mark.django_db(transaction=True)
def test_one_request_id_in_the_web_answer_the_worker_the_gateway_call_and_the_merchant_webhook(
        api, policy, plain_worker, settings):  # noqa: F811 - the fixture
    import http.server
    import threading

    received: list[str] = []

    class Merchant(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            received.append(self.headers.get("X-Request-ID", ""))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    merchant = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Merchant)
    threading.Thread(target=merchant.serve_forever, daemon=True).start()
    MerchantEndpoint.objects.create(url=f"http://127.0.0.1:{merchant.server_port}/hook")
    sandbox.set_mode("up", settle_delay_seconds=0)
    request_id = f"req-{uuid.uuid4().hex[:12]}"
    response = api.post("/api/v1/refunds", {"transaction_id": make_payment(amount=5_000).pk, "amount": 700,
                                            "reason": "product_issue"}, format="json",
                        HTTP_IDEMPOTENCY_KEY=uuid.uuid4().hex, HTTP_X_REQUEST_ID=request_id)
    assert response.status_code == 201 and response["X-Request-ID"] == request_id
    refund_id = response.json()["refund"]["id"]
    wait_for(lambda: Refund.objects.filter(pk=refund_id, status=RefundState.SETTLED).exists(), timeout=90,
             what="settled")
    wait_for(lambda: received, timeout=60, what="a merchant webhook")
    merchant.shutdown()

    worker_lines = [json.loads(line) for line in plain_worker.read_text().splitlines() if line.startswith("{")]
    mine = [line for line in worker_lines if line.get("request_id") == request_id]
    events = " ".join(line["event"] for line in mine)
    assert "gateway sandbox/default answered" in events, worker_lines[-20:]
    assert f"refund {refund_id}: settled after the gateway call" in events
    assert request_id in received  # the merchant can quote it back to us
