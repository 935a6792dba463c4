"""Rate limits per agent, per agent session and global, in Redis, and the Redis connection that
the breaker shares.

Algorithm: an exact sliding window log. Each scope is a sorted set of request timestamps; one Lua
script (one round trip, atomic) drops the entries older than the window from every scope, and
either refuses the request (some scope already holds its limit) or adds it to every scope. A
refused request is never in any window, not even for an instant, so at most ``limit`` requests
are admitted in any window of ``RATE_LIMIT_WINDOW_SECONDS`` and a request that fits is never
refused for another's race. The embedded mode's in-process fakeredis runs the same script
(fakeredis[lua]).

Settings (env, see refundops.settings; 0 turns a scope off):
``RATE_LIMIT_AGENT_PER_MINUTE`` (600), ``RATE_LIMIT_SESSION_PER_MINUTE`` (300),
``RATE_LIMIT_GLOBAL_PER_MINUTE`` (6000), ``RATE_LIMIT_WINDOW_SECONDS`` (60).

Redis unreachable: calls that move money fail closed (503 ``SERVICE_UNAVAILABLE``); lookups go on.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import math
import secrets
import time
from dataclasses import dataclass
from datetime import UTC, datetime

import redis
from django.conf import settings
from redis.commands.core import Script
from rest_framework.permissions import SAFE_METHODS
from rest_framework.throttling import BaseThrottle

from processors.bodies import BodyTooLarge
from processors.redis_client import redis_client, redis_key
from refundops.callers import Caller
from refundops.errors import ApiError
from refundops.inputs import MAX_BODY_BYTES, TEXT_LIMITS, load_json_body
from refundops.models import AgentKey

log = logging.getLogger(__name__)



def store_unavailable(what: str) -> ApiError:
    return ApiError("SERVICE_UNAVAILABLE",
                    f"The {what} store (Redis) is unreachable, so calls that move money are refused "
                    f"until it is back. Lookups still work. Retry in a few seconds.",
                    headers={"Retry-After": "5"}, retry_after=5)


DEFAULTS = {"RATE_LIMIT_AGENT_PER_MINUTE": 600, "RATE_LIMIT_SESSION_PER_MINUTE": 300,
            "RATE_LIMIT_GLOBAL_PER_MINUTE": 6000, "RATE_LIMIT_WINDOW_SECONDS": 60}


def setting(name: str) -> int:
    return int(getattr(settings, name, DEFAULTS[name]))


@dataclass(frozen=True)
class Scope:
    name: str  # "agent", "session" or "global": named in the refusal
    key: str
    limit: int


def _digest(text: str) -> str:
    """A session id is the caller's text: hashed, so a key name stays short whatever it sends."""
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def scopes_for(*, agent_id: str, session_id: str | None) -> list[Scope]:
    scopes = [Scope("agent", redis_key(f"rl:agent:{agent_id}"), setting("RATE_LIMIT_AGENT_PER_MINUTE"))]
    if session_id:
        scopes.append(Scope("session", redis_key(f"rl:session:{agent_id}:{_digest(session_id)}"),
                            setting("RATE_LIMIT_SESSION_PER_MINUTE")))
    scopes.append(Scope("global", redis_key("rl:global"), setting("RATE_LIMIT_GLOBAL_PER_MINUTE")))
    return [s for s in scopes if s.limit > 0]


def check_rate_limits(*, caller: Caller, session_id: str | None = None, moves_money: bool = True,
                      now: float | None = None) -> None:
    """Count one request by ``caller`` or raise ``ApiError("RATE_LIMITED")`` with Retry-After.
    Staff callers are not rate limited. Used by the DRF throttle below and by the MCP server."""
    if caller.agent is None:
        return
    now = time.time() if now is None else now
    if session_id and len(session_id) > TEXT_LIMITS["session_id"]:
        session_id = None  # refused when the body is validated (REST and MCP alike): names no window
    if moves_money:  # no session named: the key's session for this hour
        session_id = caller.session_id_for(session_id or "", datetime.fromtimestamp(now, UTC))
    scopes = scopes_for(agent_id=caller.agent.id, session_id=session_id)
    if not scopes:
        return
    window = setting("RATE_LIMIT_WINDOW_SECONDS")
    try:
        over = _count(scopes, now=now, window=window)
    except redis.RedisError as exc:
        if not moves_money:
            log.warning("rate limits skipped for a lookup: Redis unreachable (%s)", exc)
            return
        log.error("rate limits: Redis unreachable (%s); failing closed", exc)
        raise store_unavailable("rate-limit") from exc
    if over:
        scope, wait = max(over, key=lambda o: o[1])
        retry_after = max(1, math.ceil(wait))
        raise ApiError("RATE_LIMITED",
                       f"Too many requests: the {scope.name} limit is {scope.limit} per {window} seconds. "
                       f"Retry after {retry_after} seconds.",
                       headers={"Retry-After": str(retry_after)}, retry_after=retry_after, scope=scope.name)


# KEYS: one sorted set per scope. ARGV: the request's timestamp, the window's start (entries at or
# before it have left), the keys' lifetime (seconds), the request's member, then each scope's limit
# in KEYS' order. Returns nothing when the request is admitted (counted in every scope); else, for
# each scope already at its limit, its position (1-based) and its oldest entry's timestamp, and the
# request is counted nowhere.
_COUNT_LUA = """
local over = {}
for i, key in ipairs(KEYS) do
    redis.call('ZREMRANGEBYSCORE', key, '-inf', ARGV[2])
    if redis.call('ZCARD', key) >= tonumber(ARGV[4 + i]) then
        over[#over + 1] = i
        over[#over + 1] = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')[2]
    end
end
if #over == 0 then
    for _, key in ipairs(KEYS) do
        redis.call('ZADD', key, ARGV[1], ARGV[4])
        redis.call('EXPIRE', key, ARGV[3])
    end
end
return over
"""


@functools.cache
def _count_script(client: redis.Redis) -> Script:
    """One per client: redis-py sends EVALSHA and loads the script again after NOSCRIPT (a
    restarted or flushed Redis)."""
    return client.register_script(_COUNT_LUA)


def _count(scopes: list[Scope], *, now: float, window: int) -> list[tuple[Scope, float]]:
    """Count one request in every scope, or in none: the scopes that are full, each with the
    seconds until its oldest entry leaves the window. Raises redis.RedisError."""
    member = f"{now:.6f}:{secrets.token_hex(4)}"
    client = redis_client()
    reply = _count_script(client)(keys=[scope.key for scope in scopes],
                                  args=[repr(now), repr(now - window), window + 1, member,
                                        *(scope.limit for scope in scopes)],
                                  client=client)
    # An entry stamped later than ``now`` (another host's clock) leaves a full window from now.
    return [(scopes[int(reply[i]) - 1], min(float(reply[i + 1]), now) + window - now)
            for i in range(0, len(reply), 2)]


def webhook_retry_after(*, gateway: str, source: str, now: float | None = None) -> int | None:
    """Count one delivery to ``/webhooks/<gateway>/`` from ``source`` (the client address); the
    seconds to wait when over ``RATE_LIMIT_WEBHOOK_PER_MINUTE``, else None. Without Redis it
    admits: events are verified and refusals stored bounded either way, and a gateway must not be
    refused for our outage."""
    limit = int(getattr(settings, "RATE_LIMIT_WEBHOOK_PER_MINUTE", 600))
    if limit <= 0:
        return None
    scope = Scope("webhook", redis_key(f"rl:webhook:{gateway}:{_digest(source)}"), limit)
    window = setting("RATE_LIMIT_WINDOW_SECONDS")
    try:
        over = _count([scope], now=time.time() if now is None else now, window=window)
    except redis.RedisError as exc:
        log.warning("webhook rate limit skipped: Redis unreachable (%s)", exc)
        return None
    return max(1, math.ceil(over[0][1])) if over else None


def _session_id_from_body(request) -> str | None:
    """The agent session named in a JSON body, if it parses. The body is validated later (the
    contract checks rate limits before the body), so anything unexpected here just means no
    session; a body too large to read is refused by the parser after this."""
    try:
        if int(request.META.get("CONTENT_LENGTH") or 0) > MAX_BODY_BYTES:
            return None
        data = load_json_body(request._request.body or b"null")
    except (ValueError, UnicodeDecodeError, BodyTooLarge):
        return None
    agent = data.get("agent") if isinstance(data, dict) else None
    session = agent.get("session_id") if isinstance(agent, dict) else None
    # One longer than the contract allows is refused when the body is validated: it names no window.
    if not isinstance(session, str) or not 0 < len(session) <= TEXT_LIMITS["session_id"]:
        return None
    return session


class AgentRateThrottle(BaseThrottle):
    """DRF's hook, which runs after authentication and the capability check, before the body.
    Answers through ApiError (429 RATE_LIMITED with Retry-After, or 503 SERVICE_UNAVAILABLE)."""

    def allow_request(self, request, view) -> bool:
        key = request.auth
        if not isinstance(key, AgentKey):
            return True
        moves_money = request.method not in SAFE_METHODS
        check_rate_limits(caller=Caller.for_key(key), moves_money=moves_money,
                          session_id=_session_id_from_body(request) if moves_money else None)
        return True

    def wait(self) -> float | None:
        return None
