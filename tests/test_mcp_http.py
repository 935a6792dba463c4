"""The MCP server as agents reach it: streamable HTTP at /mcp on the app uvicorn serves, and
``manage.py mcp`` over stdio. Real servers, real sockets and processes, the test database."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx2
import pytest
from django.db import connection
from django.utils import timezone
from mcp import ClientSession
from mcp.client.stdio import StdioServerParameters, stdio_client
from mcp.client.streamable_http import streamable_http_client

from audit.models import Verdict
from refundops.models import COUNTING_STATES, Capability, Refund
from tests.conftest import make_agent_key, make_payment

ROOT = Path(__file__).resolve().parent.parent
# The servers run on their own connections: they see only committed rows.
pytestmark = pytest.mark.django_db(transaction=True)


def database_url() -> str:
    """The test database, for a server in another process."""
    database = connection.settings_dict
    return f"postgres://{database['USER']}@{database['HOST']}:{database['PORT']}/{database['NAME']}"


async def over_http(url: str, raw_key: str, payment_id: str) -> dict:
    async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {raw_key}"}, timeout=30) as http:
        async with streamable_http_client(f"{url}/mcp", http_client=http) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                tools = await session.list_tools()
                created = await session.call_tool("create_refund", {
                    "transaction_id": payment_id, "amount": 1_500, "reason": "product_issue",
                    "idempotency_key": uuid.uuid4().hex, "agent": {"session_id": "http-1"}})
                refused = await session.call_tool("create_refund", {
                    "transaction_id": payment_id, "amount": 4_000, "reason": "product_issue",
                    "idempotency_key": uuid.uuid4().hex})
    return {"tools": [tool.name for tool in tools.tools], "created": created, "refused": refused}


def test_an_agent_lists_creates_and_is_refused_over_streamable_http(served, policy):
    raw = make_agent_key(Capability.PAYMENTS_READ, Capability.REFUNDS_CREATE)[1]
    payment = make_payment(amount=5_000)
    seen = asyncio.run(over_http(served, raw, payment.pk))
    assert seen["tools"] == ["lookup_payment", "check_refund_eligibility", "create_refund", "get_refund"]
    created = seen["created"]
    assert not created.is_error and created.structured_content["refund"]["status"] == "approved"
    refund = Refund.objects.get(pk=created.structured_content["refund"]["id"])
    assert refund.amount_minor == 1_500 and refund.agent_session_id == "http-1"
    assert Verdict.objects.filter(pk=refund.verdict_id).exists()
    refused = seen["refused"]
    assert refused.is_error
    error = refused.structured_content["error"]
    assert error["code"] == "AMOUNT_EXCEEDS_REFUNDABLE" and Verdict.objects.filter(pk=error["verdict_id"]).exists()


async def racing_refunds(url: str, raw_key: str, payment_id: str, agents: int) -> list:
    """``agents`` clients at once, each on its own connection, each asking for 1,000 of the payment."""
    async def one() -> object:
        async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {raw_key}"}, timeout=60) as http:
            async with streamable_http_client(f"{url}/mcp", http_client=http) as (read, write):
                async with ClientSession(read, write) as session:
                    await session.initialize()
                    return await session.call_tool("create_refund", {
                        "transaction_id": payment_id, "amount": 1_000, "reason": "duplicate",
                        "idempotency_key": uuid.uuid4().hex})
    return await asyncio.gather(*(one() for _ in range(agents)))


def test_racing_agents_over_http_never_refund_more_than_was_captured(served, policy):
    raw = make_agent_key(Capability.REFUNDS_CREATE)[1]
    payment = make_payment(amount=5_000)
    results = asyncio.run(racing_refunds(served, raw, payment.pk, agents=8))
    refused = [r.structured_content["error"]["code"] for r in results if r.is_error]
    assert len(refused) == 3 and set(refused) <= {"AMOUNT_EXCEEDS_REFUNDABLE", "PAYMENT_NOT_REFUNDABLE"}
    live = Refund.objects.filter(payment=payment, status__in=COUNTING_STATES)
    assert live.count() == 5 and sum(live.values_list("amount_minor", flat=True)) == 5_000


def other_connections() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                       "AND pid <> pg_backend_pid()")
        return cursor.fetchone()[0]


def test_mcp_calls_over_http_leave_no_database_connection_open(served, policy):
    raw = make_agent_key(Capability.REFUNDS_CREATE)[1]
    asyncio.run(racing_refunds(served, raw, make_payment(amount=50_000).pk, agents=8))
    deadline = time.monotonic() + 5
    while other_connections() and time.monotonic() < deadline:  # a backend exits just after its client
        time.sleep(0.05)
    assert other_connections() == 0


def test_mcp_over_http_without_a_live_key_is_401_in_the_contract_shape(served):
    key, raw = make_agent_key()
    key.revoked_at = timezone.now()
    key.save()
    initialize = {"jsonrpc": "2.0", "id": 1, "method": "initialize",
                  "params": {"protocolVersion": "2025-06-18", "capabilities": {},
                             "clientInfo": {"name": "t", "version": "1"}}}
    headers = {"Accept": "application/json, text/event-stream"}
    for authorization in (None, "Bearer rk_unknown", f"Bearer {raw}"):
        sent = {**headers, "Authorization": authorization} if authorization else headers
        response = httpx2.post(f"{served}/mcp", json=initialize, headers=sent, timeout=10)
        assert response.status_code == 401, authorization
        assert response.json()["error"]["code"] == "UNAUTHENTICATED"
        assert response.headers["WWW-Authenticate"].startswith("Bearer")


def test_mcp_over_http_holds_the_host_header_to_allowed_hosts(served):
    raw = make_agent_key()[1]
    response = httpx2.post(f"{served}/mcp", json={}, timeout=10,
                           headers={"Authorization": f"Bearer {raw}", "Host": "attacker.example"})
    assert response.status_code == 400 and response.json()["error"]["field"] == "host"


def test_the_same_host_and_port_serve_the_rest_api(served):
    response = httpx2.get(f"{served}/api/v1/schema/?format=json", timeout=10)
    assert response.status_code == 200 and "/api/v1/refunds" in response.text


def test_manage_py_mcp_serves_the_tools_of_its_key_over_stdio(policy):
    raw = make_agent_key(Capability.AUTHORIZATIONS_VOID, Capability.PAYMENTS_READ)[1]
    payment = make_payment()
    env = {**os.environ, "REFUNDOPS_AGENT_KEY": raw, "DATABASE_URL": database_url()}
    params = StdioServerParameters(command=sys.executable, args=["manage.py", "mcp"], env=env, cwd=str(ROOT))

    async def scenario() -> tuple[list[str], dict]:
        async with stdio_client(params) as (read, write):
            async with ClientSession(read, write) as session:
                await session.initialize()
                tools = await session.list_tools()
                looked_up = await session.call_tool("lookup_payment", {"transaction_id": payment.pk})
        return [tool.name for tool in tools.tools], looked_up.structured_content

    names, looked_up = asyncio.run(scenario())
    assert names == ["lookup_payment", "void_authorization"]
    assert looked_up["id"] == payment.pk and looked_up["amount_captured"] == 10_000


def test_manage_py_mcp_refuses_to_start_without_a_live_key():
    for value in ("", "rk_unknown"):
        env = {**os.environ, "REFUNDOPS_AGENT_KEY": value, "DATABASE_URL": database_url()}
        done = subprocess.run([sys.executable, "manage.py", "mcp"], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=60, stdin=subprocess.DEVNULL)
        assert done.returncode != 0 and "REFUNDOPS_AGENT_KEY" in done.stderr, done.stderr
        assert done.stdout == ""  # stdout is the protocol channel: nothing else may reach it


@pytest.mark.parametrize("body", ["[" * 30_000 + "]" * 30_000, '{"jsonrpc": "2.0", "id": 1, "method": "tools/call", '
                                  '"params": {"name": "request_refund", "arguments": ' + '{"a":' * 5_000 + "1"
                                  + "}" * 5_000 + "}}"])
def test_mcp_over_http_answers_deep_json_with_a_client_error(served, body):
    raw = make_agent_key()[1]
    response = httpx2.post(f"{served}/mcp", content=body, timeout=30,
                           headers={"Authorization": f"Bearer {raw}", "Content-Type": "application/json",
                                    "Accept": "application/json, text/event-stream"})
    assert 400 <= response.status_code < 500, response.text[:300]


def test_mcp_over_http_refuses_a_body_over_the_cap(served):
    raw = make_agent_key()[1]
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "ping", "params": {"pad": "a" * 70_000}})
    response = httpx2.post(f"{served}/mcp", content=body, timeout=30,
                           headers={"Authorization": f"Bearer {raw}", "Content-Type": "application/json",
                                    "Accept": "application/json, text/event-stream"})
    assert response.status_code == 413 and response.json()["error"]["code"] == "PAYLOAD_TOO_LARGE"
