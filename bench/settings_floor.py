"""The floor: the same project, database and server, serving only bench.floor's bare view, with no
middleware and a connection that is never closed between requests (the psycopg pool where the
platform's defaults choose it, as under ASGI; else a persistent connection with no health check)."""

from bench.settings_full import *  # noqa: F403

ROOT_URLCONF = "bench.floor"
MIDDLEWARE: list[str] = []
if "pool" not in DATABASES["default"].get("OPTIONS", {}):  # noqa: F405
    DATABASES["default"].update({"CONN_MAX_AGE": None, "CONN_HEALTH_CHECKS": False})  # noqa: F405
