"""Validating what callers send, the same for REST and MCP. Strict: a payments API that guesses
(a string "100", a fraction, an unknown field such as a misspelt ``ammount``) refunds the wrong sum."""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from processors import bodies
from refundops.models import Reason

MAX_AMOUNT_MINOR = 10**15  # far above any real payment; keeps every sum inside a 64-bit integer
AGENT_FIELDS = ("session_id", "model", "reasoning", "conversation_context")
STORED_TEXT_LIMIT = 1000  # characters of one text a verdict keeps; a longer one keeps its length and SHA-256
TEXT_LIMITS = {"note": 2000, "session_id": 200, "model": 200, "reasoning": 20000,
               "conversation_context": 50000}


class ValidationFailed(Exception):
    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = f"{field}: {message}"


@dataclass(frozen=True)
class AgentContext:
    session_id: str = ""
    model: str = ""
    reasoning: str = ""
    conversation_context: str = ""


@dataclass(frozen=True)
class RefundInput:
    transaction_id: str
    amount_minor: int | None
    reason: str
    note: str
    destination: str
    agent: AgentContext


MAX_BODY_BYTES = 64 * 1024  # far above any valid request; the text fields' limits add up to ~72,000 characters
MAX_JSON_DEPTH = 32  # a valid request nests three deep


def load_json_body(raw: bytes | str, *, max_bytes: int = MAX_BODY_BYTES) -> Any:
    """An API or MCP body, parsed within ``MAX_BODY_BYTES`` and ``MAX_JSON_DEPTH``.
    Raises BodyTooLarge (PAYLOAD_TOO_LARGE), or ValueError for text that is not JSON."""
    return bodies.load_json_body(raw, max_bytes=max_bytes, max_depth=MAX_JSON_DEPTH)


_SURROGATE = re.compile("[\ud800-\udfff]")
UNSTORABLE_TEXT = "text must not contain NUL (\\u0000) characters or unpaired surrogates (\\ud800-\\udfff)"
UNSTORABLE_NUMBER = "numbers must be finite: NaN and Infinity are not JSON numbers"


def unstorable(data: Any) -> str | None:
    """Why PostgreSQL could not store ``data`` as text or jsonb, or None: a U+0000, an unpaired
    surrogate (JSON's ``\\ud800`` escapes spell one; UTF-8 cannot encode it), or a float that is
    NaN or infinite (MCP's JSON reader, like Python's, accepts ``NaN`` and ``Infinity``). Such a
    request is refused, never stored."""
    stack = [data]
    while stack:
        value = stack.pop()
        if isinstance(value, str):
            if "\x00" in value or (not value.isascii() and _SURROGATE.search(value) is not None):
                return UNSTORABLE_TEXT
        elif isinstance(value, float):
            if not math.isfinite(value):
                return UNSTORABLE_NUMBER
        elif isinstance(value, Mapping):
            stack.extend(value.keys())
            stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)
    return None


IDEMPOTENCY_KEY_MAX = 255  # characters: the column every record of a key keeps it in


def recorded_key(key: str) -> str:
    """The idempotency key as a verdict keeps it: none when it is longer than any key can be
    (that request is refused with IDEMPOTENCY_KEY_REQUIRED, or for its body first)."""
    return key if len(key) <= IDEMPOTENCY_KEY_MAX else ""


def key_problem(key: str) -> str | None:
    """What is wrong with an ``Idempotency-Key`` (REST header, MCP ``idempotency_key``), or None."""
    if not key:
        return ("Send an 'Idempotency-Key' header (at most 255 characters, e.g. a UUID) with every "
                "POST, and reuse it when you retry the same request.")
    if len(key) > IDEMPOTENCY_KEY_MAX:
        return (f"Idempotency-Key: {len(key)} characters is too long; send at most {IDEMPOTENCY_KEY_MAX} "
                "(e.g. a UUID), and reuse it when you retry the same request.")
    return None


# Every id we issue is "<prefix>_<hex>" and at most 40 characters (audit.ids.new_id); anything
# else cannot name a row, and asking PostgreSQL about it costs a query (and a NUL, a 500).
_ID_SHAPE = re.compile(r"[A-Za-z0-9_.:-]{1,40}")


RECORD_DEPTH = 4  # a refund body nests three deep; what lies deeper is only counted
RECORD_ITEMS = 50  # fields or list items kept per level


def for_the_record(data: Any, *, depth: int = 0) -> Any:
    """What a verdict keeps of a request: its shape and values, with each text over
    ``STORED_TEXT_LIMIT`` characters cut to that many and marked with its length and SHA-256, at
    most ``RECORD_ITEMS`` entries per level and ``RECORD_DEPTH`` levels. Bounded whatever was sent."""
    if isinstance(data, str):
        if len(data) <= STORED_TEXT_LIMIT:
            return data
        return {"truncated": data[:STORED_TEXT_LIMIT], "length": len(data),
                "sha256": hashlib.sha256(data.encode("utf-8", "surrogatepass")).hexdigest()}
    if isinstance(data, (Mapping, list)) and depth >= RECORD_DEPTH:
        return {"omitted": f"nested deeper than {RECORD_DEPTH} levels"}
    if isinstance(data, Mapping):
        items = list(data.items())
        kept = {str(k)[:100]: for_the_record(v, depth=depth + 1) for k, v in items[:RECORD_ITEMS]}
        if len(items) > RECORD_ITEMS:
            kept["…"] = f"{len(items) - RECORD_ITEMS} more fields"
        return kept
    if isinstance(data, list):
        kept = [for_the_record(v, depth=depth + 1) for v in data[:RECORD_ITEMS]]
        return kept + ([f"{len(data) - RECORD_ITEMS} more items"] if len(data) > RECORD_ITEMS else [])
    return data


def could_be_id(value: str) -> bool:
    """Whether ``value`` could be one of our ids: callers answer ``*_NOT_FOUND`` without a query if not."""
    return _ID_SHAPE.fullmatch(value) is not None


def require_object(data: Any) -> Mapping[str, Any]:
    if not isinstance(data, Mapping):
        raise ValidationFailed("body", "must be a JSON object")
    return data


def reject_unknown(data: Mapping[str, Any], allowed: tuple[str, ...]) -> None:
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise ValidationFailed(unknown[0], f"unknown field; allowed fields are {', '.join(allowed)}")


def text(data: Mapping[str, Any], name: str, *, required: bool = False, field: str | None = None,
         max_length: int | None = None) -> str:
    field = field or name
    value = data.get(name)
    if value is None:
        if required:
            raise ValidationFailed(field, "is required")
        return ""
    if not isinstance(value, str):
        raise ValidationFailed(field, "must be a string")
    value = value.strip() if required else value
    if required and not value:
        raise ValidationFailed(field, "must not be empty")
    limit = max_length or TEXT_LIMITS.get(name, 200)
    if len(value) > limit:
        raise ValidationFailed(field, f"must be at most {limit} characters")
    return value


def amount(data: Mapping[str, Any], name: str = "amount", *, required: bool = False) -> int | None:
    value = data.get(name)
    if value is None:
        if required:
            raise ValidationFailed(name, "is required: an integer number of minor units (1999 for 19.99 USD)")
        return None
    # bool is an int subclass in Python; a JSON true is not one cent.
    if type(value) is not int:
        raise ValidationFailed(name, "must be a JSON integer number of minor units (1999 for 19.99 USD), "
                                     "not a string or a fraction")
    if value <= 0:
        raise ValidationFailed(name, "must be greater than zero")
    if value > MAX_AMOUNT_MINOR:
        raise ValidationFailed(name, f"must be at most {MAX_AMOUNT_MINOR}")
    return value


def agent_context(data: Mapping[str, Any]) -> AgentContext:
    raw = data.get("agent")
    if raw is None:
        return AgentContext()
    if not isinstance(raw, Mapping):
        raise ValidationFailed("agent", f"must be an object with {', '.join(AGENT_FIELDS)}")
    unknown = sorted(set(raw) - set(AGENT_FIELDS))
    if unknown:
        raise ValidationFailed(f"agent.{unknown[0]}", f"unknown field; allowed: {', '.join(AGENT_FIELDS)}")
    return AgentContext(**{f: text(raw, f, field=f"agent.{f}") for f in AGENT_FIELDS})


REFUND_FIELDS = ("transaction_id", "amount", "reason", "note", "destination", "agent")


def parse_refund(data: Any) -> RefundInput:
    data = require_object(data)
    reject_unknown(data, REFUND_FIELDS)
    transaction_id = text(data, "transaction_id", required=True, max_length=40)
    amount_minor = amount(data)
    reason = data.get("reason")
    if reason is None:
        raise ValidationFailed("reason", f"is required: one of {', '.join(Reason.values)}")
    if reason not in Reason.values:
        raise ValidationFailed("reason", f"must be one of {', '.join(Reason.values)}")
    note = text(data, "note")
    destination = data.get("destination")
    # Any destination but the original method is a payee change: the policy refuses it with
    # DESTINATION_NOT_ALLOWED (recorded), rather than a validation error.
    destination_label = "original_method" if destination is None else (
        destination if isinstance(destination, str) else "other")
    return RefundInput(transaction_id=transaction_id, amount_minor=amount_minor, reason=reason,
                       note=note, destination=destination_label, agent=agent_context(data))
