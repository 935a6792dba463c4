"""Structured JSON logs (structlog) with a request id that follows a refund everywhere it goes.

- Every log line, ours and Django's and Celery's, is one JSON object (``LOG_FORMAT=console`` for
  people reading a terminal).
- A request id comes in as ``X-Request-ID`` (or is made), is returned in the same response header,
  and rides in each task's message headers: the worker logs under it, tasks it starts carry it on
  (submit, sync, the merchant webhooks), and outbound webhooks send it as ``X-Request-ID``.
- No log line carries an agent key, a gateway secret, a bearer token or a card number:
  :func:`redact` runs on every line, whatever logged it.
"""

from __future__ import annotations

import functools
import re
import uuid
from typing import Any

import structlog
from asgiref.sync import iscoroutinefunction, markcoroutinefunction
from celery import signals

REQUEST_ID_HEADER = "X-Request-ID"
REQUEST_ID_META = "HTTP_X_REQUEST_ID"
REQUEST_ID_TASK_HEADER = "refundops_request_id"
_VALID_REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")

# Field names whose values are secrets, wherever they appear in a line's fields.
_SECRET_FIELD = re.compile(r"(secret|password|passwd|token|api_?key|authorization|cookie|card_?number|"
                           r"^pan$|cvc|cvv|^key$|agent_key)", re.IGNORECASE)
# Secrets inside free text: our agent keys, Stripe keys and webhook secrets, bearer and basic
# credentials, PayPal client secrets in URLs, and anything shaped like a card number.
_SECRET_TEXT = [
    (re.compile(r"\b(rk_[A-Za-z0-9]{8})[A-Za-z0-9_-]+"), r"\1…[redacted]"),
    (re.compile(r"\b((?:sk|rk|pk)_(?:live|test)_)[A-Za-z0-9]+"), r"\1[redacted]"),
    (re.compile(r"\bwhsec_[A-Za-z0-9_]+"), "whsec_[redacted]"),
    (re.compile(r"(?i)\b(bearer|basic)\s+[A-Za-z0-9._~+/=-]+"), r"\1 [redacted]"),
    (re.compile(r"(?i)(client_secret|password|secret)=([^&\s]+)"), r"\1=[redacted]"),
]
_CARD_NUMBER = re.compile(r"\b(?:\d[ -]?){12,18}\d\b")
# What each pattern above needs somewhere in a text to match at all, in one scan: most texts (every
# request's line: its method, route, id, level, timestamp) have none and skip the six scans.
_MAYBE_SECRET = re.compile(r"(?i:rk_|sk_|pk_|whsec_|bearer\s|basic\s|secret=|password=)|(?:\d[ -]?){12}\d")


def _luhn(digits: str) -> bool:
    total, parity = 0, len(digits) % 2
    for i, ch in enumerate(digits):
        d = int(ch)
        if i % 2 == parity:
            d = d * 2 - 9 if d > 4 else d * 2
        total += d
    return total % 10 == 0


def redact_text(text: str) -> str:
    return _redact_each(text) if _MAYBE_SECRET.search(text) else text


def _redact_each(text: str) -> str:
    for pattern, replacement in _SECRET_TEXT:
        text = pattern.sub(replacement, text)

    def card(match: re.Match) -> str:
        digits = re.sub(r"[ -]", "", match.group(0))
        return "[card number redacted]" if 13 <= len(digits) <= 19 and _luhn(digits) else match.group(0)

    return _CARD_NUMBER.sub(card, text)


@functools.lru_cache(maxsize=1024)
def _secret_field(key: str) -> bool:
    """Field names come from code and repeat on every line: looked at once each."""
    return bool(_SECRET_FIELD.search(key))


def _redact_value(key: str, value: Any) -> Any:
    if isinstance(key, str) and _secret_field(key) and value not in (None, "", [], {}):
        return "[redacted]"
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, dict):
        return {k: _redact_value(k, v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_redact_value("", v) for v in value]
    return value


def redact(logger: Any, method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """structlog processor: secrets out of every field and every message."""
    return {k: (redact_text(v) if k == "event" and isinstance(v, str) else _redact_value(k, v))
            for k, v in event_dict.items()}


def _render_exception_text(logger: Any, method: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """Tracebacks go through the same redaction as messages (they quote arguments and URLs)."""
    if "exception" in event_dict and isinstance(event_dict["exception"], str):
        event_dict["exception"] = redact_text(event_dict["exception"])
    return event_dict


def formatter(fmt: str = "json") -> dict[str, Any]:
    """LOGGING["formatters"] entry: std-library records and structlog events rendered alike."""
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.stdlib.ExtraAdder(),
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer = (structlog.processors.JSONRenderer() if fmt == "json"
                else structlog.dev.ConsoleRenderer(colors=False))
    return {
        "()": structlog.stdlib.ProcessorFormatter,
        "foreign_pre_chain": shared,
        "processors": [
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            structlog.processors.format_exc_info,
            _render_exception_text,
            redact,
            renderer,
        ],
    }


def configure_structlog() -> None:
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.stdlib.filter_by_level,
            structlog.stdlib.add_log_level,
            structlog.stdlib.add_logger_name,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.stdlib.PositionalArgumentsFormatter(),
            structlog.processors.StackInfoRenderer(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )


def current_request_id() -> str:
    return structlog.contextvars.get_contextvars().get("request_id", "")


def bind_request_id(request_id: str | None) -> str:
    request_id = request_id if request_id and _VALID_REQUEST_ID.match(request_id) else uuid.uuid4().hex
    structlog.contextvars.bind_contextvars(request_id=request_id)
    return request_id


class RequestIdMiddleware:
    """Binds the request id for everything this request logs or enqueues, and returns it.

    Sync and async capable, so that under ASGI a request does not cross from the event loop to a
    thread and back for it: bound here in the request's task, the id reaches a sync view's lines
    too (asgiref runs the view in a copy of this context)."""

    sync_capable = True
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        self.log = structlog.get_logger("refundops.request")
        self.async_mode = iscoroutinefunction(get_response)
        if self.async_mode:
            markcoroutinefunction(self)

    def __call__(self, request):
        if self.async_mode:
            return self.__acall__(request)
        request_id = self._bind(request)
        try:
            return self._answered(request, self.get_response(request), request_id)
        finally:
            structlog.contextvars.clear_contextvars()

    async def __acall__(self, request):
        request_id = self._bind(request)
        try:
            return self._answered(request, await self.get_response(request), request_id)
        finally:
            structlog.contextvars.clear_contextvars()

    def _bind(self, request) -> str:
        structlog.contextvars.clear_contextvars()
        request.request_id = bind_request_id(request.META.get(REQUEST_ID_META))  # not request.headers: a copy of all
        return request.request_id

    def _answered(self, request, response, request_id: str):
        response[REQUEST_ID_HEADER] = request_id
        match = getattr(request, "resolver_match", None)
        self.log.info("request", method=request.method, route=match.url_name if match else None,
                      status=response.status_code)
        return response


@signals.before_task_publish.connect
def _carry_request_id(headers: dict | None = None, **kwargs: Any) -> None:
    request_id = current_request_id()
    if headers is not None and request_id:
        headers[REQUEST_ID_TASK_HEADER] = request_id


@signals.task_prerun.connect
def _bind_task_request_id(task: Any = None, task_id: str | None = None, **kwargs: Any) -> None:
    """The request id the task was sent with; an eager task (run inside the request) keeps the
    request's own, and a task nobody sent from a request (beat) gets one of its own."""
    saved = structlog.contextvars.get_contextvars()
    request_id = (getattr(task.request, REQUEST_ID_TASK_HEADER, None)
                  or (getattr(task.request, "headers", None) or {}).get(REQUEST_ID_TASK_HEADER)
                  or saved.get("request_id") or f"task-{task_id}")
    task.request.refundops_saved_log_context = saved
    structlog.contextvars.clear_contextvars()
    bind_request_id(request_id)
    structlog.contextvars.bind_contextvars(task=task.name, task_id=task_id)


@signals.task_postrun.connect
def _unbind_task_request_id(task: Any = None, **kwargs: Any) -> None:
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(**getattr(task.request, "refundops_saved_log_context", {}))
