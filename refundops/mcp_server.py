"""The MCP face: the contract's eight tools, each calling the same service function as its REST view.

Built on the SDK's low-level ``Server`` rather than ``MCPServer``: ``MCPServer`` validates arguments
with a pydantic model made from the function signature, which drops unknown arguments (a misspelt
``ammount`` would refund the whole payment) and refuses bad types without a contract code. Here the
tool's arguments are handed to the service verbatim as the REST body, so validation, refusal codes
and recorded verdicts are the same as REST; the published JSON schemas guide the agent and are not
stricter than the service (an unknown ``destination`` must reach the policy and be recorded).

Every request is authenticated again (a revoked key fails on its next call), and a key lists only
the tools its agent's capabilities allow. Where the key comes from is the transport's business: a
``KeyResolver`` reads it from the HTTP request (``/mcp``) or holds the one key of a stdio process.
"""

from __future__ import annotations

import functools
import json
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from asgiref.sync import ThreadSensitiveContext, sync_to_async
from django.conf import settings
from django.core.serializers.json import DjangoJSONEncoder
from django.db import connection
from django.http.request import split_domain_port, validate_host
from mcp.server import Server
from mcp.server.context import ServerRequestContext
from mcp.server.transport_security import TransportSecuritySettings
from mcp.shared.exceptions import MCPError
from mcp_types import (
    INTERNAL_ERROR,
    INVALID_PARAMS,
    INVALID_REQUEST,
    CallToolRequestParams,
    CallToolResult,
    ListToolsResult,
    PaginatedRequestParams,
    TextContent,
    Tool,
    ToolAnnotations,
)
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from processors.bodies import depth_exceeds, json_too_deep

from refundops.access import authenticate_key, require_capability
from refundops.answers import Answer, error_answer
from refundops.callers import Caller
from refundops.errors import ApiError
from refundops.api.errors import record_refused_body
from refundops.inputs import MAX_BODY_BYTES, MAX_JSON_DEPTH, ValidationFailed, reject_unknown, text
from refundops.logs import REQUEST_ID_HEADER, bind_request_id
from refundops.models import AgentKey, Capability
from refundops.ratelimit import check_rate_limits
from refundops.services import disputes, payments, refunds

T = TypeVar("T")
log = logging.getLogger(__name__)

# The key for one MCP request, authenticated; raises ApiError UNAUTHENTICATED. Runs in the
# request's Django thread, so it may use the ORM.
KeyResolver = Callable[[ServerRequestContext[Any, Any]], AgentKey]

MCP_PATH = "/mcp"
KEY_STATE = "refundops_agent_key"  # where the HTTP guard leaves the key it authenticated
REQUEST_ID_STATE = "refundops_request_id"  # and the request's id (X-Request-ID, taken or made)
# A JSON-RPC message holds a call's arguments two levels down ({"params": {"arguments": …}}): the
# arguments count their depth from 1, as a REST body does (MAX_JSON_DEPTH).
ENVELOPE_DEPTH = 2
TOO_DEEP = (f"body: JSON nested more than {MAX_JSON_DEPTH} levels deep (a tool's arguments count as level 1, "
            "as a REST body does); send a flatter request.")


# -- running Django code from the SDK's event loop ------------------------------------------------

async def in_django(fn: Callable[[], T]) -> T:
    """Run ORM code for one MCP request in a thread of its own, as Django's ASGI handler does per
    HTTP request (a single shared thread would serialise every agent in the process)."""
    async with ThreadSensitiveContext():
        return await sync_to_async(_closing_connection(fn), thread_sensitive=True)()


def _closing_connection(fn: Callable[[], T]) -> Callable[[], T]:
    @functools.wraps(fn)
    def run() -> T:
        try:
            return fn()
        finally:
            # The request's thread ends with it; its connection must not outlive it. Inside an outer
            # transaction the connection belongs to the sync caller above us (a test), not to us.
            if not connection.in_atomic_block:
                connection.close()
    return run


# -- where the key comes from --------------------------------------------------------------------

def fixed_key(raw: str | None) -> KeyResolver:
    """One key for the whole connection (stdio, in-process tests), authenticated on every request."""
    return lambda ctx: authenticate_key(raw)


def http_key(ctx: ServerRequestContext[Any, Any]) -> AgentKey:
    """The key ``AgentKeyGuard`` authenticated for this very HTTP request."""
    request = ctx.request
    key = request.scope.get("state", {}).get(KEY_STATE) if request is not None else None
    if key is None:
        raise ApiError("UNAUTHENTICATED", "Send your agent key as 'Authorization: Bearer rk_…'.")
    return key


# -- the tools -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ToolSpec:
    tool: Tool
    capability: Capability
    run: Callable[[Caller, dict[str, Any]], Answer]  # sync, in the request's Django thread
    moves_money: bool = True  # a POST in REST: refused, not waved through, while rate limits can't be counted


def _split(arguments: dict[str, Any], *path: str, key_required: bool = True
           ) -> tuple[list[str], str, dict[str, Any]]:
    """(path values, idempotency key, REST body): what REST takes from its URL and header, MCP takes
    as arguments; the rest is the body, passed on untouched so the service validates it."""
    values = [text(arguments, name, required=True, max_length=40) for name in path]
    key = arguments.get("idempotency_key")
    if key is not None and not isinstance(key, str):
        raise ValidationFailed("idempotency_key", "must be a string")
    key = (key or "").strip()
    if not key and not key_required:
        key = uuid.uuid4().hex  # a dry run has no effect to deduplicate
    body = {name: value for name, value in arguments.items() if name not in (*path, "idempotency_key")}
    return values, key, body


def _lookup_payment(caller: Caller, arguments: dict[str, Any]) -> Answer:
    reject_unknown(arguments, ("transaction_id",))
    txn_id = text(arguments, "transaction_id", required=True, max_length=40)
    return Answer(200, payments.lookup_payment(txn_id=txn_id, caller=caller))


def _check_refund_eligibility(caller: Caller, arguments: dict[str, Any]) -> Answer:
    _, key, body = _split(arguments, key_required=False)
    return refunds.check_refund(caller=caller, data=body, idempotency_key=key)


def _create_refund(caller: Caller, arguments: dict[str, Any]) -> Answer:
    _, key, body = _split(arguments)
    return refunds.request_refund(caller=caller, data=body, idempotency_key=key)


def _get_refund(caller: Caller, arguments: dict[str, Any]) -> Answer:
    reject_unknown(arguments, ("refund_id",))
    refund_id = text(arguments, "refund_id", required=True, max_length=40)
    return Answer(200, refunds.refund_detail(refund_id=refund_id, caller=caller))


def _void_authorization(caller: Caller, arguments: dict[str, Any]) -> Answer:
    (txn_id,), key, body = _split(arguments, "transaction_id")
    return payments.void_authorization(caller=caller, txn_id=txn_id, data=body, idempotency_key=key)


def _capture_payment(caller: Caller, arguments: dict[str, Any]) -> Answer:
    (txn_id,), key, body = _split(arguments, "transaction_id")
    return payments.capture_payment(caller=caller, txn_id=txn_id, data=body, idempotency_key=key)


def _send_payment_link(caller: Caller, arguments: dict[str, Any]) -> Answer:
    _, key, body = _split(arguments)
    return payments.send_payment_link(caller=caller, data=body, idempotency_key=key)


def _draft_dispute_evidence(caller: Caller, arguments: dict[str, Any]) -> Answer:
    (dp_id,), key, body = _split(arguments, "dispute_id")
    return disputes.draft_dispute_evidence(caller=caller, dp_id=dp_id, data=body, idempotency_key=key)


def _string(description: str, **schema: Any) -> dict[str, Any]:
    return {"type": "string", "description": description, **schema}


def _object(properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": required}


TRANSACTION_ID = _string("The payment's id, starting with 'txn_'.")
AMOUNT: dict[str, Any] = {"type": "integer", "minimum": 1,
          "description": "Integer minor units of the payment's currency (1999 is 19.99 USD; 500 is 500 JPY). "
                         "Never a string or a fraction."}
IDEMPOTENCY_KEY = _string(
    "A fresh unique value (e.g. a UUID) for each new request; send the SAME value again when you retry "
    "the same request, so it happens once. Reusing it with different arguments is refused with "
    "IDEMPOTENCY_KEY_REUSED.", maxLength=255)
AGENT = {"type": "object", "description": "Your context, kept with the decision for the people who review it.",
         "properties": {"session_id": _string("Your conversation or session id."),
                        "model": _string("The model you run on."),
                        "reasoning": _string("Why you decided this, in a few sentences."),
                        "conversation_context": _string("The relevant part of the conversation.")}}
NOTE = _string("A note for the people who review it.", maxLength=2000)
REFUND_FIELDS: dict[str, Any] = {
    "transaction_id": TRANSACTION_ID,
    "amount": {**AMOUNT, "description": AMOUNT["description"] + " Omit to refund the whole refundable amount."},
    "reason": {"type": "string", "enum": ["customer_request", "duplicate", "fraudulent", "product_issue"],
               "description": "Why the customer gets money back. A listed reason the policy does not allow "
                              "is refused with REASON_NOT_ALLOWED."},
    # Not an enum: a client that checked it would stop a payee change before it is refused and recorded.
    "destination": _string(
        "Omit, or 'original_method' (the only allowed value): refunds go back to the card or account that "
        "paid. Any other destination is a payee change and is refused with DESTINATION_NOT_ALLOWED.",
        examples=["original_method"]),
    "note": NOTE,
    "agent": AGENT,
}
REFUSALS = (
    " Refusals are tool errors whose structured content is {\"error\": {\"code\", \"message\", \"verdict_id\"}}: "
    "VALIDATION_ERROR (fix the named field), PAYMENT_NOT_FOUND, PAYMENT_NOT_REFUNDABLE (not captured, voided or "
    "fully refunded), DESTINATION_NOT_ALLOWED, REASON_NOT_ALLOWED, REFUND_WINDOW_EXPIRED (captured too long "
    "ago), AMOUNT_EXCEEDS_REFUNDABLE (ask for at most the refundable amount), MAX_REFUNDS_REACHED, "
    "DAILY_LIMIT_REACHED (a running total is used up; a person must decide), CIRCUIT_OPEN (refunds are paused; "
    "try later), IDEMPOTENCY_KEY_REQUIRED, IDEMPOTENCY_KEY_REUSED. Do not retry a refusal with other values "
    "to get around a limit; tell the customer a person will follow up.")
# What void and capture answer, as refundops.services.payments records it.
OPERATION_OUTCOMES = (
    " Done: operation.status 'succeeded'. GATEWAY_UNAVAILABLE means the gateway was not reached (or was looked "
    "up and shows nothing was done): nothing changed; try again later with a NEW idempotency_key. "
    "operation.status 'unknown' (not an error) means the gateway may have acted but its answer was lost: call "
    "again later with the SAME idempotency_key and arguments, which looks the payment up at the gateway and "
    "answers succeeded or failed; do not use a new key, and no other void or capture is taken meanwhile.")
COMMON = (" CAPABILITY_NOT_GRANTED: your key may not use this tool. UNAUTHENTICATED: your key is unknown, "
          "expired or revoked.")


def _tool(name: str, title: str, description: str, schema: dict[str, Any], *, read_only: bool,
          destructive: bool = False) -> Tool:
    return Tool(name=name, title=title, description=description + COMMON, input_schema=schema,
                annotations=ToolAnnotations(read_only_hint=read_only, destructive_hint=destructive,
                                            idempotent_hint=True, open_world_hint=not read_only))


TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec(_tool(
        "lookup_payment", "Look up a payment",
        "A payment's status, amounts (authorised, captured, refunded, pending refund, refundable; integer minor "
        "units), currency, method type and last four digits, order reference, dispute state and fraud flag. "
        "Use it before a refund, void, capture or payment link to see what is possible. Refusals: "
        "PAYMENT_NOT_FOUND, VALIDATION_ERROR.",
        _object({"transaction_id": TRANSACTION_ID}, ["transaction_id"]), read_only=True),
        Capability.PAYMENTS_READ, _lookup_payment, moves_money=False),
    ToolSpec(_tool(
        "check_refund_eligibility", "Check a refund (dry run)",
        "The verdict create_refund would give right now (would_be: approved, held for a person, or denied with "
        "the code), with every check and the amounts, and no side effect. Same arguments as create_refund; "
        "idempotency_key is optional here." + REFUSALS,
        _object({**REFUND_FIELDS, "idempotency_key": IDEMPOTENCY_KEY}, ["transaction_id", "reason"]),
        read_only=True),
        Capability.REFUNDS_CREATE, _check_refund_eligibility),
    ToolSpec(_tool(
        "create_refund", "Refund a payment to its original method",
        "Sends money back to the card or account that paid, within finance's limits. Approved: the refund is "
        "on its way (status approved, then submitted and settled; see get_refund). Held: a person must approve "
        "it first (status held, hold_reasons); tell the customer it is being reviewed; this is not an error. "
        "The result's context.suggested_message is a sentence you can tell the customer." + REFUSALS,
        _object({**REFUND_FIELDS, "idempotency_key": IDEMPOTENCY_KEY},
                ["transaction_id", "reason", "idempotency_key"]), read_only=False, destructive=True),
        Capability.REFUNDS_CREATE, _create_refund),
    ToolSpec(_tool(
        "get_refund", "A refund's state",
        "A refund's status (requested, held, approved, submitted, settled, denied, rejected, expired, failed, "
        "canceled), amount, verdict, estimated arrival and a message for the customer. Refusals: "
        "REFUND_NOT_FOUND, VALIDATION_ERROR.",
        _object({"refund_id": _string("The refund's id, starting with 'rf_'.")}, ["refund_id"]), read_only=True),
        Capability.REFUNDS_CREATE, _get_refund, moves_money=False),
    ToolSpec(_tool(
        "void_authorization", "Void an uncaptured authorisation",
        "Releases money authorised but not yet captured, so the customer is never charged. Not a refund: for "
        "captured money use create_refund. Refusals: PAYMENT_NOT_FOUND, PAYMENT_NOT_VOIDABLE (already captured "
        "or voided, or another void or capture is in progress or unknown), VALIDATION_ERROR, IDEMPOTENCY_KEY_REUSED, "
        "GATEWAY_DECLINED, GATEWAY_UNAVAILABLE." + OPERATION_OUTCOMES,
        _object({"transaction_id": TRANSACTION_ID, "note": NOTE, "agent": AGENT,
                 "idempotency_key": IDEMPOTENCY_KEY}, ["transaction_id", "idempotency_key"]),
        read_only=False, destructive=True),
        Capability.AUTHORIZATIONS_VOID, _void_authorization),
    ToolSpec(_tool(
        "capture_payment", "Capture an authorised payment",
        "Captures up to the confirmed order amount of an authorised payment. Refusals: PAYMENT_NOT_FOUND, "
        "PAYMENT_NOT_CAPTURABLE (not authorised, already captured or voided), AMOUNT_EXCEEDS_ORDER (more than "
        "the confirmed order: a person decides), VALIDATION_ERROR, IDEMPOTENCY_KEY_REUSED, GATEWAY_DECLINED, "
        "GATEWAY_UNAVAILABLE." + OPERATION_OUTCOMES,
        _object({"transaction_id": TRANSACTION_ID, "amount": AMOUNT, "note": NOTE, "agent": AGENT,
                 "idempotency_key": IDEMPOTENCY_KEY}, ["transaction_id", "amount", "idempotency_key"]),
        read_only=False),
        Capability.PAYMENTS_CAPTURE, _capture_payment),
    ToolSpec(_tool(
        "send_payment_link", "Send a payment link",
        "Sends the customer a link, worded by an approved template, to pay an amount still owed on an order "
        "or invoice. Name the payment (transaction_id) or the order (order_reference), not both. Refusals: "
        "PAYMENT_NOT_FOUND, ORDER_NOT_FOUND (no such order reference), TEMPLATE_NOT_APPROVED (use a template a person approved), AMOUNT_NOT_OWED (more "
        "than is owed and not yet asked for: a person decides), PAYMENT_LINKS_UNSUPPORTED, VALIDATION_ERROR, "
        "IDEMPOTENCY_KEY_REUSED, GATEWAY_UNAVAILABLE (retry later with the same idempotency_key).",
        _object({"transaction_id": _string("The payment whose order or invoice the amount is owed on ('txn_…')."),
                 "order_reference": _string("Or the order or invoice reference instead of transaction_id."),
                 "template": _string("The id of an approved payment-link template."),
                 "amount": AMOUNT, "agent": AGENT, "idempotency_key": IDEMPOTENCY_KEY},
                ["template", "amount", "idempotency_key"]), read_only=False),
        Capability.PAYMENT_LINKS_SEND, _send_payment_link),
    ToolSpec(_tool(
        "draft_dispute_evidence", "Draft dispute evidence",
        "Saves a draft of the evidence answering a chargeback; fill at least one text field. Only a person "
        "submits it to the bank. Refusals: DISPUTE_NOT_FOUND, DISPUTE_NOT_OPEN (won, lost or already answered), "
        "VALIDATION_ERROR, IDEMPOTENCY_KEY_REUSED.",
        _object({"dispute_id": _string("The dispute's id, starting with 'dp_'."),
                 "summary": _string("Why the charge is valid, in a few sentences."),
                 "customer_communication": _string("What the customer was told and said, with dates."),
                 "refund_policy": _string("The refund policy the customer accepted."),
                 "shipping_documentation": _string("Carrier, tracking number and delivery date."),
                 "agent": AGENT, "idempotency_key": IDEMPOTENCY_KEY},
                ["dispute_id", "idempotency_key"]), read_only=False),
        Capability.DISPUTES_DRAFT, _draft_dispute_evidence),
)
TOOLS_BY_NAME = {spec.tool.name: spec for spec in TOOLS}

INSTRUCTIONS = (
    "RefundOps: look up payments and refund, void, capture, send payment links and draft dispute evidence "
    "for them, each decided against finance's limits and recorded as a verdict. Amounts are integer minor "
    "units. Write tools take an idempotency_key: reuse it when you retry the same request. A refusal is a "
    "tool error with a stable code in structuredContent.error.code; read its message before doing anything "
    "else. You see only the tools your key may use.")


# -- the server ----------------------------------------------------------------------------------

def _result(answer: Answer) -> CallToolResult:
    payload = json.dumps(answer.body, cls=DjangoJSONEncoder)
    return CallToolResult(content=[TextContent(type="text", text=payload)], structured_content=json.loads(payload),
                          is_error=not answer.ok)


def _answer(call: Callable[[], Answer], *, request_id: str, tool: str) -> Answer:
    bind_request_id(request_id)  # this thread's log lines carry it
    try:
        return call()
    except ApiError as error:
        return Answer(error.status, error.body(), error.headers)
    except ValidationFailed as failed:
        return error_answer("VALIDATION_ERROR", failed.message, verdict_id=None, field=failed.field)
    except Exception:  # a bug of ours: logged whole, and the agent is told only what to quote
        log.exception("MCP tool %s failed (request %s)", tool, request_id)
        return internal_error(request_id)


def internal_error(request_id: str) -> Answer:
    return error_answer("INTERNAL_ERROR", f"Something went wrong on our side; nothing was decided about your "
                                          f"request. Try again later, or quote request id {request_id} to "
                                          f"support.", verdict_id=None, request_id=request_id)


def _request_id(ctx: ServerRequestContext[Any, Any]) -> str:
    """The HTTP request's id (AgentKeyGuard's), or a new one for a call over stdio or in process."""
    request = ctx.request
    state = request.scope.get("state", {}) if request is not None else {}
    return state.get(REQUEST_ID_STATE) or uuid.uuid4().hex


def _refuse_too_deep(key: AgentKey, operation: str) -> ApiError:
    """PAYLOAD_TOO_LARGE for arguments nested past the cap, recorded as REST records it."""
    error = ApiError("PAYLOAD_TOO_LARGE", TOO_DEEP, field="body")
    error.verdict_id = record_refused_body(error, key=key, operation=operation, idempotency_key="",
                                           content_length="").id
    return error


def _session_id(arguments: dict[str, Any]) -> str | None:
    agent = arguments.get("agent")
    session = agent.get("session_id") if isinstance(agent, dict) else None
    return session if isinstance(session, str) and session else None


def _allowed_tools(key: AgentKey) -> list[Tool]:
    return [spec.tool for spec in TOOLS if key.agent.has_capability(spec.capability)]


def build_server(resolve_key: KeyResolver) -> Server[Any]:
    """The MCP server, answering for the key ``resolve_key`` finds on each request."""

    async def list_tools(ctx: ServerRequestContext[Any, Any],
                         params: PaginatedRequestParams | None) -> ListToolsResult:
        request_id = _request_id(ctx)

        def allowed() -> list[Tool]:
            try:
                return _allowed_tools(resolve_key(ctx))
            except ApiError as error:
                raise MCPError(INVALID_REQUEST, error.message, data=error.body()) from error
            except Exception as error:  # as a tool's: never internals
                log.exception("MCP tools/list failed (request %s)", request_id)
                body = internal_error(request_id).body
                raise MCPError(INTERNAL_ERROR, body["error"]["message"], data=body) from error
        # Never cached by the client: the list changes when a capability is granted or revoked.
        return ListToolsResult(tools=await in_django(allowed), ttl_ms=0, cache_scope="private")

    async def call_tool(ctx: ServerRequestContext[Any, Any], params: CallToolRequestParams) -> CallToolResult:
        spec = TOOLS_BY_NAME.get(params.name)
        if spec is None:
            raise MCPError(INVALID_PARAMS, f"Unknown tool {params.name!r}; tools/list names the tools you may use.")
        arguments = dict(params.arguments or {})

        def run() -> Answer:
            # The contract's order, as in REST: key, capability, rate limits, then the service.
            key = resolve_key(ctx)
            require_capability(key, spec.capability)
            caller = Caller.for_key(key)
            check_rate_limits(caller=caller, moves_money=spec.moves_money,
                              session_id=_session_id(arguments) if spec.moves_money else None)
            if depth_exceeds(arguments, MAX_JSON_DEPTH):  # over HTTP AgentKeyGuard refused it already
                raise _refuse_too_deep(key, f"MCP {spec.tool.name}")
            return spec.run(caller, arguments)
        request_id = _request_id(ctx)
        return _result(await in_django(lambda: _answer(run, request_id=request_id, tool=spec.tool.name)))

    def input_schema(name: str) -> dict[str, Any] | None:
        spec = TOOLS_BY_NAME.get(name)
        return spec.tool.input_schema if spec else None

    return Server("refundops", title="RefundOps", version="1.0.0", instructions=INSTRUCTIONS,
                  on_list_tools=list_tools, on_call_tool=call_tool, get_tool_input_schema=input_schema)


# -- streamable HTTP at /mcp -----------------------------------------------------------------------

class AgentKeyGuard:
    """Every HTTP request to ``/mcp`` carries a live agent key, or is answered 401 in the contract's
    error shape. The Host header is held to Django's ALLOWED_HOSTS, like the rest of the site."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        request_id = bind_request_id(headers.get("x-request-id"))
        scope.setdefault("state", {})[REQUEST_ID_STATE] = request_id
        send = _with_request_id(send, request_id)
        domain, _ = split_domain_port(headers.get("host", ""))
        # Django's own rule: with DEBUG on and no ALLOWED_HOSTS, localhost is allowed.
        allowed = settings.ALLOWED_HOSTS or ([".localhost", "127.0.0.1", "[::1]"] if settings.DEBUG else [])
        if not domain or not validate_host(domain, allowed):
            error = ApiError("VALIDATION_ERROR", "Invalid Host header.", field="host")
            await JSONResponse(error.body(), status_code=400)(scope, receive, send)
            return
        scheme, _, raw = headers.get("authorization", "").partition(" ")
        try:
            key = await in_django(lambda: authenticate_key(raw.strip() if scheme.lower() == "bearer" else None))
        except ApiError as error:
            response = JSONResponse(error.body(), status_code=error.status,
                                    headers={"WWW-Authenticate": 'Bearer realm="refundops"'})
            await response(scope, receive, send)
            return
        scope.setdefault("state", {})[KEY_STATE] = key
        body = await _read_capped(receive, headers)
        # Nested past the cap: refused here, as REST refuses it, before the SDK's reader (which
        # answers -32700 past its own recursion limit and hands anything shallower on).
        message = (f"body: over {MAX_BODY_BYTES} bytes; send a smaller request." if body is None
                   else TOO_DEEP if json_too_deep(body, MAX_JSON_DEPTH + ENVELOPE_DEPTH) else None)
        if message is not None:
            error = ApiError("PAYLOAD_TOO_LARGE", message, field="body")
            verdict = await in_django(lambda: record_refused_body(
                error, key=key, operation=f"{scope.get('method', 'POST')} {MCP_PATH}", idempotency_key="",
                content_length=headers.get("content-length", "")))
            error.verdict_id = verdict.id
            await JSONResponse(error.body(), status_code=error.status)(scope, receive, send)
            return
        await self.app(scope, _replaying(body, receive), send)


def _with_request_id(send: Send, request_id: str) -> Send:
    """``send`` that labels the answer with its request id, as every Django answer is labelled."""
    async def labelled(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []),
                                              (REQUEST_ID_HEADER.lower().encode(), request_id.encode())]}
        await send(message)
    return labelled


async def _read_capped(receive: Receive, headers: Headers) -> bytes | None:
    """The request body, read whole (MCP messages are small), or None past ``MAX_BODY_BYTES``:
    the SDK would otherwise read any size before parsing it."""
    length = headers.get("content-length", "")
    if length and (not length.isdigit() or int(length) > MAX_BODY_BYTES):
        return None
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if size > MAX_BODY_BYTES:
            return None
        if not message.get("more_body", False):
            break
    return b"".join(chunks)


def _replaying(body: bytes, receive: Receive) -> Receive:
    """``receive`` for the app: the body already read, then whatever the client sends next."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def http_app() -> Starlette:
    """The streamable-HTTP app serving ``/mcp``. Stateless, with plain JSON answers: any web process
    behind any load balancer can answer any request, as the REST API does. Its lifespan runs the
    SDK's session manager and must be run by the ASGI server."""
    app = build_server(http_key).streamable_http_app(
        streamable_http_path=MCP_PATH, stateless_http=True, json_response=True,
        # Host checking is AgentKeyGuard's (ALLOWED_HOSTS); the SDK's default admits only localhost.
        transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False))
    app.add_middleware(AgentKeyGuard)
    return app
