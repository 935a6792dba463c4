"""gunicorn for the web service (docker-compose.yml and the image's CMD):
gunicorn refundops.asgi:application -c gunicorn.conf.py

gunicorn reads this file from the current folder whatever it serves, so the worker follows the
application named: refundops.asgi (API, MCP, admin) gets uvicorn's worker; Django's standard
`gunicorn refundops.wsgi:application` (no MCP) gets gunicorn's own sync worker.

WEB_CONCURRENCY workers, each with its own database pool of DATABASE_POOL_MAX connections: keep
WEB_CONCURRENCY x DATABASE_POOL_MAX (x web containers) under PostgreSQL's max_connections, with room
for the workers (docs/OPERATIONS.md, "Connections add up")."""

import os
import shutil
import sys

from gunicorn.config import Config


def _serves_asgi() -> bool:
    """The application on gunicorn's command line is an ASGI one (refundops.asgi:application)."""
    named = Config().parser().parse_known_args(sys.argv[1:])[0].args
    return any(app.split(":")[0].endswith("asgi") for app in named)


bind = os.environ.get("BIND", "0.0.0.0:8000")
workers = int(os.environ.get("WEB_CONCURRENCY", "4"))
if _serves_asgi():
    worker_class = "refundops.serving.UvicornWorker"  # uvicorn's, one accept per wake-up (refundops/serving.py)
accesslog = None  # each request is logged once, as JSON with its request id, by the app
graceful_timeout = 30


def on_starting(server):
    """/metrics sums every worker's request counters from files in PROMETHEUS_MULTIPROC_DIR: start empty."""
    directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
    if directory:
        shutil.rmtree(directory, ignore_errors=True)
        os.makedirs(directory, exist_ok=True)


def child_exit(server, worker):
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(worker.pid)
