"""The one ASGI application: Django (API, admin, webhooks) and the MCP server at ``/mcp``, on the same
host and port. Serve it with ``uvicorn refundops.asgi:application`` or gunicorn's UvicornWorker, with
the ASGI lifespan on (their default, "auto"): the MCP session manager starts in it."""

import os

from django.core.asgi import get_asgi_application
from starlette.types import Receive, Scope, Send

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "refundops.settings")
django_app = get_asgi_application()  # sets Django up before anything imports models

from django.core.handlers.asgi import ASGIHandler  # noqa: E402
from django.core.signals import request_finished  # noqa: E402
from django.db import connections  # noqa: E402


def close_request_connections(**kwargs) -> None:
    """Each ASGI request runs in a thread of its own that ends with it: its connection goes back to
    the pool (settings turn the pool on here), or, with DATABASE_POOL=false or settings read
    before this module (a test process), is closed rather than left behind with the thread."""
    for conn in connections.all(initialized_only=True):
        if not conn.in_atomic_block:
            conn.close()


request_finished.connect(close_request_connections, sender=ASGIHandler)

from refundops.mcp_server import MCP_PATH, http_app  # noqa: E402

mcp_app = http_app()


async def application(scope: Scope, receive: Receive, send: Send) -> None:
    # Django's handler speaks only HTTP, so the lifespan goes to the MCP app, which needs it.
    if scope["type"] == "lifespan" or scope["path"] == MCP_PATH or scope["path"].startswith(MCP_PATH + "/"):
        await mcp_app(scope, receive, send)
    else:
        await django_app(scope, receive, send)
