"""A circuit breaker per gateway and account: stop calling a gateway that keeps failing.

closed: calls go through; each unavailable answer (down, slow, rate limited) adds one to a count,
each other answer clears it. ``GATEWAY_BREAKER_THRESHOLD`` unavailable answers in a row open it.
open: for ``GATEWAY_BREAKER_COOLDOWN_SECONDS`` (30, or the worker's longest backoff if shorter)
nobody calls; :func:`wait_seconds` says how long to wait, and the worker reschedules without
calling.
half-open: after the cool-down one caller (a Redis ``SET NX`` token) gets to try; success closes
the breaker, another unavailable answer opens it again for a new cool-down.

State lives in Redis (shared by every worker, rebuilt from nothing if lost). Redis away: the
breaker answers "wait", so money-moving calls fail closed as everything else does.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Literal

import redis
from django.conf import settings

from processors.redis_client import redis_client, redis_key

log = logging.getLogger(__name__)

Phase = Literal["closed", "open", "half_open"]
DEFAULTS = {"GATEWAY_BREAKER_THRESHOLD": 5, "GATEWAY_BREAKER_COOLDOWN_SECONDS": 30.0}
REDIS_AWAY_WAIT_SECONDS = 5.0



@dataclass(frozen=True, slots=True)
class BreakerState:
    gateway: str
    account: str
    phase: Phase
    failures: int
    retry_in: float  # seconds until a call may be tried; 0 when closed


def _setting(name: str) -> float:
    value = float(getattr(settings, name, DEFAULTS[name]))
    if name == "GATEWAY_BREAKER_COOLDOWN_SECONDS":
        # Never rest longer than the worker's own longest backoff would wait anyway.
        value = min(value, float(getattr(settings, "REFUND_SUBMIT_BACKOFF_MAX_SECONDS", value)))
    return value


def _key(gateway: str, account: str) -> str:
    return redis_key(f"gwbreaker:{gateway}:{account}")


def state(gateway: str, account: str, *, now: float | None = None) -> BreakerState:
    now = time.time() if now is None else now
    raw = redis_client().hgetall(_key(gateway, account))
    failures = int(raw.get(b"failures", 0))
    open_until = float(raw.get(b"open_until", 0))
    if not open_until:
        return BreakerState(gateway, account, "closed", failures, 0.0)
    if now < open_until:
        return BreakerState(gateway, account, "open", failures, open_until - now)
    return BreakerState(gateway, account, "half_open", failures, 0.0)


def describe(gateway: str, account: str) -> BreakerState | None:
    """The state for a dashboard; None when Redis cannot be asked."""
    try:
        return state(gateway, account)
    except redis.RedisError:
        return None


def wait_seconds(gateway: str, account: str, *, now: float | None = None) -> float:
    """0 when this caller may call the gateway now; otherwise how long to wait first."""
    try:
        current = state(gateway, account, now=now)
        if current.phase == "closed":
            return 0.0
        if current.phase == "open":
            return current.retry_in
        # Half-open: one probe at a time; the token expires in case the prober dies mid-call.
        cooldown = _setting("GATEWAY_BREAKER_COOLDOWN_SECONDS")
        if redis_client().set(_key(gateway, account) + ":probe", 1, nx=True, px=int(cooldown * 1000) or 1):
            return 0.0
        return cooldown
    except redis.RedisError:
        log.error("gateway breaker: Redis unreachable; not calling %s/%s", gateway, account)
        return REDIS_AWAY_WAIT_SECONDS


def record_success(gateway: str, account: str) -> None:
    """The gateway answered (yes or a final no): it is reachable, so the breaker closes."""
    try:
        redis_client().delete(_key(gateway, account), _key(gateway, account) + ":probe")
    except redis.RedisError:
        log.error("gateway breaker: Redis unreachable; could not close %s/%s", gateway, account)


def record_unavailable(gateway: str, account: str, *, now: float | None = None) -> BreakerState:
    now = time.time() if now is None else now
    key = _key(gateway, account)
    try:
        was = state(gateway, account, now=now)
        failures = int(redis_client().hincrby(key, "failures", 1))
        if was.phase == "half_open" or (was.phase == "closed"
                                         and failures >= _setting("GATEWAY_BREAKER_THRESHOLD")):
            cooldown = _setting("GATEWAY_BREAKER_COOLDOWN_SECONDS")
            pipe = redis_client().pipeline()
            pipe.hset(key, "open_until", now + cooldown)
            pipe.delete(key + ":probe")
            pipe.execute()
            log.warning("gateway breaker: %s/%s open for %.0fs after %s unavailable answers",
                        gateway, account, cooldown, failures)
        return state(gateway, account, now=now)
    except redis.RedisError:
        log.error("gateway breaker: Redis unreachable; could not count a failure of %s/%s",
                  gateway, account)
        return BreakerState(gateway, account, "open", 0, REDIS_AWAY_WAIT_SECONDS)
