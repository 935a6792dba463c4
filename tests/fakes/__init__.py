"""Local stand-ins for payment gateways, spoken to over a real socket by the gateways' own SDKs.

:class:`FakeGateway` owns the plumbing: a ``ThreadingHTTPServer`` on 127.0.0.1 at a free port in a
background thread, and the failure modes every gateway has (down, unreachable, rate limited,
slow). A subclass answers one request at a time in :meth:`FakeGateway.handle`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar, Literal
from urllib.parse import urlsplit

Mode = Literal["up", "down", "unreachable", "rate_limited", "slow", "slow_after", "drop_after"]


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: str
    headers: dict[str, str]  # names lower-cased
    body: bytes

    def header(self, name: str) -> str | None:
        return self.headers.get(name.lower())


@dataclass
class Response:
    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)


class FakeGateway:
    """Start with :meth:`start`, stop with :meth:`stop`; switch failure modes with :meth:`set_mode`."""

    name: ClassVar[str] = "fake"

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.mode: Mode = "up"
        self.retry_after = 1
        self.slow_seconds = 2.0
        self._mode_requests_left: int | None = None  # the mode lasts this many requests, then "up"
        self._mode_path = ""  # the mode touches only requests whose path ends so ("" every request)
        self.received: list[Request] = []  # every request, for assertions on the wire format
        self._in_flight: set[str] = set()  # idempotency keys whose first request is still answering
        self._stopping = threading.Event()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self) -> FakeGateway:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                fake._serve(self)

            do_POST = do_DELETE = do_GET

            def log_message(self, format: str, *args: object) -> None:
                pass  # keep test output clean

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        # A short poll interval keeps stop() (and so each test's teardown) quick.
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        name=f"{self.name}-fake", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()  # wakes any handler sleeping in "slow" mode
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    @property
    def url(self) -> str:
        assert self._server is not None, "start() the fake first"
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    # -- control ---------------------------------------------------------------------------------
    def set_mode(self, mode: Mode, *, retry_after: int | None = None,
                 slow_seconds: float | None = None, requests: int | None = None, path: str = "") -> None:
        """``down``: 503; ``unreachable``: the connection closes unanswered; ``rate_limited``: 429
        with ``Retry-After``; ``slow``: answers only after ``slow_seconds``; ``slow_after``: acts at
        once and answers only after ``slow_seconds`` (a client that times out never hears that the
        gateway acted). Meanwhile a request with the same idempotency key is told it is in use.
        ``drop_after``: acts, then closes the connection without answering. ``requests``: the mode
        holds for that many requests, then the gateway is up again. ``path``: the mode touches only
        requests whose path ends so (the others are answered normally)."""
        with self.lock:
            self.mode = mode
            self._mode_requests_left, self._mode_path = requests, path
            if retry_after is not None:
                self.retry_after = retry_after
            if slow_seconds is not None:
                self.slow_seconds = slow_seconds

    # -- for subclasses --------------------------------------------------------------------------
    def handle(self, request: Request) -> Response:
        raise NotImplementedError

    def unavailable(self) -> Response:
        """The gateway's own 503 answer."""
        raise NotImplementedError

    def rate_limited(self) -> Response:
        """The gateway's own 429 answer (without ``Retry-After``; added here)."""
        raise NotImplementedError

    def idempotency_key(self, request: Request) -> str | None:
        """The request's idempotency key, where the gateway has them."""
        return None

    def key_in_use(self) -> Response:
        """The gateway's answer to a request whose key another request is still using."""
        raise NotImplementedError

    # -- plumbing --------------------------------------------------------------------------------
    def _serve(self, handler: BaseHTTPRequestHandler) -> None:
        parts = urlsplit(handler.path)
        length = int(handler.headers.get("Content-Length") or 0)
        request = Request(method=handler.command, path=parts.path, query=parts.query,
                          headers={k.lower(): v for k, v in handler.headers.items()},
                          body=handler.rfile.read(length) if length else b"")
        with self.lock:
            self.received.append(request)
            mode = self.mode if request.path.endswith(self._mode_path) else "up"
            if self._mode_requests_left is not None and mode != "up":
                self._mode_requests_left -= 1
                if self._mode_requests_left <= 0:
                    self.mode, self._mode_requests_left, self._mode_path = "up", None, ""
        if mode == "unreachable":
            handler.close_connection = True
            return
        if mode == "slow" and self._stopping.wait(self.slow_seconds):
            return
        if mode == "down":
            response = self.unavailable()
        elif mode == "rate_limited":
            response = self.rate_limited()
            response.headers["Retry-After"] = str(self.retry_after)
        else:
            key = self.idempotency_key(request)
            with self.lock:  # one request at a time: the fakes' state is plain dicts
                if key is not None and key in self._in_flight:
                    response = self.key_in_use()
                else:
                    response = self.handle(request)
                    if mode == "slow_after" and key is not None:
                        self._in_flight.add(key)
            if mode == "slow_after":
                self._stopping.wait(self.slow_seconds)
                with self.lock:
                    self._in_flight.discard(key)
            if mode == "drop_after":  # it acted; the answer never leaves
                handler.close_connection = True
                return
        try:
            handler.send_response(response.status)
            for name, value in response.headers.items():
                handler.send_header(name, value)
            handler.send_header("Content-Length", str(len(response.body)))
            handler.end_headers()
            handler.wfile.write(response.body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client gave up (e.g. timed out in "slow" mode)
