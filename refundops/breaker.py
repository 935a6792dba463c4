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
commits. Racing records can at worst close a half-open breaker a probe early; the one transition
that alerts (closed → open) is guarded in Redis (HSETNX), so operators hear of it once.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Literal

import redis
from django.conf import settings
from django.core.mail import mail_admins, send_mail
from django.db import transaction

from audit.services import record_audit
from processors.money import currency_exponent, format_minor
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


def record_refund(amount_minor: int, currency: str, now: datetime) -> None:
    """Count one approved agent refund; trip, re-open or close the breaker as the volume says."""
    window = int(setting("BREAKER_WINDOW_MINUTES"))
    baseline = int(setting("BREAKER_BASELINE_MINUTES"))
    minute = int(now.timestamp() // 60)
    minutes = list(range(minute - window - baseline + 1, minute + 1))
    stale = range(minutes[0] - 10, minutes[0])  # fields of minutes now past the baseline
    counts, values = _series_key("n"), _series_key(f"v:{currency}")
    client = redis_client()
    try:
        pipe = client.pipeline(transaction=True)
        pipe.hincrby(counts, minute, 1)
        pipe.hincrby(values, minute, amount_minor)
        pipe.hmget(counts, minutes)
        pipe.hmget(values, minutes)
        for key in (counts, values):
            pipe.hdel(key, *stale)
            pipe.expire(key, (window + baseline + 1) * 60)
        pipe.hgetall(_state_key())
        replies = pipe.execute()
        buckets = [(int(n or 0), int(v or 0)) for n, v in zip(replies[2], replies[3])]
        phase = _phase(replies[-1], now)
        base, recent = buckets[:baseline], buckets[baseline:]
        count, value = sum(n for n, _ in recent), sum(v for _, v in recent)
        factor = setting("BREAKER_FACTOR")
        count_limit = max(setting("BREAKER_MIN_COUNT"), factor * sum(n for n, _ in base) * window / baseline)
        value_limit = max(setting("BREAKER_MIN_VALUE") * 10 ** currency_exponent(currency),
                          factor * sum(v for _, v in base) * window / baseline)
        why = (f"{count} agent refunds in {window} minutes, over the limit of {count_limit:.0f}"
               if count > count_limit else
               f"{format_minor(value, currency)} of agent refunds in {window} minutes, over the limit of "
               f"{format_minor(int(value_limit), currency)}" if value > value_limit else "")
        if why and phase in ("closed", "half_open"):
            _open(client, why=why, now=now, first=phase == "closed")
        elif phase == "half_open":
            if client.hincrby(_state_key(), "successes", 1) >= setting("BREAKER_HALF_OPEN_PROBES"):
                client.delete(_state_key())
                log.warning("breaker closed: agent refund volume is normal again")
                record_audit(actor=ACTOR, action="breaker.closed", subject_type="breaker",
                             subject_id="agent_refunds", data={"at": now.isoformat()})
    except redis.RedisError as exc:
        log.error("breaker: Redis unreachable (%s); failing closed", exc)
        raise store_unavailable("circuit breaker") from exc


def _open(client: redis.Redis, *, why: str, now: datetime, first: bool) -> None:
    if first and not client.hsetnx(_state_key(), "opened_at", now.timestamp()):
        return  # another process opened it a moment ago and alerted
    client.hset(_state_key(), mapping={"opened_at": now.timestamp(), "successes": 0, "reason": why})
    message = (f"Agent refunds are paused: {why}. The breaker half-opens after "
               f"{setting('BREAKER_COOLDOWN_SECONDS'):.0f} seconds. Investigate the agents now; the kill "
               f"switch (manage.py killswitch on) pauses them until you turn it off.")
    log.error("breaker opened: %s", why)
    record_audit(actor=ACTOR, action="breaker.opened", subject_type="breaker", subject_id="agent_refunds",
                 data={"reason": why, "at": now.isoformat(), "reopened": not first})
    transaction.on_commit(lambda: _mail_operators("RefundOps: agent refunds paused by the breaker", message))


def _mail_operators(subject: str, message: str) -> None:
    try:
        if settings.OPERATOR_EMAILS:
            send_mail(subject, message, settings.DEFAULT_FROM_EMAIL, settings.OPERATOR_EMAILS)
        else:
            mail_admins(subject, message)
    except Exception:  # an alert that cannot be mailed is still logged and audited
        log.exception("breaker: could not mail operators")
