"""The circuit breaker over agent refund volume: a runaway agent (a loop, a prompt injection)
shows up as far more refunds, or far more money, than normal. State lives in Redis.

Each approved agent refund is counted in one-minute buckets: a number, and a value per currency.
The breaker trips when the last ``BREAKER_WINDOW_MINUTES`` hold more refunds, or more value in
one currency, than ``BREAKER_FACTOR`` times the normal rate: the average of the same span over
the ``BREAKER_BASELINE_MINUTES`` before. Floors (``BREAKER_MIN_COUNT``, and ``BREAKER_MIN_VALUE``
in major units of each currency) keep a quiet system from tripping on its first refunds.

closed → open: every agent refund answers 503 ``CIRCUIT_OPEN`` (the policy's check); operators
are alerted (ERROR log, mail to ``OPERATOR_EMAILS``, an audit entry).
open → half-open after ``BREAKER_COOLDOWN_SECONDS``: agent refunds go through again, as probes.
half-open → closed after ``BREAKER_HALF_OPEN_PROBES`` approved refunds while the volume is
normal; half-open → open again if a probe finds it still abnormal.

Callers pass ``now`` (tests move it). The refunds service records a refund once its transaction
commits: an outbox row that the outbox's sender counts itself, in its process (refundops.tasks,
``count_in_sender``), or that the relay hands to a worker (``count_agent_refund``). A trip's mail
to the operators is a task of its own, sent through the outbox when the breaker opens. A probe
counts only on the opening it was read under (the same ``opened_at``, checked in Redis), and a refund
is one probe however often its count is delivered (its id kept in the state), so racing
records never close a breaker that another count opened again; the one transition that alerts
(closed → open) is guarded in Redis (HSETNX), so operators hear of it once.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence
from contextlib import nullcontext
from datetime import datetime
from typing import Literal

import redis
import structlog
from redis.commands.core import Script
from django.conf import settings
from django.core.mail import mail_admins, send_mail
from django.db import transaction

from audit.services import record_audit
from processors.money import currency_exponent, format_minor
from refundops import outbox
from refundops.ratelimit import redis_client, redis_key, store_unavailable

log = logging.getLogger(__name__)

Phase = Literal["closed", "open", "half_open"]
ACTOR = "system:breaker"

DEFAULTS: dict[str, float] = {
    "BREAKER_WINDOW_MINUTES": 5, "BREAKER_BASELINE_MINUTES": 60, "BREAKER_FACTOR": 5.0,
    "BREAKER_MIN_COUNT": 100, "BREAKER_MIN_VALUE": 10_000, "BREAKER_COOLDOWN_SECONDS": 600,
    "BREAKER_HALF_OPEN_PROBES": 5,
}


def setting(name: str) -> float:
    return float(getattr(settings, name, DEFAULTS[name]))


def _state_key() -> str:
    return redis_key("{breaker}:state")


def _series_key(what: str) -> str:
    """One hash per series, a field per minute: two HMGETs read the whole baseline."""
    return redis_key(f"{{breaker}}:{what}")


def _phase(state: dict[bytes, bytes], now: datetime) -> Phase:
    opened_at = state.get(b"opened_at")
    if opened_at is None:
        return "closed"
    if now.timestamp() < float(opened_at) + setting("BREAKER_COOLDOWN_SECONDS"):
        return "open"
    return "half_open"


def status(*, now: datetime) -> Phase:
    try:
        return _phase(redis_client().hgetall(_state_key()), now)
    except redis.RedisError as exc:
        log.error("breaker: Redis unreachable (%s); failing closed", exc)
        raise store_unavailable("circuit breaker") from exc


def is_open(*, now: datetime) -> bool:
    """True while agent refunds must be refused. Half-open lets them through as probes."""
    return status(now=now) == "open"


_RECORD_LUA = """
-- KEYS: the counts, the values (of one currency), the state. ARGV: this minute, the amount, the
-- baseline's first minute, the baseline's length in minutes, the series' time to live.
local minute, first, baseline = tonumber(ARGV[1]), tonumber(ARGV[3]), tonumber(ARGV[4])
redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
redis.call('HINCRBY', KEYS[2], ARGV[1], ARGV[2])
local fields, stale = {}, {}
for m = first, minute do fields[#fields + 1] = m end
for m = first - 10, first - 1 do stale[#stale + 1] = m end
local sums = {0, 0, 0, 0}  -- the baseline's count and value, then the window's
for k = 1, 2 do
    for from = 1, #fields, 1000 do  -- Lua unpacks at most 8,000 values at once: a week's baseline is more
        local got = redis.call('HMGET', KEYS[k], unpack(fields, from, math.min(from + 999, #fields)))
        for j = 1, #got do
            if got[j] then
                local at = k + (from + j - 1 > baseline and 2 or 0)
                sums[at] = sums[at] + tonumber(got[j])
            end
        end
    end
    redis.call('HDEL', KEYS[k], unpack(stale))
    redis.call('EXPIRE', KEYS[k], ARGV[5])
end
local function text(n) return string.format('%d', n) end  -- whole, as text: Lua's numbers are doubles
return {text(sums[1]), text(sums[2]), text(sums[3]), text(sums[4]), redis.call('HGETALL', KEYS[3])}
"""


# A probe of the half-open breaker, counted only on the opening its reply was read under (the same
# opened_at): a count read half-open before another process (or an earlier reply of the batch)
# opened it again is no probe of the new opening. Closes it (deletes the state) at the last probe.
# A refund is one probe however often its count is delivered (at least once: a count whose row's
# mark failed is counted again by the relay's worker, a worker retries after a lost reply): its id
# is kept in the state (a field "probe:<id>", gone with the state); counted again, it is no probe.
# KEYS: the state. ARGV: opened_at as read, the probes needed, the refund's id (or "": none known).
# 1: closed now; 0: counted (or counted before); -1: stale.
_PROBE_LUA = """
if redis.call('HGET', KEYS[1], 'opened_at') ~= ARGV[1] then return -1 end
if ARGV[3] ~= '' and redis.call('HSETNX', KEYS[1], 'probe:' .. ARGV[3], 1) == 0 then return 0 end
if redis.call('HINCRBY', KEYS[1], 'successes', 1) < tonumber(ARGV[2]) then return 0 end
redis.call('DEL', KEYS[1])
return 1
"""


@functools.cache
def _probe_script(client: redis.Redis) -> Script:
    return client.register_script(_PROBE_LUA)


@functools.cache
def _record_script(client: redis.Redis) -> Script:
    """One per client: redis-py sends EVALSHA, and loads the script again after NOSCRIPT."""
    return client.register_script(_RECORD_LUA)


def record_refund(amount_minor: int, currency: str, now: datetime, *, refund_id: str = "") -> None:
    """Count one approved agent refund; trip, re-open or close the breaker as the volume says. The
    count, the sums of the baseline and of the window, the clean-up of minutes past the baseline
    and the state are one script in Redis (one round trip, a reply of six values, not the 130
    buckets a pipeline of HMGETs brought back to be summed here)."""
    record_refunds([(amount_minor, currency, now)], refund_ids=[refund_id], judged_alone=False)


def record_refunds(refunds: Sequence[tuple[int, str, datetime]], *,
                   request_ids: Sequence[str | None] | None = None, refund_ids: Sequence[str] | None = None,
                   judged_alone: bool = True) -> None:
    """:func:`record_refund` for several (the outbox's sender's batch): the scripts in one pipeline,
    one round trip; then each reply judged in turn, under the id of the request that approved it
    (``request_ids``); ``refund_ids``: each count's refund, one probe however often it is counted.
    Raises ApiError (SERVICE_UNAVAILABLE) when Redis is away: none was counted.
    ``judged_alone``: once counted, a refund whose judgement fails (its trip's audit entry not
    written) is logged and the others are judged, rather than have every count of the batch sent
    again; the breaker's state is in Redis already, and "breaker opened" logged at ERROR."""
    window = int(setting("BREAKER_WINDOW_MINUTES"))
    baseline = int(setting("BREAKER_BASELINE_MINUTES"))
    ttl = (window + baseline + 1) * 60
    calls = []
    for amount_minor, currency, now in refunds:
        minute = int(now.timestamp() // 60)
        first = minute - window - baseline + 1  # the baseline's first minute; the window ends at this one
        calls.append(([_series_key("n"), _series_key(f"v:{currency}"), _state_key()],
                      [minute, amount_minor, first, baseline, ttl]))
    client = redis_client()
    try:
        replies = _run_scripts(client, calls)
        moved = False  # a judgement opened or closed the breaker: the later replies' state is stale
        for i, ((_, currency, now), reply) in enumerate(zip(refunds, replies, strict=True)):
            request_id = request_ids[i] if request_ids else None
            with structlog.contextvars.bound_contextvars(request_id=request_id) if request_id else nullcontext():
                try:
                    if moved:  # every script ran before the first judgement: read the state as it is now
                        reply = [*reply[:4], [x for item in client.hgetall(_state_key()).items() for x in item]]
                    moved = _judge(client, reply, currency=currency, now=now, window=window, baseline=baseline,
                                   refund_id=refund_ids[i] if refund_ids else "") or moved
                except Exception:
                    if not judged_alone:
                        raise
                    moved = True  # it may have written the state before it failed
                    log.exception("breaker: a counted refund could not be judged")
    except redis.RedisError as exc:
        log.error("breaker: Redis unreachable (%s); failing closed", exc)
        raise store_unavailable("circuit breaker") from exc


def _run_scripts(client: redis.Redis, calls: list[tuple[list[str], list[int]]]) -> list:
    script = _record_script(client)
    if len(calls) == 1:
        (keys, args), = calls
        return [script(keys=keys, args=args, client=client)]  # redis-py loads it after NOSCRIPT
    for attempt in (1, 2):
        pipe = client.pipeline(transaction=False)
        for keys, args in calls:
            pipe.evalsha(script.sha, len(keys), *keys, *args)
        try:
            return pipe.execute()
        except redis.exceptions.NoScriptError:  # a restarted or flushed Redis: none of them ran
            if attempt == 2:
                raise
            client.script_load(script.script)
    raise AssertionError("unreachable")


def _judge(client: redis.Redis, reply: list, *, currency: str, now: datetime, window: int, baseline: int,
           refund_id: str = "") -> bool:
    """Trip, re-open or close the breaker as one counted refund's reply says; True if it opened or
    closed it."""
    base_count, base_value, count, value, state = reply
    base_count, base_value, count, value = (_integer(x) for x in (base_count, base_value, count, value))
    state = dict(zip(state[::2], state[1::2]))
    phase = _phase(state, now)
    factor = setting("BREAKER_FACTOR")
    count_limit = max(setting("BREAKER_MIN_COUNT"), factor * base_count * window / baseline)
    value_limit = max(setting("BREAKER_MIN_VALUE") * 10 ** currency_exponent(currency),
                      factor * base_value * window / baseline)
    why = (f"{count} agent refunds in {window} minutes, over the limit of {count_limit:.0f}"
           if count > count_limit else
           f"{format_minor(value, currency)} of agent refunds in {window} minutes, over the limit of "
           f"{format_minor(int(value_limit), currency)}" if value > value_limit else "")
    if why and phase in ("closed", "half_open"):
        _open(client, why=why, now=now, first=phase == "closed")
        return True
    if phase == "half_open":
        probes = int(setting("BREAKER_HALF_OPEN_PROBES"))
        if _probe_script(client)(keys=[_state_key()], args=[state[b"opened_at"], probes, refund_id or ""],
                                        client=client) == 1:
            log.warning("breaker closed: agent refund volume is normal again")
            record_audit(actor=ACTOR, action="breaker.closed", subject_type="breaker",
                         subject_id="agent_refunds", data={"at": now.isoformat()})
            return True
    return False


def _integer(reply: bytes | str | int) -> int:
    """A sum from the script, sent as text: Lua's numbers are doubles, whole and exact up to 2^53
    (9 * 10^15 minor units in 65 minutes of one currency's agent refunds)."""
    text = reply.decode() if isinstance(reply, bytes) else str(reply)
    if not text.lstrip("-").isdigit():
        raise redis.ResponseError(f"breaker: a sum out of range: {text}")
    return int(text)


def _open(client: redis.Redis, *, why: str, now: datetime, first: bool) -> None:
    if first and not client.hsetnx(_state_key(), "opened_at", now.timestamp()):
        return  # another process opened it a moment ago and alerted
    client.hset(_state_key(), mapping={"opened_at": now.timestamp(), "successes": 0, "reason": why})
    message = (f"Agent refunds are paused: {why}. The breaker half-opens after "
               f"{setting('BREAKER_COOLDOWN_SECONDS'):.0f} seconds. Investigate the agents now; the kill "
               f"switch (manage.py killswitch on) pauses them until you turn it off.")
    log.error("breaker opened: %s", why)
    with transaction.atomic():  # the entry and the mail's row: both or neither
        record_audit(actor=ACTOR, action="breaker.opened", subject_type="breaker", subject_id="agent_refunds",
                     data={"reason": why, "at": now.isoformat(), "reopened": not first})
        # Mailed by a worker (refundops.tasks.mail_operators) through the outbox: never from the
        # thread that counted (the outbox's sender, or a worker's count) nor from a request's.
        outbox.send_after_commit("refundops.tasks.mail_operators",
                                 {"subject": "RefundOps: agent refunds paused by the breaker", "message": message})


def mail_operators(subject: str, message: str) -> None:
    try:
        if settings.OPERATOR_EMAILS:
            send_mail(subject, message, settings.DEFAULT_FROM_EMAIL, settings.OPERATOR_EMAILS)
        else:
            mail_admins(subject, message)
    except Exception:  # an alert that cannot be mailed is still logged and audited
        log.exception("breaker: could not mail operators")
