"""What a caller is told: the contract's JSON bodies, shared by REST and MCP."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from datetime import date
from typing import TYPE_CHECKING, Any

from rest_framework.renderers import JSONRenderer

from processors.money import format_minor
from refundops.errors import ERROR_STATUS

if TYPE_CHECKING:
    from refundops.models import Refund


@dataclass(frozen=True)
class Answer:
    status: int
    body: dict[str, Any]
    headers: dict[str, str] = field(default_factory=dict)
    # ``body`` as encoded(body) gives it, when that was already done (the stored first answer): the
    # REST face sends these bytes rather than render the body again.
    encoded: bytes | None = field(default=None, compare=False, repr=False)

    @property
    def ok(self) -> bool:
        return self.status < 400

    @property
    def code(self) -> str:
        return self.body.get("error", {}).get("code", "")

    def with_encoded(self, encoded: bytes) -> Answer:
        return replace(self, encoded=encoded)

    def deduplicated(self) -> Answer:
        if not self.ok:
            error = {**self.body["error"], "deduplicated": True}
            return Answer(self.status, {**self.body, "error": error}, self.headers)
        return Answer(self.status, {**self.body, "deduplicated": True}, self.headers)


def encoded(body: dict[str, Any]) -> bytes:
    """``body`` as the API's JSON renderer (DRF's JSONRenderer, as configured) renders it for a
    plain ``application/json``: compact, UTF-8, strict (no NaN), U+2028 and U+2029 escaped. The
    stored first answer of an idempotency key is this text, and the response sends these bytes."""
    text = json.dumps(body, ensure_ascii=JSONRenderer.ensure_ascii, allow_nan=not JSONRenderer.strict,
                      separators=(",", ":") if JSONRenderer.compact else (", ", ": "))
    return text.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029").encode()


def error_answer(code: str, message: str, *, verdict_id: str | None, **extra: Any) -> Answer:
    return Answer(ERROR_STATUS[code], {"error": {"code": code, "message": message,
                                                 "verdict_id": verdict_id, **extra}})


def suggested_message(*, status: str, amount_minor: int, currency: str, method: str,
                      estimated_arrival: date | None) -> str:
    money = format_minor(amount_minor, currency)
    if status == "held":
        return (f"Your refund request for {money} needs a quick review by our team. We'll let you "
                f"know as soon as it's approved, usually within one business day.")
    arrival = f" It should arrive by {estimated_arrival:%B} {estimated_arrival.day}." if estimated_arrival else ""
    if status in ("approved", "submitted"):
        return f"I've issued a refund of {money} to your {method}; it is on its way.{arrival}"
    if status == "settled":
        return f"Your refund of {money} to your {method} has been processed.{arrival}"
    if status == "failed":
        return (f"The refund of {money} to your {method} could not be completed by the payment "
                f"provider. Our team has been notified and will follow up.")
    if status in ("rejected", "expired", "denied", "canceled"):
        return f"We weren't able to issue a refund of {money} on this payment."
    return f"Your refund of {money} is being processed."


def refund_json(refund: Refund) -> dict[str, Any]:
    """A refund as the API shows it (and merchant webhooks carry it)."""
    return {"id": refund.pk, "status": refund.status, "amount": refund.amount_minor,
            "currency": refund.currency, "transaction_id": refund.payment_id, "reason": refund.reason,
            "estimated_arrival": refund.estimated_arrival.isoformat() if refund.estimated_arrival else None,
            "hold_reasons": refund.hold_reasons, "created_at": refund.created_at.isoformat()}
