"""Probes for load balancers and orchestrators.

``/healthz``: the process answers (liveness; it checks nothing else, so a Redis outage does not get
every web process restarted). ``/readyz``: the database, Redis (rate limits and breakers) and the
Celery broker answer; 503 naming each one that does not."""

from __future__ import annotations

import os
from collections.abc import Callable

import redis
from django.conf import settings
from django.db import connection
from django.http import JsonResponse
from django.views.decorators.cache import never_cache

from processors.redis_client import redis_client


def _database() -> None:
    with connection.cursor() as cursor:
        cursor.execute("SELECT 1")


def _redis() -> None:
    redis_client().ping()


def _broker() -> None:
    if settings.CELERY_BROKER_URL.startswith("redis"):
        client = redis.Redis.from_url(settings.CELERY_BROKER_URL, socket_connect_timeout=0.5, socket_timeout=1.0)
        try:
            client.ping()
        finally:
            client.close()
    else:  # embedded mode: kombu's filesystem transport needs its folder
        folder = settings.CELERY_BROKER_TRANSPORT_OPTIONS["data_folder_in"]
        if not os.access(folder, os.W_OK):
            raise FileNotFoundError(folder)


CHECKS: dict[str, tuple[Callable[[], None], str]] = {
    "database": (_database, "The database does not answer: check DATABASE_URL and that PostgreSQL is up."),
    "redis": (_redis, "Redis does not answer: rate limits and breakers fail closed. Check REDIS_URL."),
    "broker": (_broker, "The Celery broker does not answer: approved refunds cannot reach the worker."),
}


@never_cache
def healthz(request):
    return JsonResponse({"status": "ok"})


@never_cache
def readyz(request):
    results, down = {}, {}
    for name, (check, message) in CHECKS.items():
        try:
            check()
            results[name] = "ok"
        except Exception as error:  # any failure means not ready; the message says what to look at
            results[name] = "down"
            down[name] = f"{message} ({type(error).__name__})"
    if down:
        return JsonResponse({"status": "unavailable", "checks": results, "down": down,
                             "message": " ".join(down.values())}, status=503)
    return JsonResponse({"status": "ok", "checks": results})
