"""The contract's error codes, their HTTP statuses, and the one application error type."""

from __future__ import annotations

from typing import Any

# The contract's own table of codes (docs/CONTRACT.md): agents rely on each of these.
CONTRACT_CODES = frozenset({
    "VALIDATION_ERROR", "IDEMPOTENCY_KEY_REQUIRED", "UNAUTHENTICATED", "CAPABILITY_NOT_GRANTED",
    "PAYMENT_NOT_FOUND", "IDEMPOTENCY_KEY_REUSED", "REFUND_WINDOW_EXPIRED", "MAX_REFUNDS_REACHED",
    "AMOUNT_EXCEEDS_REFUNDABLE", "DAILY_LIMIT_REACHED", "REASON_NOT_ALLOWED", "DESTINATION_NOT_ALLOWED",
    "PAYMENT_NOT_REFUNDABLE", "RATE_LIMITED", "CIRCUIT_OPEN", "PAYLOAD_TOO_LARGE",
})

ERROR_STATUS: dict[str, int] = {
    "VALIDATION_ERROR": 400,
    "IDEMPOTENCY_KEY_REQUIRED": 400,
    "UNAUTHENTICATED": 401,
    "CAPABILITY_NOT_GRANTED": 403,
    "PAYMENT_NOT_FOUND": 404,
    "REFUND_NOT_FOUND": 404,
    "DISPUTE_NOT_FOUND": 404,
    "ORDER_NOT_FOUND": 404,
    "PAYLOAD_TOO_LARGE": 413,
    "IDEMPOTENCY_KEY_REUSED": 409,
    "REFUND_NOT_HELD": 409,
    "REFUND_NOT_FAILED": 409,
    "APPROVAL_NOT_AUTHORIZED": 403,
    "REFUND_WINDOW_EXPIRED": 422,
    "MAX_REFUNDS_REACHED": 422,
    "AMOUNT_EXCEEDS_REFUNDABLE": 422,
    "DAILY_LIMIT_REACHED": 422,
    "REASON_NOT_ALLOWED": 422,
    "DESTINATION_NOT_ALLOWED": 422,
    "PAYMENT_NOT_REFUNDABLE": 422,
    "PAYMENT_NOT_VOIDABLE": 422,
    "PAYMENT_NOT_CAPTURABLE": 422,
    "AMOUNT_EXCEEDS_ORDER": 422,
    "AMOUNT_NOT_OWED": 422,
    "TEMPLATE_NOT_APPROVED": 422,
    "RATE_LIMITED": 429,
    "CIRCUIT_OPEN": 503,
    "SERVICE_UNAVAILABLE": 503,
    "GATEWAY_UNAVAILABLE": 503,
    "GATEWAY_DECLINED": 502,
    "DISPUTE_NOT_OPEN": 422,
    "PAYMENT_LINKS_UNSUPPORTED": 422,
    "DISCREPANCY_NOT_FOUND": 404,
    "DISCREPANCY_NOT_OPEN": 409,
    "RESOLUTION_NOT_AUTHORIZED": 403,
    "INTERNAL_ERROR": 500,  # a bug of ours: the answer names the request id to quote, never internals
}


class ApiError(Exception):
    """An answer that is not a success: a contract code, a message a person can act on, and the
    verdict that recorded it (None only where no caller is known, e.g. a bad key)."""

    def __init__(self, code: str, message: str, *, verdict_id: str | None = None,
                 headers: dict[str, str] | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.verdict_id = verdict_id
        self.headers = headers or {}
        self.extra = extra

    @property
    def status(self) -> int:
        return ERROR_STATUS[self.code]

    def body(self) -> dict[str, Any]:
        return {"error": {"code": self.code, "message": self.message, "verdict_id": self.verdict_id,
                          **self.extra}}
