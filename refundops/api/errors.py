"""One error shape for every answer: ``{"error": {"code", "message", "verdict_id", …}}``."""

from __future__ import annotations

import logging

from rest_framework import exceptions
from rest_framework.response import Response

from audit.models import Verdict
from refundops.callers import Caller
from refundops.errors import ApiError
from refundops.models import AgentKey

log = logging.getLogger(__name__)


def _recorded(err: ApiError, context) -> ApiError:
    """A body refused before any service saw it (too large, not JSON) is still a call past the key:
    it leaves a verdict that says what was refused, never the body itself."""
    request = context.get("request")
    key = getattr(request, "auth", None)
    if err.verdict_id is None and isinstance(key, AgentKey):
        err.verdict_id = record_refused_body(
            err, key=key, operation=f"{request.method} {request.path}",
            idempotency_key=request.headers.get("Idempotency-Key", ""),
            content_length=request.META.get("CONTENT_LENGTH") or "").id
    return err


def record_refused_body(err: ApiError, *, key: AgentKey, operation: str, idempotency_key: str,
                        content_length: str) -> Verdict:
    """The verdict for a body refused unread (REST and MCP): who sent how much, never what."""
    return Verdict.objects.create(
        **Caller.for_key(key).verdict_fields(), operation=operation[:40].replace("\x00", ""),
        outcome=Verdict.Outcome.DENIED, code=err.code, message=err.message,
        idempotency_key=idempotency_key[:255].replace("\x00", ""), request={"content_length": content_length[:20]})


def exception_handler(exc, context):
    if isinstance(exc, ApiError):
        if exc.code == "PAYLOAD_TOO_LARGE":
            exc = _recorded(exc, context)
        return Response(exc.body(), status=exc.status, headers=exc.headers)
    if isinstance(exc, exceptions.Throttled):
        wait = int(exc.wait or 1)
        err = ApiError("RATE_LIMITED", f"Too many requests; retry after {wait} seconds.",
                       headers={"Retry-After": str(wait)}, retry_after=wait)
        return Response(err.body(), status=err.status, headers=err.headers)
    if isinstance(exc, (exceptions.NotAuthenticated, exceptions.AuthenticationFailed)):
        err = ApiError("UNAUTHENTICATED", "Send your agent key as 'Authorization: Bearer rk_…'.")
        return Response(err.body(), status=err.status)
    if isinstance(exc, exceptions.ParseError):
        err = _recorded(ApiError("VALIDATION_ERROR", f"body: {exc.detail}", field="body"), context)
        return Response(err.body(), status=err.status)
    if isinstance(exc, exceptions.UnsupportedMediaType):
        err = ApiError("VALIDATION_ERROR", "body: send JSON with 'Content-Type: application/json'.", field="body")
        return Response(err.body(), status=err.status)
    if isinstance(exc, exceptions.MethodNotAllowed):
        return Response({"error": {"code": "METHOD_NOT_ALLOWED", "message": str(exc.detail),
                                   "verdict_id": None}}, status=405)
    if isinstance(exc, exceptions.NotFound):
        return Response({"error": {"code": "NOT_FOUND", "message": str(exc.detail), "verdict_id": None}},
                        status=404)
    return None  # anything else is a bug: let Django answer 500 and log it
