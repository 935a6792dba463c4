"""What Django's request handling costs a request, by handler, in process (no server, no network):
``GET /healthz`` through the project's middleware under Django's WSGIHandler, Django's ASGIHandler
and refundops.asgi's DjangoHandler, with the calls from the event loop to a thread and the threads
started per request.

    .venv/bin/python bench/handlers.py [--requests 2000] [--handlers wsgi,django,ours] [--rounds 2]

Prints CPU time (this process, all threads) and wall time per request. CPU is what to read on a
shared machine. Needs no database (``/healthz`` reads none); settings are bench.settings_full's,
WhiteNoise left out as under refundops.asgi.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "bench.settings_full")
PATH = "/healthz"


@contextmanager
def counted_crossings() -> Iterator[dict[str, int]]:
    """While open, count the calls from the event loop to a thread (asgiref's SyncToAsync) and the
    threads started, in the dict it yields (also tests/test_asgi.py's measure)."""
    from asgiref.sync import SyncToAsync

    counts = {"crossings": 0, "threads": 0}
    call, start = SyncToAsync.__call__, threading.Thread.start

    async def counted_call(self, *args, **kwargs):
        counts["crossings"] += 1
        return await call(self, *args, **kwargs)

    def counted_start(self, *args, **kwargs):
        counts["threads"] += 1
        return start(self, *args, **kwargs)

    SyncToAsync.__call__, threading.Thread.start = counted_call, counted_start
    try:
        yield counts
    finally:
        SyncToAsync.__call__, threading.Thread.start = call, start


async def answered(app, scope: dict, *, receive=None, send=None) -> list[dict]:
    """One request through ``app``; the messages it sent. By default its body is empty and the
    client reads the answer at once."""
    sent: list[dict] = []
    asked = False

    async def whole_body():
        nonlocal asked
        if not asked:
            asked = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.Event().wait()  # the client stays

    async def record(message):
        sent.append(message)

    await app(scope, receive or whole_body, send or record)
    return sent


def asgi_requests(app, n: int) -> None:
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": PATH, "raw_path": PATH.encode(), "query_string": b"", "root_path": "",
             "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 5000), "headers": [(b"host", b"127.0.0.1")]}

    async def one() -> None:
        sent = await answered(app, dict(scope))
        assert sent[0]["status"] == 200, sent

    async def many() -> None:
        for _ in range(n):
            await asyncio.create_task(one())  # a task per request, as uvicorn runs them

    asyncio.run(many())


def wsgi_requests(app, n: int) -> None:
    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": PATH, "QUERY_STRING": "", "SERVER_NAME": "127.0.0.1",
               "SERVER_PORT": "80", "HTTP_HOST": "127.0.0.1", "REMOTE_ADDR": "127.0.0.1", "wsgi.url_scheme": "http"}

    def start_response(status, headers):
        assert status.startswith("200"), status

    for _ in range(n):
        response = app({**environ, "wsgi.input": io.BytesIO(b"")}, start_response)
        b"".join(response)
        response.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--handlers", default="wsgi,django,ours")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    import django

    django.setup(set_prefix=False)
    from django.conf import settings
    from django.core.handlers.asgi import ASGIHandler
    from django.core.handlers.wsgi import WSGIHandler

    from refundops.asgi_handler import DjangoHandler

    if "whitenoise.middleware.WhiteNoiseMiddleware" in settings.MIDDLEWARE:
        settings.MIDDLEWARE.remove("whitenoise.middleware.WhiteNoiseMiddleware")  # as under refundops.asgi
    handlers = {"wsgi": (WSGIHandler, wsgi_requests), "django": (ASGIHandler, asgi_requests),
                "ours": (lambda: DjangoHandler(threads=2), asgi_requests)}
    with counted_crossings() as counts:
        for _ in range(args.rounds):
            for name in args.handlers.split(","):
                make, drive = handlers[name]
                app = make()
                drive(app, 50)  # warm
                counts.update(crossings=0, threads=0)
                cpu, wall = time.process_time(), time.perf_counter()
                drive(app, args.requests)
                cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
                n = args.requests
                print(f"{name:7} CPU {1e6 * cpu / n:6.0f} µs  wall {1e6 * wall / n:6.0f} µs a request; "
                      f"loop->thread calls {counts['crossings'] / n:4.1f}, threads started {counts['threads'] / n:4.2f}",
                      flush=True)


if __name__ == "__main__":
    main()
