"""One Redis client (and connection pool) per URL per process, for everything that keeps rebuildable
state in Redis: rate-limit windows, the refund breaker, the per-gateway breakers.

An in-process fakeredis when ``settings.REDIS_URL`` is empty (the embedded demo mode). Short
timeouts: failing closed fast beats holding a request while Redis is away."""

from __future__ import annotations

import threading

import redis
from django.conf import settings

_clients: dict[str, redis.Redis] = {}
_clients_lock = threading.Lock()


def redis_key(name: str) -> str:
    """Every key we write, under ``REDIS_KEY_PREFIX`` (empty by default), so that two installs or
    two test runs can share one Redis without reading each other's windows and breakers."""
    return f"{getattr(settings, 'REDIS_KEY_PREFIX', '')}refundops:{name}"


def redis_client() -> redis.Redis:
    url = settings.REDIS_URL
    client = _clients.get(url)
    if client is None:
        with _clients_lock:
            client = _clients.get(url)
            if client is None:
                if url:
                    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=1.0)
                else:
                    import fakeredis

                    client = fakeredis.FakeRedis()
                _clients[url] = client
    return client
