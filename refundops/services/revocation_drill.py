"""The revocation drill: proof, on the running system, that revoking a capability and then a key
refuses the very next REST and MCP call. Evidence an auditor asks for (seed 004: "drill results").

In a merchant of its own it creates an agent holding ``payments.read`` and ``refunds.create`` with
one key, and probes with calls that move no money and read nothing: a look-up of a payment that does
not exist (answered PAYMENT_NOT_FOUND once the key and capability pass) and a refund check on it.
It revokes ``payments.read`` (the look-up must then be CAPABILITY_NOT_GRANTED), then the key (every
call must be UNAUTHENTICATED), over REST (Django's test client, through the whole middleware stack)
and MCP (the SDK's in-process client). The result, with the time from each revocation to its first
refusal, is an audit entry ``revocation.drill`` the evidence pack reads. The key ends revoked even
when a step fails, and the agent inactive.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

from asgiref.sync import async_to_sync
from django.conf import settings
from django.test import Client as HttpClient

from audit.services import record_audit
from refundops.models import Agent, AgentKey, Capability, Merchant
from refundops.services import agents

DRILL_MERCHANT = "Revocation drill"
ACTOR = "system:revocation_drill"
PROBE_PAYMENT = "txn_revocation_drill_probe"  # never exists: nothing is read, nothing moves


@dataclass
class Step:
    name: str
    channel: str  # "rest" or "mcp"
    expected: str  # the code the call must answer with
    got: str
    ok: bool
    ms_since_revocation: float | None = None


@dataclass
class DrillResult:
    agent_id: str
    key_prefix: str
    steps: list[Step] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return bool(self.steps) and all(step.ok for step in self.steps)

    def as_json(self) -> dict[str, Any]:
        return {"passed": self.passed, "agent_id": self.agent_id, "key_prefix": self.key_prefix,
                "steps": [asdict(step) for step in self.steps]}


def _host() -> str:
    named = [h for h in settings.ALLOWED_HOSTS if h not in ("*",) and not h.startswith(".")]
    return named[0] if named else "localhost"


def _rest(raw: str, method: str, path: str, body: dict[str, Any] | None = None) -> str:
    client = HttpClient(HTTP_HOST=_host(), HTTP_AUTHORIZATION=f"Bearer {raw}")
    if method == "GET":
        response = client.get(path)
    else:
        response = client.post(path, json.dumps(body or {}), content_type="application/json",
                               HTTP_IDEMPOTENCY_KEY=uuid.uuid4().hex)
    try:
        return response.json().get("error", {}).get("code", "") or str(response.status_code)
    except ValueError:
        return str(response.status_code)


def _mcp(raw: str, tool: str, arguments: dict[str, Any]) -> str:
    from mcp import Client
    from mcp.shared.exceptions import MCPError

    from refundops.mcp_server import build_server, fixed_key

    async def run() -> str:
        async with Client(build_server(fixed_key(raw))) as client:
            try:
                result = await client.call_tool(tool, arguments)
            except MCPError as refused:
                return ((refused.data or {}).get("error") or {}).get("code", "") or "MCP_ERROR"
            if result.is_error:
                return ((result.structured_content or {}).get("error") or {}).get("code", "") or "TOOL_ERROR"
            return "OK"
    return async_to_sync(run)()


def run_drill() -> DrillResult:
    """Run the drill once and record it; see the module's docstring."""
    merchant, _ = Merchant.objects.get_or_create(name=DRILL_MERCHANT)
    agent, raw = agents.create_agent(name=f"drill-{uuid.uuid4().hex[:12]}", owner="revocation drill",
                                     capabilities=[Capability.PAYMENTS_READ, Capability.REFUNDS_CREATE],
                                     actor=ACTOR, merchant=merchant.pk)
    key = AgentKey.objects.filter(agent=agent).get()
    result = DrillResult(agent.pk, key.prefix)
    lookup = ("GET", f"/api/v1/payments/{PROBE_PAYMENT}")
    check = ("POST", "/api/v1/refunds/check", {"transaction_id": PROBE_PAYMENT, "amount": 1, "reason": "duplicate"})

    def probe(name: str, channel: str, expected: str, got: str, since: float | None = None) -> None:
        ms = round((time.perf_counter() - since) * 1000, 1) if since is not None else None
        result.steps.append(Step(name, channel, expected, got, got == expected, ms))

    try:
        probe("look-up before revocation", "rest", "PAYMENT_NOT_FOUND", _rest(raw, *lookup))
        probe("look-up before revocation", "mcp", "PAYMENT_NOT_FOUND",
              _mcp(raw, "lookup_payment", {"transaction_id": PROBE_PAYMENT}))
        since = time.perf_counter()
        agents.revoke_capability(agent_id=agent.pk, capability=Capability.PAYMENTS_READ, actor=ACTOR)
        probe("look-up after payments.read was revoked", "rest", "CAPABILITY_NOT_GRANTED", _rest(raw, *lookup), since)
        probe("look-up after payments.read was revoked", "mcp", "CAPABILITY_NOT_GRANTED",
              _mcp(raw, "lookup_payment", {"transaction_id": PROBE_PAYMENT}), since)
        since = time.perf_counter()
        agents.revoke_key(prefix=key.prefix, actor=ACTOR)
        probe("refund check after the key was revoked", "rest", "UNAUTHENTICATED", _rest(raw, *check), since)
        probe("refund check after the key was revoked", "mcp", "UNAUTHENTICATED",
              _mcp(raw, "check_refund_eligibility", {"transaction_id": PROBE_PAYMENT, "amount": 1,
                                                     "reason": "duplicate"}), since)
    finally:
        # Nothing usable left behind, whatever happened above.
        if AgentKey.objects.filter(pk=key.pk, revoked_at__isnull=True).exists():
            agents.revoke_key(prefix=key.prefix, actor=ACTOR)
        Agent.objects.filter(pk=agent.pk).update(is_active=False)
        record_audit(actor=ACTOR, action="revocation.drill", subject_type="agent", subject_id=agent.pk,
                     data=result.as_json())
    return result
