"""The MCP tools in process (``mcp.Client(server)``), as an agent holding one key sees them."""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
from asgiref.sync import async_to_sync, sync_to_async
from django.utils import timezone
from mcp import Client
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolResult

from audit.models import Verdict
from refundops.mcp_server import TOOLS, build_server, fixed_key
from refundops.models import (
    Agent,
    AgentKey,
    Capability,
    Dispute,
    DisputeEvidenceDraft,
    IdempotencyRecord,
    Payment,
    PaymentLink,
    PaymentLinkTemplate,
    PlatformState,
    Refund,
    RefundState,
)
from tests.conftest import make_agent_key, make_limits, make_payment, post

pytestmark = pytest.mark.django_db

T = TypeVar("T")
REFUND_TOOLS = ["lookup_payment", "check_refund_eligibility", "create_refund", "get_refund"]


def with_client(raw_key: str, scenario: Callable[[Client], Awaitable[T]]) -> T:
    """Run ``scenario`` against a server bound to ``raw_key``. async_to_sync keeps the ORM calls of
    the tools on this thread, inside the test's transaction."""
    async def run() -> T:
        async with Client(build_server(fixed_key(raw_key))) as client:
            return await scenario(client)
    return async_to_sync(run)()


def call(raw_key: str, tool: str, arguments: dict[str, Any]) -> CallToolResult:
    return with_client(raw_key, lambda client: client.call_tool(tool, arguments))


def listed(raw_key: str) -> list[str]:
    async def names(client: Client) -> list[str]:
        return [tool.name for tool in (await client.list_tools()).tools]
    return with_client(raw_key, names)


def refund_args(payment, **fields: Any) -> dict[str, Any]:
    return {"transaction_id": payment.pk, "amount": 1_000, "reason": "customer_request",
            "idempotency_key": uuid.uuid4().hex, **fields}


def error_of(result: CallToolResult) -> dict[str, Any]:
    assert result.is_error, result.structured_content
    assert json.loads(result.content[0].text) == result.structured_content  # text and structure agree
    return result.structured_content["error"]


@pytest.fixture
def refunder(db):
    return make_agent_key(Capability.PAYMENTS_READ, Capability.REFUNDS_CREATE)[1]


# -- what a key sees --------------------------------------------------------------------------------

def test_a_key_lists_exactly_the_tools_its_capabilities_allow():
    assert listed(make_agent_key(Capability.PAYMENTS_READ, Capability.REFUNDS_CREATE)[1]) == REFUND_TOOLS
    assert listed(make_agent_key(Capability.AUTHORIZATIONS_VOID)[1]) == ["void_authorization"]
    assert listed(make_agent_key()[1]) == [
        "lookup_payment", "check_refund_eligibility", "create_refund", "get_refund", "void_authorization",
        "capture_payment", "send_payment_link", "draft_dispute_evidence"]


def test_every_capability_lists_its_tools_and_no_other():
    for capability in Capability.values:
        expected = [spec.tool.name for spec in TOOLS if spec.capability == capability]
        assert listed(make_agent_key(capability)[1]) == expected, capability


def test_refund_schema_has_the_reason_enum_integer_amounts_and_a_required_idempotency_key(refunder):
    tools = with_client(refunder, lambda client: client.list_tools()).tools
    create = next(tool for tool in tools if tool.name == "create_refund")
    schema = create.input_schema
    assert schema["properties"]["reason"]["enum"] == ["customer_request", "duplicate", "fraudulent", "product_issue"]
    assert schema["properties"]["amount"]["type"] == "integer"
    assert "original_method" in schema["properties"]["destination"]["description"]
    assert set(schema["properties"]["agent"]["properties"]) == {"session_id", "model", "reasoning",
                                                                "conversation_context"}
    assert set(schema["required"]) == {"transaction_id", "reason", "idempotency_key"}
    assert "AMOUNT_EXCEEDS_REFUNDABLE" in create.description and create.annotations.destructive_hint


def test_a_capability_the_agent_lacks_is_refused_and_changes_nothing(policy):
    raw = make_agent_key(Capability.PAYMENTS_READ)[1]
    error = error_of(call(raw, "create_refund", refund_args(make_payment())))
    assert error["code"] == "CAPABILITY_NOT_GRANTED" and error["capability"] == "refunds.create"
    assert not Refund.objects.exists()


def test_a_revoked_key_is_refused_on_its_very_next_call_in_the_same_session(policy):
    key, raw = make_agent_key()
    payment = make_payment()

    async def scenario(client: Client) -> tuple[CallToolResult, CallToolResult, MCPError]:
        before = await client.call_tool("lookup_payment", {"transaction_id": payment.pk})
        await sync_to_async(AgentKey.objects.filter(pk=key.pk).update)(revoked_at=timezone.now())
        after = await client.call_tool("create_refund", refund_args(payment))
        with pytest.raises(MCPError) as listing:
            await client.list_tools()
        return before, after, listing.value

    before, after, listing = with_client(raw, scenario)
    assert not before.is_error
    assert error_of(after)["code"] == "UNAUTHENTICATED"
    assert listing.data["error"]["code"] == "UNAUTHENTICATED"
    assert not Refund.objects.exists()


def test_a_revoked_capability_leaves_the_list_and_is_refused_on_the_next_call(policy):
    key, raw = make_agent_key(Capability.PAYMENTS_READ, Capability.REFUNDS_CREATE)
    payment = make_payment()

    async def scenario(client: Client) -> tuple[list[str], CallToolResult]:
        await client.list_tools()
        await sync_to_async(Agent.objects.filter(pk=key.agent_id).update)(capabilities=[Capability.PAYMENTS_READ])
        names = [tool.name for tool in (await client.list_tools()).tools]
        return names, await client.call_tool("create_refund", refund_args(payment))

    names, refused = with_client(raw, scenario)
    assert names == ["lookup_payment"]
    assert error_of(refused)["code"] == "CAPABILITY_NOT_GRANTED"


def test_switching_every_agent_off_refuses_mcp_calls(policy):
    raw = make_agent_key()[1]
    PlatformState.objects.update_or_create(pk=1, defaults={"agents_disabled": True})
    assert error_of(call(raw, "lookup_payment", {"transaction_id": "txn_x"}))["code"] == "UNAUTHENTICATED"


def test_an_unknown_key_is_unauthenticated():
    error = error_of(call("rk_not-a-real-key", "lookup_payment", {"transaction_id": "txn_x"}))
    assert error["code"] == "UNAUTHENTICATED" and error["verdict_id"] is None


# -- refunds --------------------------------------------------------------------------------------

def test_create_refund_writes_the_refund_and_its_verdict_and_answers_the_rest_body(refunder, policy):
    payment = make_payment(amount=5_000)
    agent = {"session_id": "s-1", "model": "m", "reasoning": "late delivery", "conversation_context": "…"}
    result = call(refunder, "create_refund", refund_args(payment, amount=1_999, agent=agent))
    assert not result.is_error
    body = result.structured_content
    assert json.loads(result.content[0].text) == body
    assert body["refund"]["status"] == "approved" and body["refund"]["amount"] == 1_999
    assert body["verdict"]["outcome"] == "approved" and body["deduplicated"] is False
    assert body["context"]["transaction_remaining_amount"] == 3_001
    refund = Refund.objects.get(pk=body["refund"]["id"])
    assert refund.verdict_id == body["verdict"]["id"] and refund.agent_session_id == "s-1"
    assert refund.agent_reasoning == "late delivery" and refund.origin == Refund.Origin.AGENT
    verdict = Verdict.objects.get(pk=body["verdict"]["id"])
    assert verdict.refund_id == refund.pk and verdict.operation == "refund.create"
    assert verdict.key_prefix == refund.agent_key.prefix


def test_omitting_the_amount_refunds_everything_refundable(refunder, policy):
    payment = make_payment(amount=4_200)
    arguments = refund_args(payment)
    del arguments["amount"]
    assert call(refunder, "create_refund", arguments).structured_content["refund"]["amount"] == 4_200


def test_a_refund_above_the_approval_threshold_is_held_and_is_not_an_error(refunder, policy):
    payment = make_payment(amount=100_000)
    result = call(refunder, "create_refund", refund_args(payment, amount=60_000))
    assert not result.is_error
    assert result.structured_content["status"] == "held"
    assert "APPROVAL_REQUIRED" in result.structured_content["hold_reasons"]
    assert Refund.objects.get().status == RefundState.HELD


def test_the_same_idempotency_key_replays_and_another_body_with_it_is_refused(refunder, policy):
    payment = make_payment()
    arguments = refund_args(payment, idempotency_key="retry-1")
    first = call(refunder, "create_refund", arguments)
    again = call(refunder, "create_refund", arguments)
    assert again.structured_content["deduplicated"] is True
    assert again.structured_content["refund"]["id"] == first.structured_content["refund"]["id"]
    assert error_of(call(refunder, "create_refund", {**arguments, "amount": 1_001}))["code"] == "IDEMPOTENCY_KEY_REUSED"
    assert Refund.objects.count() == 1


def test_rest_and_mcp_are_one_api_a_retry_over_mcp_replays_the_rest_answer(api, agent_key, policy):
    payment = make_payment()
    body = {"transaction_id": payment.pk, "amount": 1_000, "reason": "customer_request"}
    first = post(api, "/api/v1/refunds", body, key="same-key").json()
    retried = call(agent_key[1], "create_refund", {**body, "idempotency_key": "same-key"}).structured_content
    assert retried["deduplicated"] is True and retried["refund"]["id"] == first["refund"]["id"]
    over = {**body, "amount": 10_001}
    rest_error = post(api, "/api/v1/refunds", over).json()["error"]
    mcp_error = error_of(call(agent_key[1], "create_refund", {**over, "idempotency_key": "other"}))
    assert (mcp_error["code"], mcp_error["message"]) == (rest_error["code"], rest_error["message"])
    assert Refund.objects.exclude(status=RefundState.DENIED).count() == 1


def test_create_refund_without_an_idempotency_key_is_refused(refunder, policy):
    arguments = refund_args(make_payment())
    del arguments["idempotency_key"]
    assert error_of(call(refunder, "create_refund", arguments))["code"] == "IDEMPOTENCY_KEY_REQUIRED"
    assert not Refund.objects.exists()


@pytest.mark.parametrize("field,value", [
    ("amount", "100"), ("amount", 10.5), ("amount", 0), ("amount", True), ("reason", "because"),
    ("transaction_id", None), ("transaction_id", 12), ("ammount", 100), ("agent", "x"),
    ("idempotency_key", 7),
])
def test_bad_arguments_are_validation_errors_naming_the_field(refunder, policy, field, value):
    arguments = refund_args(make_payment(), **{field: value})
    if value is None:
        del arguments[field]
    error = error_of(call(refunder, "create_refund", arguments))
    assert error["code"] == "VALIDATION_ERROR" and error["field"] == field and field in error["message"]
    assert not Refund.objects.exists() and not IdempotencyRecord.objects.exists()


def _after_one_refund_under(**limits: int) -> Callable[[str], dict[str, Any]]:
    """A second refund of the same payment, once ``limits`` allow only one."""
    def setup(raw: str) -> dict[str, Any]:
        make_limits(**limits)
        payment = make_payment()
        assert not call(raw, "create_refund", refund_args(payment, amount=100)).is_error
        return refund_args(payment, amount=100)
    return setup


def _reason_the_policy_does_not_allow(raw: str) -> dict[str, Any]:
    make_limits(allowed_reasons=["duplicate"])
    return refund_args(make_payment(), reason="customer_request")


def _with_the_kill_switch_on(raw: str) -> dict[str, Any]:
    PlatformState.objects.update_or_create(pk=1, defaults={"refunds_paused": True})
    return refund_args(make_payment())


@pytest.mark.parametrize("code,setup", [
    ("PAYMENT_NOT_FOUND", lambda raw: {**refund_args(make_payment()), "transaction_id": "txn_does_not_exist"}),
    ("PAYMENT_NOT_REFUNDABLE", lambda raw: refund_args(make_payment(captured=False))),
    ("DESTINATION_NOT_ALLOWED", lambda raw: refund_args(make_payment(), destination="card_other_4444")),
    ("REASON_NOT_ALLOWED", _reason_the_policy_does_not_allow),
    ("REFUND_WINDOW_EXPIRED", lambda raw: refund_args(make_payment(captured_days_ago=200))),
    ("AMOUNT_EXCEEDS_REFUNDABLE", lambda raw: refund_args(make_payment(amount=500), amount=501)),
    ("MAX_REFUNDS_REACHED", _after_one_refund_under(max_refunds_per_payment=1)),
    ("DAILY_LIMIT_REACHED", _after_one_refund_under(customer_daily_count=1)),
    ("CIRCUIT_OPEN", _with_the_kill_switch_on),
])
def test_policy_refusals_are_tool_errors_with_the_contract_code_and_a_recorded_verdict(refunder, policy, code, setup):
    error = error_of(call(refunder, "create_refund", setup(refunder)))
    assert error["code"] == code, error
    verdict = Verdict.objects.get(pk=error["verdict_id"])
    assert verdict.code == code and verdict.outcome == Verdict.Outcome.DENIED


def test_check_refund_eligibility_answers_the_verdict_without_side_effects(refunder, policy):
    payment = make_payment(amount=5_000)
    arguments = refund_args(payment, amount=6_000)
    del arguments["idempotency_key"]  # optional for a dry run
    result = call(refunder, "check_refund_eligibility", arguments)
    assert not result.is_error
    assert result.structured_content["would_be"] == "denied"
    assert result.structured_content["verdict"]["code"] == "AMOUNT_EXCEEDS_REFUNDABLE"
    assert not Refund.objects.exists() and not IdempotencyRecord.objects.exists()


def test_get_refund_and_lookup_payment_read_what_rest_reads(refunder, policy):
    payment = make_payment(amount=5_000)
    created = call(refunder, "create_refund", refund_args(payment, amount=700)).structured_content
    refund = call(refunder, "get_refund", {"refund_id": created["refund"]["id"]}).structured_content
    assert refund["refund"]["status"] == "approved" and refund["verdict"]["id"] == created["verdict"]["id"]
    looked_up = call(refunder, "lookup_payment", {"transaction_id": payment.pk}).structured_content
    assert looked_up["amount_refundable"] == 4_300 and looked_up["method"]["last4"] == "4242"
    assert error_of(call(refunder, "get_refund", {"refund_id": "rf_nope"}))["code"] == "REFUND_NOT_FOUND"
    assert error_of(call(refunder, "lookup_payment", {"transaction_id": "txn_nope"}))["code"] == "PAYMENT_NOT_FOUND"
    assert error_of(call(refunder, "lookup_payment", {}))["code"] == "VALIDATION_ERROR"


def test_rate_limits_apply_to_mcp_calls_as_to_rest(refunder, policy, settings):
    settings.RATE_LIMIT_AGENT_PER_MINUTE = 1
    payment = make_payment()
    assert not call(refunder, "lookup_payment", {"transaction_id": payment.pk}).is_error
    error = error_of(call(refunder, "create_refund", refund_args(payment)))
    assert error["code"] == "RATE_LIMITED" and error["retry_after"] >= 1
    assert not Refund.objects.exists()


def test_an_unknown_tool_is_a_protocol_error(refunder):
    async def scenario(client: Client) -> MCPError:
        with pytest.raises(MCPError) as raised:
            await client.call_tool("refund_to_any_card", {})
        return raised.value
    assert "Unknown tool" in with_client(refunder, scenario).message


# -- voids, captures, payment links, dispute evidence ---------------------------------------------

def op_args(**fields: Any) -> dict[str, Any]:
    return {"idempotency_key": uuid.uuid4().hex, **fields}


def test_void_authorization_voids_an_uncaptured_authorisation_and_refuses_a_captured_payment():
    raw = make_agent_key(Capability.AUTHORIZATIONS_VOID)[1]
    authorised = make_payment(captured=False)
    voided = call(raw, "void_authorization", op_args(transaction_id=authorised.pk, note="order cancelled"))
    assert not voided.is_error, voided.structured_content
    assert voided.structured_content["operation"]["kind"] == "void"
    authorised.refresh_from_db()
    assert authorised.status == Payment.Status.VOIDED
    error = error_of(call(raw, "void_authorization", op_args(transaction_id=make_payment().pk)))
    assert error["code"] == "PAYMENT_NOT_VOIDABLE" and Verdict.objects.filter(pk=error["verdict_id"]).exists()
    assert error_of(call(raw, "void_authorization", op_args(transaction_id="txn_nope")))["code"] == "PAYMENT_NOT_FOUND"
    assert error_of(call(raw, "void_authorization", op_args()))["code"] == "VALIDATION_ERROR"


def test_capture_payment_captures_up_to_the_order_amount_and_no_more():
    raw = make_agent_key(Capability.PAYMENTS_CAPTURE)[1]
    payment = make_payment(amount=5_000, captured=False, order_amount_minor=4_000)
    error = error_of(call(raw, "capture_payment", op_args(transaction_id=payment.pk, amount=4_001)))
    assert error["code"] == "AMOUNT_EXCEEDS_ORDER"
    assert error_of(call(raw, "capture_payment", op_args(transaction_id=payment.pk, amount="4000")))["code"] == \
        "VALIDATION_ERROR"
    captured = call(raw, "capture_payment", op_args(transaction_id=payment.pk, amount=4_000))
    assert not captured.is_error, captured.structured_content
    payment.refresh_from_db()
    assert payment.amount_captured_minor == 4_000
    again = call(raw, "capture_payment", op_args(transaction_id=payment.pk, amount=1_000))
    assert error_of(again)["code"] == "PAYMENT_NOT_CAPTURABLE"


def test_send_payment_link_sends_only_an_owed_amount_from_an_approved_template():
    raw = make_agent_key(Capability.PAYMENT_LINKS_SEND)[1]
    payment = make_payment(order_reference="ORD-7", amount_owed_minor=2_000)
    approved = PaymentLinkTemplate.objects.create(name="balance", message="Pay $amount: $url",
                                                  approved_at=timezone.now())
    unapproved = PaymentLinkTemplate.objects.create(name="draft", message="Pay $amount: $url")
    link = {"transaction_id": payment.pk, "amount": 2_000, "template": str(approved.pk)}
    error = error_of(call(raw, "send_payment_link", op_args(**{**link, "template": str(unapproved.pk)})))
    assert error["code"] == "TEMPLATE_NOT_APPROVED"
    error = error_of(call(raw, "send_payment_link", op_args(**{**link, "amount": 2_001})))
    assert error["code"] == "AMOUNT_NOT_OWED"
    sent = call(raw, "send_payment_link", op_args(**link))
    assert not sent.is_error, sent.structured_content
    assert PaymentLink.objects.get().amount_minor == 2_000


def test_draft_dispute_evidence_saves_a_draft_for_a_person_and_refuses_closed_disputes():
    raw = make_agent_key(Capability.DISPUTES_DRAFT)[1]
    payment = make_payment()
    dispute = Dispute.objects.create(payment=payment, amount_minor=10_000, currency="USD")
    drafted = call(raw, "draft_dispute_evidence", op_args(dispute_id=dispute.pk, summary="Delivered on time.",
                                                          shipping_documentation="UPS 1Z999, signed"))
    assert not drafted.is_error, drafted.structured_content
    draft = DisputeEvidenceDraft.objects.get()
    assert draft.summary == "Delivered on time." and draft.status == DisputeEvidenceDraft.Status.DRAFT
    assert error_of(call(raw, "draft_dispute_evidence", op_args(dispute_id=dispute.pk)))["code"] == "VALIDATION_ERROR"
    missing = call(raw, "draft_dispute_evidence", op_args(dispute_id="dp_nope", summary="x"))
    assert error_of(missing)["code"] == "DISPUTE_NOT_FOUND"
    closed = Dispute.objects.create(payment=payment, amount_minor=10_000, currency="USD", status=Dispute.Status.WON)
    refused = call(raw, "draft_dispute_evidence", op_args(dispute_id=closed.pk, summary="x"))
    assert error_of(refused)["code"] == "DISPUTE_NOT_OPEN"
