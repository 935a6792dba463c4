"""The one ASGI application: Django (API, admin, webhooks) and the MCP server at ``/mcp``, on the same
host and port. Serve it with ``gunicorn refundops.asgi:application -c gunicorn.conf.py`` (uvicorn
workers: refundops.serving.UvicornWorker) or ``uvicorn refundops.asgi:application``, with the ASGI
lifespan on (their default, "auto"): the MCP session manager starts in it. Django runs in
refundops/asgi_handler.py's handler: one call to a thread a request, on threads each process keeps."""

import gc
import os

import django
from starlette.exceptions import HTTPException
from starlette.responses import PlainTextResponse
from starlette.staticfiles import StaticFiles
from starlette.types import Message, Receive, Scope, Send

from refundops.startup import configuration_errors_in_one_line  # noqa: E402 - imports no settings

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "refundops.settings")
with configuration_errors_in_one_line():
    django.setup(set_prefix=False)  # before anything imports models

from django.conf import settings  # noqa: E402
from refundops.asgi_handler import DjangoHandler  # noqa: E402

# Each process runs at most WEB_THREADS Django requests at once, each on a thread it keeps; more wait
# their turn on the loop (refundops/asgi_handler.py; docs/OPERATIONS.md).
django_app = DjangoHandler(threads=int(os.environ.get("WEB_THREADS", "2")))

from refundops.mcp_server import MCP_PATH, http_app  # noqa: E402

mcp_app = http_app()


# The admin's static files (collectstatic's STATIC_ROOT), served here, outside Django's middleware,
# when settings left WhiteNoise out (this module imported first, DEBUG off): with the headers
# WhiteNoise gave them. Otherwise (a test process, DEBUG) WhiteNoise serves them inside Django.
STATIC_PREFIX = "/" + settings.STATIC_URL.strip("/") + "/"
STATIC_HEADERS = [(b"cache-control", b"max-age=60, public"), (b"access-control-allow-origin", b"*"),
                  (b"x-content-type-options", b"nosniff")]
static_app = (None if "whitenoise.middleware.WhiteNoiseMiddleware" in settings.MIDDLEWARE
              else StaticFiles(directory=settings.STATIC_ROOT, check_dir=False))


async def serve_static(scope: Scope, receive: Receive, send: Send) -> None:
    async def send_with_headers(message: Message) -> None:
        if message["type"] == "http.response.start" and message["status"] in (200, 304):
            message["headers"] = [*message.get("headers", []), *STATIC_HEADERS]
        await send(message)

    root_path = scope.get("root_path", "") + STATIC_PREFIX.rstrip("/")
    try:
        await static_app({**scope, "root_path": root_path}, receive, send_with_headers)
    except HTTPException as exc:  # raised before anything is sent
        if exc.status_code == 404:  # Django answers (and counts) a miss, as it did behind WhiteNoise
            await django_app(scope, receive, send)
        else:
            await PlainTextResponse(exc.detail, exc.status_code, headers=exc.headers)(scope, receive, send)


def route_path(scope: Scope) -> str:
    """The path below the server's root path (uvicorn --root-path), as Starlette routes it."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root + "/") else path


async def application(scope: Scope, receive: Receive, send: Send) -> None:
    # Django's handler speaks only HTTP, so the lifespan goes to the MCP app, which needs it.
    if scope["type"] == "lifespan" or scope["path"] == MCP_PATH or scope["path"].startswith(MCP_PATH + "/"):
        await mcp_app(scope, receive, send)
    elif static_app is not None and scope["type"] == "http" and route_path(scope).startswith(STATIC_PREFIX):
        await serve_static(scope, receive, send)
    else:
        await django_app(scope, receive, send)


# What is loaded by now (Django, the apps, their modules: ~150,000 objects) lives as long as the
# process: out of the collector's full passes, each of which otherwise held the GIL for ~0.1 s
# every ~1,000 requests or so (docs/PERFORMANCE.md, "Garbage collection").
gc.collect()
gc.freeze()
