"""The site's middleware that the agent API passes by.

A request to ``/api/`` is authenticated by its key alone (refundops.api.auth; DRF's
SessionAuthentication is not configured, DRF exempts its views from Django's CSRF check, and DRF
sets the request's user to its own, None, once the key is read), so it has no use for a session,
the signed-in user and their second factor, messages, or simple_history's request, and a session
cookie sent along grants it nothing either way. These classes are Django's, django-otp's and
simple_history's for every other request (the admin and its sign-in keep the whole chain) and
hand an API request straight on. Whatever protects or labels an answer runs for every request:
security headers, CSRF, X-Frame-Options, WhiteNoise, CommonMiddleware, django-axes, our request
id and metrics. Subclasses, not wrappers, so Django's admin checks still find the classes it needs.
"""

from __future__ import annotations

from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from django.conf import settings
from django.contrib.auth import middleware as auth
from django.contrib.messages import middleware as messages
from django.contrib.sessions import middleware as sessions
from django.http import JsonResponse
from django.utils.decorators import sync_and_async_middleware
from django_otp import middleware as otp
from simple_history import middleware as history

API_PREFIX = "/api/"
WEBHOOK_PREFIX = "/webhooks/"


def is_api(request) -> bool:
    return request.path_info.startswith(API_PREFIX)


class _ApiPassesBy:
    def __call__(self, request):
        if is_api(request):
            return self.get_response(request)  # a coroutine under ASGI, awaited by the caller
        return super().__call__(request)


class SessionMiddleware(_ApiPassesBy, sessions.SessionMiddleware):
    pass


class AuthenticationMiddleware(_ApiPassesBy, auth.AuthenticationMiddleware):
    pass


class OTPMiddleware(_ApiPassesBy, otp.OTPMiddleware):
    pass


class MessageMiddleware(_ApiPassesBy, messages.MessageMiddleware):
    pass


@sync_and_async_middleware
def HistoryRequestMiddleware(get_response):
    site = history.HistoryRequestMiddleware(get_response)
    if iscoroutinefunction(get_response):
        async def middleware(request):
            return await (get_response if is_api(request) else site)(request)
    else:
        def middleware(request):
            return (get_response if is_api(request) else site)(request)
    return middleware


# -- what no page can take, answered before anyone is known ------------------------------------------

def declared_length(meta) -> int:
    """The request's Content-Length (0 when absent or not a number, as Django reads it)."""
    length = meta.get("CONTENT_LENGTH") or ""
    return int(length) if length.isdigit() else 0


def is_chunked(meta) -> bool:
    return "chunked" in meta.get("HTTP_TRANSFER_ENCODING", "").lower()


def too_large_response(path: str) -> JsonResponse:
    """413 for a body over ``REQUEST_MAX_BODY_BYTES``, in the error shape of the route it was sent to."""
    limit = settings.REQUEST_MAX_BODY_BYTES
    message = f"body: over {limit} bytes, the most any request here may send; send a smaller request."
    if path.startswith(WEBHOOK_PREFIX):  # the webhook routes' own shape (processors/webhooks.py)
        return JsonResponse({"error": {"code": "payload_too_large", "message": message}}, status=413)
    return JsonResponse({"error": {"code": "PAYLOAD_TOO_LARGE", "message": message, "verdict_id": None}},
                        status=413)


class _Screen:
    """A check that answers some requests itself (``refusal``) and hands the rest on; sync and
    async capable (it does no I/O), so under ASGI it costs no crossing to a thread."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response) -> None:
        self.get_response = get_response
        self.async_mode = iscoroutinefunction(get_response)
        if self.async_mode:
            markcoroutinefunction(self)

    def __call__(self, request):
        if self.async_mode:
            return self.__acall__(request)
        refused = self.refusal(request)
        return refused if refused is not None else self.get_response(request)

    async def __acall__(self, request):
        refused = self.refusal(request)
        return refused if refused is not None else await self.get_response(request)

    def refusal(self, request) -> JsonResponse | None:
        raise NotImplementedError


class BodyLimitMiddleware(_Screen):
    """No request body over ``REQUEST_MAX_BODY_BYTES`` is read, whoever sends it: a declared length
    over it is refused unread, a chunked body is read no further than it. Each route keeps its own
    tighter cap below this one (the API's and MCP's 64 KiB, recorded with the caller's verdict; the
    webhooks' 512 KiB, recorded as a prefix); this one bounds what is read before anyone is known.
    Under ASGI refundops/asgi_handler.py applies it while reading, before this chain runs; here it
    guards WSGI, where the view reads the body from the server's stream."""

    def refusal(self, request) -> JsonResponse | None:
        limit = settings.REQUEST_MAX_BODY_BYTES
        if declared_length(request.META) > limit:
            return too_large_response(request.path_info)
        stream = request.META.get("wsgi.input")
        if stream is not None and not declared_length(request.META) and is_chunked(request.META):
            # Django reads no body without a Content-Length; a chunked one is drained to the cap so
            # that one over it is refused rather than ignored.
            read = 0
            while read <= limit:
                chunk = stream.read(min(64 * 1024, limit + 1 - read))
                if not chunk:
                    break
                read += len(chunk)
            if read > limit:
                return too_large_response(request.path_info)
        return None


NUL_IN_PATH = "No such page: an address cannot contain NUL (%00)."
NUL_IN_VALUE = "A filter, search or form value cannot contain NUL (%00); remove it and try again."
FORM = "application/x-www-form-urlencoded"


class RefuseNulMiddleware(_Screen):
    """PostgreSQL text cannot hold U+0000, so a NUL in an object id, a filter or search value or a
    form field reaches the database as a DataError (a 500): no id, filter or form value of ours can
    contain one. Pages (the admin, its exports, the payment page) answer it here, 404 for a path and
    400 for a value, before any query; the API and the webhooks answer it in their own codes."""

    def refusal(self, request) -> JsonResponse | None:
        path = request.path_info
        if path.startswith(API_PREFIX) or path.startswith(WEBHOOK_PREFIX):
            return None
        if "\x00" in path:
            return _client_error(404, "NOT_FOUND", NUL_IN_PATH)
        query = request.META.get("QUERY_STRING", "")
        if ("%00" in query or "\x00" in query) and _has_nul(request.GET):
            return _client_error(400, "VALIDATION_ERROR", NUL_IN_VALUE)
        if (request.method == "POST" and request.content_type == FORM
                and declared_length(request.META) and (b"%00" in request.body or b"\x00" in request.body)
                and _has_nul(request.POST)):
            return _client_error(400, "VALIDATION_ERROR", NUL_IN_VALUE)
        return None


def _has_nul(data) -> bool:
    return any("\x00" in name or any("\x00" in value for value in values) for name, values in data.lists())


def _client_error(status: int, code: str, message: str) -> JsonResponse:
    return JsonResponse({"error": {"code": code, "message": message, "verdict_id": None}}, status=status)
