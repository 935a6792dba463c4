"""Django's ASGI handler as refundops.asgi serves it: one crossing from the event loop to a thread per
request, on a thread the process keeps (issue 11).

Django's own ASGIHandler calls the request's thread once for each middleware hook of the chain
(``MiddlewareMixin`` runs ``process_request``, ``process_view`` and ``process_response`` through
sync_to_async), once for the view, for ``request_started`` and for the response's close: 16
crossings a request, each a wake-up of that thread and then of the loop; and it starts two threads
per request (the request's own, and one that joins it at the end). Here the chain is built sync and
``respond()`` runs request_started, the chain, the view and, unless the response streams, its close
(``request_finished``: the connection back to the pool) in one call.

Each request leases one of ``threads`` long-lived threads once its body is in, until its response
is whole (a ``ThreadSensitiveContext`` on it: a streamed CSV export still reads its cursor there,
and keeps the thread until it is sent); the body is read, and a whole response sent, on the loop.
Past that many, requests wait on the loop for one in the order they came: a worker runs at most
``threads`` requests' Python at once, rather than every request its connections bring, each in a
thread of its own contending for the GIL and the pool.

No body over ``REQUEST_MAX_BODY_BYTES`` is read (refundops.middleware.BodyLimitMiddleware says why):
a declared length over it is answered 413 before reading, a chunked body at the byte that passes it."""

from __future__ import annotations

import asyncio
import collections
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor

from asgiref.sync import ThreadSensitiveContext, sync_to_async
from django.conf import settings
from django.core import signals
from django.core.handlers.asgi import ASGIHandler, get_script_prefix
from django.core.exceptions import RequestAborted
from django.http import FileResponse
from django.urls import set_script_prefix

from refundops.logs import REQUEST_ID_HEADER
from refundops.middleware import too_large_response


class BodyOverLimit(Exception):
    """The body passed REQUEST_MAX_BODY_BYTES while being read."""


class Threads:
    """``size`` single-thread executors, each leased to one request at a time; a request that finds
    none idle waits for the next one returned, first come first served."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError("a Django handler needs at least one thread")
        self.idle = collections.deque(ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"django-{i}")
                                      for i in range(size))
        self.waiting: collections.deque[asyncio.Future] = collections.deque()

    async def acquire(self) -> ThreadPoolExecutor:
        if self.idle and not self.waiting:
            return self.idle.pop()  # the one last returned: its thread is warm
        waiter = asyncio.get_running_loop().create_future()
        self.waiting.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # handed one just as it was cancelled
                self.release(waiter.result())
            raise

    def release(self, executor: ThreadPoolExecutor) -> None:
        while self.waiting:
            waiter = self.waiting.popleft()
            if not waiter.done():
                waiter.set_result(executor)
                return
        self.idle.append(executor)


class DjangoHandler(ASGIHandler):
    """Django's ASGI handler with the sync middleware chain, one crossing a request, on leased threads."""

    def __init__(self, threads: int) -> None:
        self.threads = Threads(threads)
        super().__init__()
        self.respond_on_thread = sync_to_async(self.respond, thread_sensitive=True)  # made once, not per request

    def load_middleware(self, is_async: bool = False) -> None:
        super().load_middleware(is_async=False)  # the whole chain runs in the request's thread

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            raise ValueError(f"Django can only handle ASGI/HTTP connections, not {scope['type']}.")
        await self.handle(scope, receive, send)

    async def handle(self, scope, receive, send) -> None:
        # The body is read, and a whole answer sent, on the loop: a client slow to send or to read
        # holds none of the threads (WEB_THREADS slow uploads would otherwise stop the process).
        if _declared_length(scope) > settings.REQUEST_MAX_BODY_BYTES:
            await self.refuse_too_large(scope, send)  # unread
            return
        try:
            body_file = await self.read_body(receive)
        except RequestAborted:
            return
        except BodyOverLimit:
            await self.refuse_too_large(scope, send)
            return
        try:
            executor = await self.threads.acquire()
            try:
                async with ThreadSensitiveContext(executor=executor):
                    response = await self.respond_on_thread(scope, body_file)
                    if response.streaming:
                        await self.stream(response, receive, send)
                        return
            finally:
                self.threads.release(executor)
            await self.send_response(response, send)  # whole, and closed on its thread already
        finally:
            body_file.close()

    async def read_body(self, receive):
        """Django's ``read_body``, stopping at the byte that passes ``REQUEST_MAX_BODY_BYTES``."""
        limit, size = settings.REQUEST_MAX_BODY_BYTES, 0
        body_file = tempfile.SpooledTemporaryFile(max_size=settings.FILE_UPLOAD_MAX_MEMORY_SIZE, mode="w+b")
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                body_file.close()
                raise RequestAborted()
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                body_file.close()
                raise BodyOverLimit()
            body_file.write(chunk)
            if not message.get("more_body", False):
                break
        body_file.seek(0)
        return body_file

    async def refuse_too_large(self, scope, send) -> None:
        response = too_large_response(scope.get("path", ""))
        response[REQUEST_ID_HEADER] = uuid.uuid4().hex
        response["Content-Length"] = str(len(response.content))
        response["Connection"] = "close"  # the rest of the body is never read
        await self.send_response(response, send)

    async def stream(self, response, receive, send) -> None:
        """A streamed response reads (a CSV export: its cursor) on the request's thread as it is
        sent, so it keeps the thread until it is sent or the client goes; then it is closed there."""
        try:
            sending = asyncio.create_task(self.send_response(response, send))
            listening = asyncio.create_task(self.listen_for_disconnect(receive))
            await asyncio.wait([sending, listening], return_when=asyncio.FIRST_COMPLETED)
            for task in (listening, sending):
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, RequestAborted):
                    pass
        finally:
            await sync_to_async(response.close, thread_sensitive=True)()

    def respond(self, scope, body_file):
        """The request's sync part, on its thread: request_started, the request, the middleware chain
        and the view; a response that is not streamed is closed here (request_finished)."""
        set_script_prefix(get_script_prefix(scope))
        signals.request_started.send(sender=self.__class__, scope=scope)
        request, response = self.create_request(scope, body_file)
        if request is not None:
            response = self.get_response(request)
            response._handler_class = self.__class__
            if isinstance(response, FileResponse):
                response.block_size = self.chunk_size
        if not response.streaming:
            response.close()
        return response


def _declared_length(scope) -> int:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            return int(value) if value.isdigit() else 0
    return 0
