"""Under ASGI (refundops.asgi: uvicorn, gunicorn's UvicornWorker) a request crosses from the event
loop to a thread once: refundops.asgi's handler runs request_started, the whole middleware chain
(built sync), the view and the response's close in one call, on a thread the process keeps and
leases to one request at a time (refundops/asgi_handler.py). Our middleware is also async-capable,
for Django's own ASGI handler (AsyncClient), where WhiteNoise is left out; the request id it binds
reaches a sync view's lines. (Issue 11.)"""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest
import structlog
from asgiref.sync import SyncToAsync, async_to_sync
from django.conf import settings
from django.core.handlers.asgi import ASGIHandler
from django.core.signals import request_finished
from django.db import connections
from django.http import HttpResponse, StreamingHttpResponse
from django.test import AsyncClient, override_settings
from django.urls import path
from django.views.decorators.csrf import csrf_exempt

from bench.handlers import answered, counted_crossings
from refundops.asgi_handler import DjangoHandler, Threads
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


# -- refundops.asgi's handler: one crossing per request, on threads the process keeps ---------------

def connection_probe(request):
    """A sync view that uses the database, as the API's do; it leaves its connection to be found."""
    from django.db import connections

    with connections["default"].cursor() as cursor:
        cursor.execute("SELECT 1")
    seen.append((threading.current_thread().name, connections["default"]))
    return HttpResponse("ok")


def endless(request):
    """A response streamed for as long as the client stays (as a CSV export of a long list)."""
    async def chunks():
        while True:
            yield b"row\n"
            await asyncio.sleep(0)
    return StreamingHttpResponse(chunks())


seen: list = []
urlpatterns += [path("db/", connection_probe, name="asgi-db-probe"), path("endless/", endless, name="asgi-endless")]


def scope_of(path: str) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "",
            "server": ("testserver", 80), "client": ("127.0.0.1", 5000), "headers": [(b"host", b"testserver")]}


def asgi_get(app, path: str, *, times: int = 1) -> list[dict]:
    """``times`` GETs of ``path`` through ``app`` as uvicorn calls it (each in a task of its own), one
    after the other on one event loop; the messages each sent."""
    scope = scope_of(path)
    answers = []

    async def one() -> None:
        answers.append(await answered(app, dict(scope)))

    async def all_of_them() -> None:
        for _ in range(times):
            await asyncio.create_task(one())

    asyncio.run(all_of_them())
    return answers


def crossings_and_threads(app, path: str, *, times: int = 4) -> tuple[float, float]:
    """Calls from the loop to a thread (SyncToAsync) and threads started, per request, after a warm one."""
    asgi_get(app, path)
    with counted_crossings() as counts:
        answers = asgi_get(app, path, times=times)
    assert all(sent[0]["status"] == 200 for sent in answers)
    return counts["crossings"] / times, counts["threads"] / times


def test_the_deployed_handler_crosses_to_a_thread_once_per_request_and_starts_none():
    """Django's ASGIHandler calls a thread for each middleware hook (MiddlewareMixin runs
    process_request/process_view/process_response through sync_to_async), for the view, for
    request_started and for the response's close, and starts two threads per request (the request's
    own and one that joins it): each crossing wakes a thread and then the loop. refundops.asgi's
    handler runs all of it in one call, on a thread it keeps. Fails before (refundops.asgi served
    Django's handler): 16 crossings and 2 threads started per request."""
    with override_settings(MIDDLEWARE=ASGI_MIDDLEWARE, ROOT_URLCONF=__name__):
        django_crossings, django_threads = crossings_and_threads(ASGIHandler(), "/probe/")
        ours = crossings_and_threads(DjangoHandler(threads=2), "/probe/")
    # the control: Django's own handler
    assert django_crossings >= 10 and django_threads == 2, (django_crossings, django_threads)
    assert ours == (1, 0)


def test_requests_lease_the_handlers_threads_and_finish_on_them(monkeypatch):
    """Each request runs on one of the handler's threads, reused, and request_finished (which gives
    the request's connection back to the pool) is sent on that same thread, where Django keeps the
    connection, before the next request there begins."""
    seen.clear()
    finished = []

    def on_finished(sender, **kwargs):
        finished.append((threading.current_thread().name, sender))

    request_finished.connect(on_finished)
    # As under refundops.asgi's pool: the connection closed as the request finishes (not kept open by
    # the handler's thread past the test).
    monkeypatch.setitem(connections.settings["default"], "CONN_MAX_AGE", 0)
    try:
        with override_settings(MIDDLEWARE=ASGI_MIDDLEWARE, ROOT_URLCONF=__name__):
            answers = asgi_get(DjangoHandler(threads=1), "/db/", times=3)
    finally:
        request_finished.disconnect(on_finished)
    assert [sent[0]["status"] for sent in answers] == [200, 200, 200]
    threads = {name for name, _ in seen}
    assert len(threads) == 1  # one thread kept, not one per request
    assert finished == [(*threads, DjangoHandler)] * 3
    assert seen[-1][1].connection is None


def test_past_its_threads_a_worker_queues_requests_on_the_loop_in_order():
    """With N threads, at most N requests of a process run Django code at once; the rest wait their
    turn on the loop (first come, first served) instead of contending for the GIL and the pool."""
    async def scenario() -> tuple[list[int], list[int]]:
        threads = Threads(2)
        running, most, order = 0, 0, []

        async def request(i: int) -> None:
            nonlocal running, most
            executor = await threads.acquire()
            try:
                running += 1
                most = max(most, running)
                order.append(i)
                await asyncio.sleep(0.01)
                running -= 1
            finally:
                threads.release(executor)

        await asyncio.gather(*(request(i) for i in range(6)))
        return [most], order

    most, order = asyncio.run(scenario())
    assert most == [2] and order == list(range(6))


def test_a_streamed_response_stops_when_the_client_goes_and_finishes_on_its_thread():
    """The handler sends a streamed response while it listens for the client: when it goes, the
    stream stops and the response is closed (request_finished) on the request's thread."""
    finished = []

    def on_finished(sender, **kwargs):
        finished.append(threading.current_thread().name)

    async def one() -> list[dict]:
        sent, received = [], asyncio.Event()

        async def receive():
            if not sent:
                return {"type": "http.request", "body": b"", "more_body": False}
            await received.wait()
            return {"type": "http.disconnect"}

        async def send(message):
            sent.append(message)
            if len(sent) == 3:  # the start and two chunks: then the client goes
                received.set()

        await asyncio.wait_for(DjangoHandler(threads=1)({**scope_of("/endless/")}, receive, send), timeout=10)
        return sent

    request_finished.connect(on_finished)
    try:
        with override_settings(MIDDLEWARE=ASGI_MIDDLEWARE, ROOT_URLCONF=__name__):
            sent = asyncio.run(one())
    finally:
        request_finished.disconnect(on_finished)
    assert sent[0]["status"] == 200 and len(sent) < 1000
    assert len(finished) == 1 and finished[0].startswith("django-")


# -- what a slow client holds: nothing of the handler's threads while its body or answer travels ----

@csrf_exempt
def echo(request):
    return HttpResponse(request.body)


urlpatterns.append(path("echo/", echo, name="asgi-echo"))


def http_scope(method: str, path: str) -> dict:
    return {**scope_of(path), "method": method,
            "headers": [(b"host", b"testserver"), (b"content-type", b"application/json")]}


def one_thread_while(slow_request) -> tuple[list[dict], list[dict]]:
    """With one thread in the handler: ``slow_request(app, stalled, go_on)`` starts and stalls (sets
    ``stalled``, waits for ``go_on``); meanwhile a quick GET must be answered. The answers of both."""
    async def scenario():
        app = DjangoHandler(threads=1)
        stalled, go_on = asyncio.Event(), asyncio.Event()
        slow = asyncio.create_task(slow_request(app, stalled, go_on))
        await asyncio.wait_for(stalled.wait(), timeout=30)
        try:  # only a guard against waiting for ever: the quick request needs no time of the slow one's
            quick = await asyncio.wait_for(answered(app, http_scope("GET", "/probe/")), timeout=30)
        except TimeoutError:
            quick = []
        assert not slow.done()  # the slow one is still stalled, holding what it holds
        go_on.set()
        return quick, await asyncio.wait_for(slow, timeout=30)

    with override_settings(MIDDLEWARE=ASGI_MIDDLEWARE, ROOT_URLCONF=__name__):
        return asyncio.run(scenario())


def test_a_request_whose_body_is_still_coming_holds_none_of_the_handlers_threads():
    """The body is read on the event loop before the request takes a thread: a slow upload (or a
    client that sends half a body and waits) leaves the process's WEB_THREADS threads to the
    requests that are ready. Fails before: the thread was leased first, so with WEB_THREADS slow
    bodies a worker answered nothing else until they came."""
    async def slow_upload(app, stalled, go_on):
        parts = iter([b'{"half": ', b'"body"}'])

        async def receive():
            part = next(parts, None)
            if part is None:
                await asyncio.Event().wait()
            if part.endswith(b"}"):
                stalled.set()
                await go_on.wait()
            return {"type": "http.request", "body": part, "more_body": not part.endswith(b"}")}

        return await answered(app, http_scope("POST", "/echo/"), receive=receive)

    quick, slow = one_thread_while(slow_upload)
    assert quick and quick[0]["status"] == 200
    assert slow[0]["status"] == 200 and slow[1]["body"] == b'{"half": "body"}'


def test_a_client_that_reads_its_answer_slowly_holds_none_of_the_handlers_threads():
    """A response that is not streamed is whole when the view returns, and closed on its thread
    (request_finished): it is sent from the loop after the thread is given back, so a client slow
    to read it (uvicorn's send waits while the socket's buffer is full) keeps no other request
    waiting. Fails before: the thread stayed leased until the last byte was sent."""
    async def slow_reader(app, stalled, go_on):
        sent: list[dict] = []

        async def send(message):
            if message["type"] == "http.response.body":
                stalled.set()
                await go_on.wait()  # as uvicorn's send does while the client does not read
            sent.append(message)

        await answered(app, http_scope("GET", "/probe/"), send=send)
        return sent

    quick, slow = one_thread_while(slow_reader)
    assert quick and quick[0]["status"] == 200
    assert slow[0]["status"] == 200 and slow[1]["body"] == b"ok"
