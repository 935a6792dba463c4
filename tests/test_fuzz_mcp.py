"""The MCP tools fuzzed where agents stand: generated ``tools/call`` requests to ``/mcp`` as served
(uvicorn, refundops.asgi), each tool's arguments drawn from the input schema it publishes, with real
ids about half the time, and hostile variants in any place: NaN and Infinity (JSON text says them
as Python writes them), integers past 64 bits, JSON nested past the cap, texts past every limit,
NUL, lone surrogates, wrong types, unknown fields. None may answer 5xx, a JSON-RPC internal error or
the contract's INTERNAL_ERROR (a bug of ours); every refusal carries a code of the contract.

Bounded for CI (FUZZ_MCP_EXAMPLES per tool, default 15); ``scripts/fuzz N`` runs longer."""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

import httpx2
import pytest
from hypothesis import HealthCheck, given, settings as hypothesis_settings, strategies as st

from refundops.errors import ERROR_STATUS
from refundops.mcp_server import TOOLS
from tests.test_fuzz_http import seeds  # noqa: F401  (real rows for generated calls to find)

pytestmark = pytest.mark.django_db(transaction=True)  # the server sees committed rows only

EXAMPLES = int(os.environ.get("FUZZ_MCP_EXAMPLES", os.environ.get("FUZZ_EXAMPLES", "15")))
REFUSAL_CODES = set(ERROR_STATUS) - {"INTERNAL_ERROR"}
SEEDED = {"transaction_id": "txn_id", "refund_id": "rf_id", "dispute_id": "dp_id", "template": "template",
          "order_reference": "order_reference"}

hostile_values = st.one_of(
    st.sampled_from([float("nan"), float("inf"), float("-inf"), 1e308, -0.0, 10**30, -(10**30), 2**63, True, None,
                     [], {}, "", " ", "\x00", "a\x00b", "\ud800", "x\udfffy", "\u2028", "𝔘𝔫𝔦", "%00", "' OR 1=1 --"]),
    st.integers(min_value=50, max_value=3_000).map(lambda depth: json.loads("[" * depth + "]" * depth)
                                                    if depth < 900 else {"deep": "[" * depth}),
    st.sampled_from([300, 2_100, 20_001, 70_000]).map(lambda n: "x" * n),
    st.text(max_size=50),
)


def from_published(schema: dict[str, Any], seeds: dict[str, list], name: str = "") -> st.SearchStrategy:
    """Values the published JSON schema describes (the subset the tools use), real ids where there
    are some, and now and then a hostile value in its place."""
    kind = schema.get("type")
    if kind == "object":
        properties = schema.get("properties", {})
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries(
            {key: from_published(sub, seeds, key) for key, sub in properties.items() if key in required},
            optional={**{key: from_published(sub, seeds, key) for key, sub in properties.items()
                         if key not in required},
                      "unknown_field": hostile_values})
    if "enum" in schema:
        plain = st.sampled_from(schema["enum"])
    elif kind == "integer":
        plain = st.integers(min_value=schema.get("minimum"), max_value=10**7)
    elif name in SEEDED and seeds.get(SEEDED[name]):
        plain = st.one_of(st.sampled_from(seeds[SEEDED[name]]), st.text(max_size=45))
    elif name == "idempotency_key":
        plain = st.uuids().map(str)
    else:
        plain = st.text(max_size=schema.get("maxLength", 60))
    return st.one_of(plain, plain, plain, hostile_values)


def call(served: str, raw_key: str, tool: str, arguments: Any) -> httpx2.Response:
    # Python's json writes NaN and Infinity as NaN and Infinity, and a lone surrogate as its \u escape.
    body = json.dumps({"jsonrpc": "2.0", "id": 1, "method": "tools/call",
                       "params": {"name": tool, "arguments": arguments}}, allow_nan=True)
    return httpx2.post(f"{served}/mcp", content=body, timeout=60,
                       headers={"Authorization": f"Bearer {raw_key}", "Content-Type": "application/json",
                                "Accept": "application/json, text/event-stream"})


def assert_a_client_answer(response: httpx2.Response) -> None:
    assert response.status_code < 500, (response.status_code, response.text[:500])
    answer = response.json()
    if "jsonrpc" in answer and "error" in answer:  # JSON-RPC's own refusal (parse, params), never an internal one
        assert answer["error"]["code"] in (-32700, -32600, -32602), answer
        return
    if response.status_code != 200:  # refused before the SDK (413 past the caps): the contract's shape
        assert answer["error"]["code"] in REFUSAL_CODES, answer
        return
    result = answer["result"]
    if result.get("isError"):
        assert result["structuredContent"]["error"]["code"] in REFUSAL_CODES, result


@pytest.mark.parametrize("tool", [spec.tool for spec in TOOLS], ids=[spec.tool.name for spec in TOOLS])
def test_every_tool_answers_generated_and_hostile_arguments_without_a_server_error(served, seeds, tool):  # noqa: F811
    tried = 0
    arguments = st.one_of(from_published(tool.input_schema, seeds), hostile_values)

    @given(arguments=arguments)
    @hypothesis_settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
                         database=None)
    def run(arguments: Any) -> None:
        nonlocal tried
        tried += 1
        if isinstance(arguments, dict) and "idempotency_key" in tool.input_schema["properties"]:
            arguments.setdefault("idempotency_key", uuid.uuid4().hex)
        assert_a_client_answer(call(served, seeds["raw"], tool.name, arguments))

    run()
    assert tried >= EXAMPLES // 2, f"{tool.name}: only {tried} calls tried of {EXAMPLES}"
