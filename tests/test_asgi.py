"""Under ASGI (refundops.asgi: uvicorn, gunicorn's UvicornWorker) a request crosses from the event
loop to a thread once, for the (sync) view: every middleware in the chain is async-capable, ours
included, and WhiteNoise is left out (refundops.asgi serves the static files). The request id our
middleware binds on the loop still reaches the lines the view logs in its thread. (Issue 11.)"""

from __future__ import annotations

import asyncio
import logging

import pytest
import structlog
from asgiref.sync import SyncToAsync, async_to_sync
from django.conf import settings
from django.core.handlers.asgi import ASGIHandler
from django.http import HttpResponse
from django.test import AsyncClient, override_settings
from django.urls import path

from refundops.metrics import HTTP_REQUESTS
from tests.test_logs import formatted_lines

pytestmark = pytest.mark.django_db

WHITENOISE = "whitenoise.middleware.WhiteNoiseMiddleware"
ASGI_MIDDLEWARE = [m for m in settings.MIDDLEWARE if m != WHITENOISE]  # as settings make it under refundops.asgi


def probe(request):
    """A sync view, as all of ours are: Django runs it in a thread, away from the event loop."""
    try:
        asyncio.get_running_loop()
        on_the_loop = True
    except RuntimeError:
        on_the_loop = False
    structlog.get_logger("refundops.probe").info("in the view", on_the_loop=on_the_loop)
    return HttpResponse("ok")


urlpatterns = [path("probe/", probe, name="asgi-probe")]


def adaptations(middleware: list[str], caplog) -> tuple[list[str], object]:
    caplog.clear()
    with override_settings(MIDDLEWARE=middleware, DEBUG=True), caplog.at_level(logging.DEBUG, "django.request"):
        handler = ASGIHandler()
    return [r.getMessage() for r in caplog.records if "handler adapted" in r.getMessage()], handler._middleware_chain


def test_under_asgi_no_middleware_crosses_between_the_loop_and_a_thread(caplog):
    adapted, chain = adaptations(ASGI_MIDDLEWARE, caplog)
    assert adapted == []
    assert not isinstance(chain, SyncToAsync)  # the outermost middleware is not wrapped for the loop either
    adapted, chain = adaptations([*ASGI_MIDDLEWARE[:3], WHITENOISE, *ASGI_MIDDLEWARE[3:]], caplog)
    assert adapted and WHITENOISE in adapted[0]  # the control: WhiteNoise, sync only, would cost crossings
    assert isinstance(chain, SyncToAsync)


def test_the_request_id_reaches_the_views_lines_and_the_request_is_counted_under_asgi():
    counted = HTTP_REQUESTS.labels("GET", "asgi-probe", "200")
    before = counted._value.get()
    answers = []
    with override_settings(MIDDLEWARE=ASGI_MIDDLEWARE, ROOT_URLCONF=__name__):
        lines = formatted_lines(lambda: answers.append(
            async_to_sync(AsyncClient().get)("/probe/", headers={"X-Request-ID": "req-asgi-1"})))
    assert answers[0].status_code == 200 and answers[0]["X-Request-ID"] == "req-asgi-1"
    view = [line for line in lines if line.get("logger") == "refundops.probe"]
    assert view and view[0]["request_id"] == "req-asgi-1" and view[0]["on_the_loop"] is False
    request = [line for line in lines if line.get("logger") == "refundops.request"]
    assert request and request[0]["request_id"] == "req-asgi-1" and request[0]["route"] == "asgi-probe"
    assert counted._value.get() == before + 1
    assert structlog.contextvars.get_contextvars() == {}  # nothing left bound after the request
