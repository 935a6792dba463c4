"""Every way the platform is served keeps its database connections: a psycopg pool under ASGI
(Django's requests on the threads each process keeps, one checkout a request; each MCP call in a
thread of its own) and for MCP over stdio, a persistent connection checked before reuse everywhere
else (WSGI, Celery, commands). Never a connection per request (issue 11)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings
from django.core.signals import request_finished, request_started
from django.db import connection

ROOT = Path(__file__).resolve().parent.parent

READ_SETTINGS = """
import json, sys
if sys.argv[1] == "mcp":
    import os, django
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "refundops.settings")
    django.setup()
else:
    __import__(sys.argv[1])
from django.conf import settings
db = settings.DATABASES["default"]
print(json.dumps({"pool": db.get("OPTIONS", {}).get("pool"), "max_age": db["CONN_MAX_AGE"],
                  "health_checks": db["CONN_HEALTH_CHECKS"],
                  "celery_reuse": getattr(settings, "CELERY_DB_REUSE_MAX", None)}))
"""


def database_url() -> str:
    db = settings.DATABASES["default"]
    return f"postgres://{db['USER']}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


def settings_of(entry: str, *argv: str, **env: str) -> dict:
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_POOL", "DATABASE_CONN"))}
    environment.update(DATABASE_URL="postgres://postgres@127.0.0.1:5432/refundops", **env)
    out = subprocess.run([sys.executable, "-c", READ_SETTINGS, entry, *argv], cwd=ROOT, env=environment,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("entry", ["refundops.asgi", "mcp"])
def test_processes_that_run_each_request_in_its_own_thread_pool_their_connections(entry):
    # refundops.asgi: uvicorn (scripts/run) and gunicorn's UvicornWorker (gunicorn.conf.py, compose).
    # "mcp": `manage.py mcp` reads its settings with sys.argv[1] == "mcp", as here.
    found = settings_of(entry, "mcp")
    assert found["pool"] and found["pool"]["min_size"] >= 1 and found["max_age"] == 0


@pytest.mark.parametrize("entry", ["refundops.wsgi", "refundops.celery"])
def test_wsgi_workers_and_celery_keep_a_checked_connection(entry):
    found = settings_of(entry)
    assert found["pool"] is None
    assert found["max_age"] is None or found["max_age"] >= 60
    assert found["health_checks"] is True
    assert found["celery_reuse"] >= 100  # Celery's fix-up would otherwise close it around every task


def test_the_pool_and_the_age_can_still_be_chosen():
    assert settings_of("refundops.asgi", DATABASE_POOL="false", DATABASE_CONN_MAX_AGE="0")["pool"] is None
    assert settings_of("refundops.wsgi", DATABASE_POOL="true")["pool"]


@pytest.mark.django_db(transaction=True)
def test_two_requests_in_one_wsgi_thread_use_one_postgresql_backend():
    """Django's handler sends these signals around every request; with the defaults the connection
    stays open across them (a connection per request would show two backend pids)."""
    pids = []
    for _ in range(2):
        request_started.send(sender=None)
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            pids.append(cursor.fetchone()[0])
        request_finished.send(sender=None)
    assert pids[0] == pids[1]


POOLED_REQUESTS = """
import json, threading
import refundops.asgi  # noqa: F401 - the ASGI entry point, as uvicorn imports it
from django.db import connection

pids = []

def one_request():  # as under ASGI: a thread of its own, its connection closed when it ends
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_backend_pid()")
        pids.append(cursor.fetchone()[0])
    connection.close()

for _ in range(6):
    thread = threading.Thread(target=one_request)
    thread.start()
    thread.join()
print(json.dumps(pids))
"""


@pytest.mark.django_db(transaction=True)
def test_six_asgi_requests_each_in_a_thread_of_its_own_share_the_pools_connections():
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_POOL", "DATABASE_CONN"))}
    environment.update(DATABASE_URL=database_url(), DATABASE_POOL_MIN="1", DATABASE_POOL_MAX="2")
    out = subprocess.run([sys.executable, "-c", POOLED_REQUESTS], cwd=ROOT, env=environment, capture_output=True,
                         text=True, check=True).stdout
    pids = json.loads(out.strip().splitlines()[-1])
    assert len(pids) == 6 and len(set(pids)) <= 2  # without the pool: six connections, six pids


SERVED_REQUESTS = """
import asyncio, json
import refundops.asgi  # noqa: F401 - the ASGI entry point, as gunicorn's worker imports it
from django.db import connections

async def one():
    asked, sent = False, []
    async def receive():
        nonlocal asked
        if not asked:
            asked = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await asyncio.Event().wait()
    async def send(message):
        sent.append(message)
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "GET", "scheme": "http",
             "path": "/readyz", "raw_path": b"/readyz", "query_string": b"", "root_path": "",
             "server": ("localhost", 80), "client": ("127.0.0.1", 5000), "headers": [(b"host", b"localhost")]}
    await refundops.asgi.application(scope, receive, send)
    return sent[0]["status"]

async def main():
    return [await asyncio.create_task(one()) for _ in range(5)]

statuses = asyncio.run(main())
stats = connections["default"].pool.get_stats()
print(json.dumps({"statuses": statuses, **stats}))
"""


@pytest.mark.django_db(transaction=True)
def test_each_request_the_deployed_app_serves_checks_one_connection_out_of_the_pool_and_back():
    """Five requests through refundops.asgi.application (each reads the database: /readyz): five
    checkouts from the pool, every connection back in it after the last, none opened past those the
    pool opened as it filled. (Django keeps a connection per thread; the handler's threads live on, so it is
    request_finished, on the request's thread, that gives it back.)"""
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_POOL", "DATABASE_CONN"))}
    environment.update(DATABASE_URL=database_url(), DATABASE_POOL_MIN="1", DATABASE_POOL_MAX="2", DJANGO_DEBUG="true")
    out = subprocess.run([sys.executable, "-c", SERVED_REQUESTS], cwd=ROOT, env=environment, capture_output=True,
                         text=True, check=True).stdout
    found = json.loads(out.strip().splitlines()[-1])
    assert len(found["statuses"]) == 5
    assert found["requests_num"] == 5  # one checkout a request
    assert found["pool_available"] == found["pool_size"] <= 2  # each given back
    assert found["connections_num"] <= 2  # opened while the pool filled, none after
