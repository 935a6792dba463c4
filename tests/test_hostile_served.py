"""Hostile input against the app as served (uvicorn, refundops.asgi: the MCP app at /mcp and Django
in refundops/asgi_handler.py's handler), on a real socket: numbers JSON has no word for, keys
longer than their column, JSON nested past the cap, and whatever else goes wrong inside a tool, over
MCP; bodies over the site's cap before anyone is known (issue 28, findings 6, 8 and 9)."""

from __future__ import annotations

import json
import uuid

import httpx2
import pytest

from audit.models import Verdict
from refundops.models import IdempotencyRecord, Refund
from tests.conftest import make_agent_key, make_payment

pytestmark = pytest.mark.django_db(transaction=True)  # the server sees committed rows only

MCP_HEADERS = {"Content-Type": "application/json", "Accept": "application/json, text/event-stream"}


def rpc(served: str, raw_key: str, tool: str, arguments_json: str) -> httpx2.Response:
    """A tools/call as its JSON text, so it may say what no JSON library writes (NaN, 1e999)."""
    body = ('{"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": "%s", "arguments": %s}}'
            % (tool, arguments_json))
    return httpx2.post(f"{served}/mcp", content=body, timeout=30,
                       headers={**MCP_HEADERS, "Authorization": f"Bearer {raw_key}"})


def tool_error(response: httpx2.Response) -> dict:
    assert response.status_code == 200, response.text[:500]
    result = response.json()["result"]
    assert result["isError"], result
    return result["structuredContent"]["error"]


@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize("tool", ["create_refund", "check_refund_eligibility"])
def test_mcp_refuses_a_number_json_cannot_spell_as_a_validation_error(served, policy, tool, number):
    payment, raw = make_payment(), make_agent_key()[1]
    arguments = json.dumps({"transaction_id": payment.pk, "reason": "duplicate", "note": "__N__",
                            "idempotency_key": uuid.uuid4().hex}).replace('"__N__"', number)
    error = tool_error(rpc(served, raw, tool, arguments))
    assert error["code"] == "VALIDATION_ERROR" and "NaN" in error["message"], error
    assert Verdict.objects.get(pk=error["verdict_id"]).code == "VALIDATION_ERROR"
    assert not Refund.objects.exists() and not IdempotencyRecord.objects.exists()


@pytest.mark.parametrize("tool,arguments", [
    ("create_refund", {"reason": "duplicate"}),
    ("void_authorization", {}),
    ("capture_payment", {"amount": 100}),
])
def test_mcp_refuses_an_idempotency_key_longer_than_its_column(served, policy, tool, arguments):
    payment, raw = make_payment(), make_agent_key()[1]
    error = tool_error(rpc(served, raw, tool, json.dumps(
        {"transaction_id": payment.pk, **arguments, "idempotency_key": "k" * 300})))
    assert error["code"] == "IDEMPOTENCY_KEY_REQUIRED" and "255" in error["message"], error
    assert Verdict.objects.get(pk=error["verdict_id"]).idempotency_key == ""


def test_an_unexpected_error_in_a_tool_is_internal_error_with_a_request_id_and_no_internals(served, policy,
                                                                                         monkeypatch):
    from django.db import DataError

    from refundops.services import payments

    def broken(**kwargs):
        raise DataError("invalid input syntax for type json\nLINE 1: SELECT secret FROM refundops_payment")

    monkeypatch.setattr(payments, "lookup_payment", broken)
    raw = make_agent_key()[1]
    response = rpc(served, raw, "lookup_payment", json.dumps({"transaction_id": "txn_x"}))
    error = tool_error(response)
    assert error["code"] == "INTERNAL_ERROR" and error["request_id"] and error["verdict_id"] is None, error
    assert error["request_id"] in error["message"] and response.headers["X-Request-ID"] == error["request_id"]
    assert "SELECT" not in response.text and "LINE 1" not in response.text and "json" not in error["message"]


def _nested(depth: int) -> str:
    """A JSON object ``depth`` levels deep."""
    return '{"a": ' * depth + "1" + "}" * depth


@pytest.mark.parametrize("depth", [33, 150, 1000])
def test_mcp_arguments_nested_past_the_cap_are_payload_too_large_as_on_rest(served, policy, depth):
    """REST answers 413 for a body nested past 32; MCP's arguments are that body. Depth counts the
    arguments object as 1, as REST counts the body."""
    payment, raw = make_payment(), make_agent_key()[1]
    arguments = ('{"transaction_id": "%s", "reason": "duplicate", "idempotency_key": "d", "agent": %s}'
                 % (payment.pk, _nested(depth - 1)))
    response = rpc(served, raw, "create_refund", arguments)
    assert response.status_code == 413, response.text[:300]
    error = response.json()["error"]
    assert error["code"] == "PAYLOAD_TOO_LARGE" and "32" in error["message"], error
    assert Verdict.objects.get(pk=error["verdict_id"]).code == "PAYLOAD_TOO_LARGE"
    assert not Refund.objects.exists()


def test_mcp_arguments_at_the_cap_reach_the_service(served, policy):
    payment, raw = make_payment(), make_agent_key()[1]
    arguments = ('{"transaction_id": "%s", "reason": "duplicate", "idempotency_key": "d", "agent": %s}'
                 % (payment.pk, _nested(31)))
    error = tool_error(rpc(served, raw, "create_refund", arguments))
    assert error["code"] == "VALIDATION_ERROR" and error["field"].startswith("agent."), error


# -- bodies over the site's cap under the ASGI handler as served (issue 28, finding 8) -------------

def _exchange(served: str, head: str, chunks=()) -> tuple[int, dict]:
    """Send ``head`` (and ``chunks``) on a raw socket and read the answer: the server must answer
    without the rest of the body, which is never sent (a server waiting for it would time out)."""
    import socket
    from urllib.parse import urlsplit

    address = urlsplit(served)
    with socket.create_connection((address.hostname, address.port), timeout=30) as sock:
        sock.sendall(head.encode())
        try:
            for chunk in chunks:
                sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before we were done
        received = b""
        while not _whole(received):
            data = sock.recv(65_536)
            if not data:
                break
            received += data
    head_text, _, body = received.partition(b"\r\n\r\n")
    return int(head_text.split()[1]), json.loads(body)


def _whole(received: bytes) -> bool:
    head, separator, body = received.partition(b"\r\n\r\n")
    fields = dict(line.lower().split(b": ", 1) for line in head.split(b"\r\n")[1:] if b": " in line)
    return bool(separator) and len(body) >= int(fields.get(b"content-length", b"0"))


@pytest.mark.parametrize("path", ["/api/v1/refunds", "/admin/login/", "/webhooks/stripe/"])
def test_a_declared_length_over_the_cap_is_413_before_any_of_it_is_sent(served, settings, path):
    status, body = _exchange(served, f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                                     f"\r\nContent-Length: {300 * 1024 * 1024}\r\n\r\n")
    assert status == 413 and body["error"]["code"].upper() == "PAYLOAD_TOO_LARGE", body


@pytest.mark.parametrize("path", ["/api/v1/refunds", "/admin/login/"])
def test_a_chunked_body_is_refused_at_the_cap_and_never_read_to_its_end(served, settings, path):
    piece = b"x" * 65_536
    chunk = b"%x\r\n" % len(piece) + piece + b"\r\n"
    over = settings.REQUEST_MAX_BODY_BYTES // len(piece) + 2  # past the cap, and no last chunk: never ends
    status, body = _exchange(served, f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json"
                                     "\r\nTransfer-Encoding: chunked\r\n\r\n", [chunk] * over)
    assert status == 413 and body["error"]["code"] == "PAYLOAD_TOO_LARGE", body
