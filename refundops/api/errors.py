"""One error shape for every answer: ``{"error": {"code", "message", "verdict_id", …}}``."""

from __future__ import annotations

import logging

from rest_framework import exceptions
from rest_framework.response import Response

from refundops.errors import ApiError

log = logging.getLogger(__name__)


def exception_handler(exc, context):
    if isinstance(exc, ApiError):
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
        err = ApiError("VALIDATION_ERROR", f"body: {exc.detail}", field="body")
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
