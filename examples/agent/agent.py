"""A small customer-service agent that refunds through RefundOps over MCP (the official `mcp` SDK).

It plays one scripted conversation, with no model and no internet: a customer says their order
arrived broken; the agent looks up the payment, checks whether a refund would go through, asks for
it, and tells the customer the verdict in plain words.

    scripts/run        # prints the command below with a real key and payment id
    .venv/bin/python examples/agent/agent.py --url http://127.0.0.1:8000 --key rk_… --payment txn_…

Where a real model plugs in: :class:`ScriptedModel` decides each next step from the conversation
and the tools the server lists. Replace it with a class whose ``next_step`` asks your model (give it
``tools`` as its tool definitions, each tool's ``input_schema`` is JSON Schema) and returns the
same :class:`ToolCall` or :class:`Reply`. Everything else (the MCP session, the key, idempotency
keys, reading refusals) stays as it is.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

import httpx2
from mcp import ClientSession
from mcp.client.streamable_http import streamable_http_client
from mcp.types import Tool


@dataclass
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclass
class Reply:
    text: str


@dataclass
class Conversation:
    """What the model sees: the customer's words, and every tool call with its result."""
    turns: list[dict[str, Any]] = field(default_factory=list)

    def said(self, who: str, text: str) -> None:
        self.turns.append({"role": who, "text": text})
        print(f"{who:>9}: {text}")

    def called(self, call: ToolCall, result: dict[str, Any], is_error: bool) -> None:
        self.turns.append({"role": "tool", "name": call.name, "arguments": call.arguments,
                           "result": result, "is_error": is_error})
        summary = result.get("error", {}).get("code") if is_error else _summary(call.name, result)
        print(f"{'tool':>9}: {call.name}({json.dumps(call.arguments)}) -> {summary}")

    def last(self, name: str) -> dict[str, Any] | None:
        return next((t for t in reversed(self.turns) if t.get("name") == name), None)


class Model(Protocol):
    def next_step(self, conversation: Conversation, tools: list[Tool]) -> ToolCall | Reply: ...


class ScriptedModel:
    """Stands in for a model: the steps a careful support agent takes, in order."""

    def __init__(self, payment_id: str, amount: int, session_id: str) -> None:
        self.payment_id, self.amount, self.session_id = payment_id, amount, session_id
        self.idempotency_key = str(uuid.uuid4())  # one per refund we mean to ask for; reused on retry

    def next_step(self, conversation: Conversation, tools: list[Tool]) -> ToolCall | Reply:
        names = {tool.name for tool in tools}
        lookup = conversation.last("lookup_payment")
        if lookup is None:
            return ToolCall("lookup_payment", {"transaction_id": self.payment_id})
        if lookup["is_error"]:
            return Reply("I could not find that payment. Could you check the transaction id on your receipt?")
        amount = min(self.amount, lookup["result"]["amount_refundable"])
        ask = {"transaction_id": self.payment_id, "amount": amount, "reason": "product_issue",
               "agent": {"session_id": self.session_id, "model": "scripted-example",
                         "reasoning": "The customer reports the item arrived broken."}}
        check = conversation.last("check_refund_eligibility")
        if check is None and "check_refund_eligibility" in names:
            return ToolCall("check_refund_eligibility", ask)
        if check is not None and (check["is_error"] or check["result"].get("would_be") == "denied"):
            return Reply(_refusal(check["result"]))
        created = conversation.last("create_refund")
        if created is None:
            return ToolCall("create_refund", {**ask, "idempotency_key": self.idempotency_key})
        if created["is_error"]:
            return Reply(_refusal(created["result"]))
        refund = created["result"]["refund"]
        # The server's words for the customer (amount, method, arrival), else our own: one of them.
        said = created["result"].get("context", {}).get("suggested_message")
        if not said and refund["status"] == "held":
            said = f"I've asked for a refund of {_money(refund)}; a colleague reviews it first."
        elif not said:
            said = f"Done: {_money(refund)} is on its way back to your card."
        return Reply(f"{said} Your refund's reference is {refund['id']}.")


def _money(refund: dict[str, Any]) -> str:
    return f"{refund['amount'] / 100:.2f} {refund['currency']}"


def _refusal(result: dict[str, Any]) -> str:
    error = result.get("error") or {"code": result.get("verdict", {}).get("code"), "message": result.get("message")}
    return (f"I can't refund this myself ({error.get('code')}): {error.get('message')} "
            "A colleague will follow up with you.")


def _summary(name: str, result: dict[str, Any]) -> str:
    if name == "lookup_payment":
        return f"{result['status']}, refundable {result['amount_refundable']} {result['currency']}"
    if name == "check_refund_eligibility":
        return f"would be {result['would_be']}"
    if name == "create_refund":
        return f"{result['refund']['status']} (verdict {result['verdict']['id']})"
    return "ok"


class ServerRefused(Exception):
    """The server turned the key away (401 or 403): what it said, for one line to the user."""


async def converse(url: str, key: str, model: Model, customer: str) -> dict[str, Any]:
    """The agent loop: the model picks a tool or replies; tools run over MCP with the agent's key."""
    conversation = Conversation()
    conversation.said("customer", customer)
    refusals: list[str] = []

    async def keep_refusal(response: httpx2.Response) -> None:
        # The SDK reports a refused request as "Server returned an error response", inside
        # exception groups: keep the server's own code and message to say instead.
        if response.status_code in (401, 403):
            await response.aread()
            try:
                error = response.json()["error"]
                refusals.append(f"{response.status_code} {error['code']}: {error['message']}")
            except (ValueError, KeyError, TypeError):
                refusals.append(f"{response.status_code} {response.reason_phrase}")

    try:
        async with httpx2.AsyncClient(headers={"Authorization": f"Bearer {key}"}, timeout=30,
                                      event_hooks={"response": [keep_refusal]}) as http:
            async with streamable_http_client(f"{url.rstrip('/')}/mcp", http_client=http) as (read, write):
                async with ClientSession(read, write) as session:
                    await session.initialize()
                    tools = (await session.list_tools()).tools
                    for _ in range(10):
                        step = model.next_step(conversation, tools)
                        if isinstance(step, Reply):
                            conversation.said("agent", step.text)
                            return {"reply": step.text, "turns": conversation.turns}
                        result = await session.call_tool(step.name, step.arguments)
                        conversation.called(step, result.structured_content or {}, result.is_error)
    except Exception:
        if refusals:
            raise ServerRefused(refusals[0]) from None
        raise
    raise RuntimeError("the model did not reply within 10 steps")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=os.environ.get("REFUNDOPS_URL", "http://127.0.0.1:8000"))
    parser.add_argument("--key", default=os.environ.get("REFUNDOPS_AGENT_KEY"), help="an agent key, rk_…")
    parser.add_argument("--payment", required=True, help="the customer's transaction id, txn_…")
    parser.add_argument("--amount", type=int, default=1000, help="minor units to ask back (default 1000)")
    parser.add_argument("--json", action="store_true", help="print the whole conversation as JSON at the end")
    args = parser.parse_args(argv)
    if not args.key:
        parser.error("give --key rk_… (scripts/run prints one) or set REFUNDOPS_AGENT_KEY")
    model = ScriptedModel(args.payment, args.amount, session_id=f"example-{uuid.uuid4().hex[:8]}")
    customer = f"Hi, my order arrived broken. I paid with {args.payment}. Can I get my money back?"
    try:
        outcome = asyncio.run(converse(args.url, args.key, model, customer))
    except ServerRefused as refused:
        print(f"{args.url} refused the agent key ({refused}). Check --key: scripts/run prints one.",
              file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(outcome, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
