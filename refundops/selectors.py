"""Reads: running totals, the active policy, the shapes agents see."""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta, tzinfo

from django.db import DEFAULT_DB_ALIAS
from django.db.models import Count, JSONField, Q, Sum
from django.utils import timezone

from refundops.models import (
    BUCKET_SECONDS,
    COUNTING_STATES,
    HoldRules,
    Payment,
    PlatformState,
    PolicyDraft,
    Refund,
    RefundLimits,
    RefundTotalDelta,
)
from refundops.policy import Totals
from refundops.rows import kept_types, db


def active_limits(currency: str) -> RefundLimits | None:
    return RefundLimits.objects.filter(currency=currency).order_by("-version").first()


def active_rules() -> HoldRules | None:
    return HoldRules.objects.order_by("-version").first()


def shadow_drafts(currency: str) -> list[PolicyDraft]:
    """Drafts running in shadow for a request in ``currency``: its limits draft, the hold rules draft."""
    return list(PolicyDraft.objects.filter(shadow=True, status__in=(PolicyDraft.Status.DRAFT, PolicyDraft.Status.PROPOSED))
                .filter(Q(kind=PolicyDraft.Kind.RULES) | Q(kind=PolicyDraft.Kind.LIMITS, currency=currency)))


# The three reads above in one round trip (PostgreSQL): each row as JSON, made back into the model
# the ORM would have returned (the same rows, the same order: the latest version first, drafts
# newest first). The ORM's three statements cost more to compile than to run.
_POLICY_SQL = ("""
SELECT (SELECT row_to_json(l) FROM (SELECT * FROM {limits} WHERE currency = %(currency)s
                                    ORDER BY version DESC LIMIT 1) l),
       (SELECT row_to_json(r) FROM (SELECT * FROM {rules} ORDER BY version DESC LIMIT 1) r),
       (SELECT json_agg(d ORDER BY d.created_at DESC) FROM {drafts} d
         WHERE %(shadows)s AND d.shadow AND d.status IN (%(draft)s, %(proposed)s)
           AND (d.kind = %(rules_kind)s OR (d.kind = %(limits_kind)s AND d.currency = %(currency)s)))
""".format(limits=RefundLimits._meta.db_table, rules=HoldRules._meta.db_table, drafts=PolicyDraft._meta.db_table))


def policy_in_force(currency: str, *, shadows: bool = True) -> tuple[RefundLimits | None, HoldRules | None,
                                                                     list[PolicyDraft]]:
    """``active_limits(currency)``, ``active_rules()`` and (when ``shadows``) ``shadow_drafts(currency)``,
    in one statement."""
    wrapper = db()
    if wrapper.vendor != "postgresql":
        return active_limits(currency), active_rules(), shadow_drafts(currency) if shadows else []
    with wrapper.cursor() as cursor:
        cursor.execute(_POLICY_SQL, {"currency": currency, "shadows": shadows,
                                     "draft": str(PolicyDraft.Status.DRAFT),
                                     "proposed": str(PolicyDraft.Status.PROPOSED),
                                     "rules_kind": str(PolicyDraft.Kind.RULES),
                                     "limits_kind": str(PolicyDraft.Kind.LIMITS)})
        limits, rules, drafts = cursor.fetchone()
    return (_from_json(RefundLimits, limits), _from_json(HoldRules, rules),
            [_from_json(PolicyDraft, draft) for draft in drafts or ()])


def _from_json(model, row: dict | None):
    """A row read as JSON (``row_to_json``), as the ORM would have made it: each value through its
    field's to_python, unless JSON already gives it in the type to_python returns as it is."""
    if row is None:
        return None
    names, columns = _json_columns(model)
    return model.from_db(DEFAULT_DB_ALIAS, names,
                         [value if value is None or keep or type(value) in as_is else field.to_python(value)
                          for field, keep, as_is in columns for value in (row[field.column],)])


@functools.cache
def _json_columns(model) -> tuple[list[str], list[tuple]]:
    fields = model._meta.concrete_fields
    return [f.attname for f in fields], [(f, isinstance(f, JSONField), kept_types(f)) for f in fields]


def limits_zone() -> tzinfo:
    """The zone whose days the daily limits count: ``TIME_ZONE`` (settings, from the environment),
    the same for every merchant and currency. Not the thread's active zone (``timezone.activate``):
    a zone shown to a person must never move the limits' day."""
    return timezone.get_default_timezone()


def start_of_local_day(day: date, zone: tzinfo | None = None) -> datetime:
    """The first instant (in UTC) of the local date ``day`` in ``zone`` (default: ``limits_zone()``).
    Where the clocks fall back at midnight, midnight happens twice: the first one (fold 0). Where
    they spring forward over it, midnight never happens: the day starts at the jump."""
    zone = zone or limits_zone()
    midnight = datetime.combine(day, time(0))

    def reached(instant: datetime) -> bool:
        return instant.astimezone(zone).replace(tzinfo=None) >= midnight

    # The two readings of midnight: the same instant, the two occurrences (earlier first), or, if
    # the clocks skip it, one instant either side of the jump.
    early, late = sorted(midnight.replace(tzinfo=zone, fold=fold).astimezone(UTC) for fold in (0, 1))
    if reached(early):
        return early
    while late - early > timedelta(microseconds=1):  # skipped: find the jump (clocks only go forward here)
        middle = early + (late - early) // 2
        early, late = (early, middle) if reached(middle) else (middle, late)
    return late


def start_of_day(now: datetime, zone: tzinfo | None = None) -> datetime:
    """The first instant (in UTC) of ``now``'s local day in ``zone`` (default: ``limits_zone()``)."""
    zone = zone or limits_zone()
    return start_of_local_day(timezone.localtime(now, zone).date(), zone)


@dataclass(frozen=True)
class LimitWindows:
    """Where each window of the running totals starts (in UTC) for a decision at ``now``: a refund
    counts in a window when its ``counted_at`` is at or after the start. The day is local
    (``limits_zone()``); the others are elapsed time, whatever the clocks do in between."""

    day: datetime  # today's first instant: the daily limits (customer, agent, global)
    day_end: datetime  # tomorrow's first instant: a refund counted from then on is tomorrow's, not today's
    hour: datetime  # an hour ago: the agent's hourly limit
    month: datetime  # 30 x 24 hours ago: the customer's 30 days
    velocity: datetime  # the hold rules' velocity window
    cumulative: datetime  # the limits' cumulative window (the asker's kind's refunds to a customer)


def limit_windows(now: datetime, *, velocity_hours: int = 24, cumulative_hours: int = 24,
                  zone: tzinfo | None = None) -> LimitWindows:
    """The windows of a decision at ``now`` (aware, in any zone): one plain computation that the
    statement, the ORM reading and any reference model share."""
    now = timezone.localtime(now, UTC)  # elapsed arithmetic: an aware local time would add wall-clock hours
    zone = zone or limits_zone()
    today = timezone.localtime(now, zone).date()
    # The day is bounded at its end: a decision that took its instant before midnight and got its locks
    # after another's, counted after midnight, is still the first of its day (elapsed windows are not).
    return LimitWindows(day=start_of_local_day(today, zone),
                        day_end=start_of_local_day(today + timedelta(days=1), zone),
                        hour=now - timedelta(hours=1),
                        month=now - timedelta(days=30), velocity=now - timedelta(hours=velocity_hours),
                        cumulative=now - timedelta(hours=cumulative_hours))


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def first_bucket_from(at: datetime) -> datetime:
    """The first bucket boundary of refundops.models.totals at or after ``at`` (``at`` itself at
    midnight in any UTC offset in use): the day's totals are its buckets from there, and the
    refunds between ``at`` and it, summed."""
    since = at - _EPOCH  # exact, in whole microseconds
    micros = (since.days * 86_400 + since.seconds) * 1_000_000 + since.microseconds
    return _EPOCH + timedelta(seconds=-(-micros // (BUCKET_SECONDS * 1_000_000)) * BUCKET_SECONDS)


def last_bucket_until(at: datetime) -> datetime:
    """The start of the last whole bucket that ends at or before ``at``: the day's kept buckets are
    those from ``first_bucket_from(day)`` to this (excluded), and the refunds from here to ``at``
    are summed."""
    first = first_bucket_from(at)
    return first if first == at else first - timedelta(seconds=BUCKET_SECONDS)


def _sql_literal(value: str | tuple[str, ...]) -> str:
    """A value fixed by the code (a state, an origin, a tuple of them as an array), spelled in the
    statement as psycopg would bind it: not a parameter adapted again on every request. Plain
    lowercase names only, so nothing in it needs quoting."""
    names = (value,) if isinstance(value, str) else value
    if not all(re.fullmatch(r"[a-z_]+", str(name)) for name in names):
        raise ValueError(f"not a plain name: {value!r}")
    return f"'{value}'" if isinstance(value, str) else "'{" + ",".join(str(name) for name in names) + "}'"


# One round trip: the service reads these while it holds its scopes' locks (refundops.locks), and
# the kill switch with them: read after the platform lock is taken, it is the one the decision sees.
# Scalar subqueries let each scope use its own index (customer via the payment, agent, day, payment);
# the customer's refunds are found through the customer's payments (OFFSET 0 keeps the planner
# from turning that into a scan of every recent refund).
_TOTALS_SQL = ("""
WITH x AS (  -- the refund being decided: the kept buckets count it if it counts
  SELECT amount_minor, agent_id, counted_at FROM {refund}
   WHERE id = %(exclude)s AND status = ANY({states}) AND currency = %(currency)s)
SELECT
  pr.count,
  c.day_count, c.day_sum, c.month_count, c.month_sum, c.velocity,
  ad.hour_sum + a.hour_edge_sum
  - COALESCE((SELECT amount_minor FROM x WHERE agent_id = %(agent)s AND counted_at >= %(hour_bucket)s), 0),
  ad.day_sum + a.day_edge_sum
  - COALESCE((SELECT amount_minor FROM x WHERE agent_id = %(agent)s AND counted_at >= %(day_bucket)s
                AND counted_at < %(day_end_bucket)s), 0),
  a.session_sum,
  (SELECT COALESCE(SUM(amount_minor), 0) FROM {deltas}
    WHERE currency = %(currency)s AND agent_id = '' AND bucket >= %(day_bucket)s AND bucket < %(day_end_bucket)s)
  - COALESCE((SELECT amount_minor FROM x WHERE counted_at >= %(day_bucket)s AND counted_at < %(day_end_bucket)s), 0)
  + (SELECT COALESCE(SUM(amount_minor), 0) FROM {refund}
      WHERE status = ANY({states}) AND currency = %(currency)s AND id <> %(exclude)s
        AND ((counted_at >= %(day)s AND counted_at < %(day_bucket)s)
             OR (counted_at >= %(day_end_bucket)s AND counted_at < %(day_end)s))),
  pr.agents_sum, c.agents_window_sum,
  COALESCE((SELECT refunds_paused OR agents_disabled FROM {platform} WHERE id = 1), false),
  COALESCE((SELECT MAX(version) FROM {limits} WHERE currency = %(currency)s), 0)
FROM
  (SELECT COUNT(*) AS count, COALESCE(SUM(amount_minor) FILTER (WHERE origin = %(cumulative_origin)s), 0) AS agents_sum
     FROM {refund} WHERE payment_id = %(payment)s AND status = ANY({states}) AND id <> %(exclude)s) pr,
  (SELECT COUNT(*) FILTER (WHERE r.counted_at >= %(day)s AND r.counted_at < %(day_end)s) AS day_count,
          COALESCE(SUM(r.amount_minor) FILTER (WHERE r.counted_at >= %(day)s AND r.counted_at < %(day_end)s), 0)
            AS day_sum,
          COUNT(*) FILTER (WHERE r.counted_at >= %(month)s) AS month_count,
          COALESCE(SUM(r.amount_minor) FILTER (WHERE r.counted_at >= %(month)s), 0) AS month_sum,
          COUNT(*) FILTER (WHERE r.counted_at >= %(velocity)s) AS velocity,
          COALESCE(SUM(r.amount_minor) FILTER (WHERE r.counted_at >= %(cumulative)s AND r.origin = %(cumulative_origin)s), 0)
            AS agents_window_sum
     FROM {payment} p CROSS JOIN LATERAL (
          SELECT amount_minor, counted_at, origin FROM {refund}
           WHERE payment_id = p.id AND status = ANY({states}) AND currency = %(currency)s
             AND counted_at >= LEAST(%(month)s, %(velocity)s, %(cumulative)s) AND id <> %(exclude)s
          OFFSET 0) r
    WHERE p.customer_id = %(customer)s) c,
  -- the agent's hour and day from the kept quarter hours ...
  (SELECT COALESCE(SUM(amount_minor) FILTER (WHERE bucket >= %(hour_bucket)s), 0) AS hour_sum,
          COALESCE(SUM(amount_minor) FILTER (WHERE bucket >= %(day_bucket)s AND bucket < %(day_end_bucket)s), 0)
            AS day_sum
     FROM {deltas}
    WHERE currency = %(currency)s AND agent_id = %(agent)s AND bucket >= LEAST(%(hour_bucket)s, %(day_bucket)s)) ad,
  -- ... and from its refunds before the first of them (the hour's first minutes: at most a quarter
  -- hour), and those of its session
  (SELECT COALESCE(SUM(amount_minor) FILTER (WHERE counted_at >= %(hour)s AND counted_at < %(hour_bucket)s), 0)
            AS hour_edge_sum,
          COALESCE(SUM(amount_minor) FILTER (WHERE (counted_at >= %(day)s AND counted_at < %(day_bucket)s)
                                            OR (counted_at >= %(day_end_bucket)s AND counted_at < %(day_end)s)), 0)
            AS day_edge_sum,
          COALESCE(SUM(amount_minor) FILTER (WHERE %(session)s <> '' AND agent_session_id = %(session)s), 0)
            AS session_sum
     FROM {refund}
    WHERE agent_id = %(agent)s AND status = ANY({states}) AND currency = %(currency)s AND id <> %(exclude)s
      AND ((counted_at >= %(hour)s AND counted_at < %(hour_bucket)s)
           OR (counted_at >= %(day)s AND counted_at < %(day_bucket)s)
           OR (counted_at >= %(day_end_bucket)s AND counted_at < %(day_end)s)
           OR (%(session)s <> '' AND agent_session_id = %(session)s))) a
""".format(refund=Refund._meta.db_table, payment=Payment._meta.db_table,
           platform=PlatformState._meta.db_table, limits=RefundLimits._meta.db_table,
           deltas=RefundTotalDelta._meta.db_table,
           states=_sql_literal(COUNTING_STATES)))


def running_totals(*, payment: Payment, agent_id: str | None, session_id: str, now: datetime,
                   velocity_hours: int = 24, cumulative_hours: int = 24, exclude_refund_id: str = "") -> Totals:
    """What every scope has already refunded in the payment's currency (the payment's own refunds in
    any currency), counting each refund that is not denied, rejected, expired, canceled or failed,
    whoever made it (agent, staff, gateway). ``exclude_refund_id``: the refund being decided, when it is already written."""
    return totals_and_pause(payment=payment, agent_id=agent_id, session_id=session_id, now=now,
                            velocity_hours=velocity_hours, cumulative_hours=cumulative_hours,
                            exclude_refund_id=exclude_refund_id)[0]


def totals_and_pause(*, payment: Payment, agent_id: str | None, session_id: str, now: datetime,
                     velocity_hours: int = 24, cumulative_hours: int = 24,
                     exclude_refund_id: str = "") -> tuple[Totals, bool, int]:
    """``running_totals``, and in the same statement whether agent refunds are paused (the kill
    switch, or all agents switched off: a request whose key was checked before the switch is decided
    after it) and the latest version of the currency's limits (0: none), as read after the decision's
    locks."""
    params = _totals_params(payment=payment, agent_id=agent_id, session_id=session_id, now=now,
                            velocity_hours=velocity_hours, cumulative_hours=cumulative_hours,
                            exclude_refund_id=exclude_refund_id)
    wrapper = db()
    if wrapper.vendor != "postgresql":
        latest = active_limits(payment.currency)
        state = PlatformState.current()
        return (_running_totals_orm(params), state.refunds_paused or state.agents_disabled,
                latest.version if latest else 0)
    with wrapper.cursor() as cursor:
        # The states are in the statement (fixed by the code), not adapted again on every request
        # (the array element by element).
        cursor.execute(_TOTALS_SQL, {k: v for k, v in params.items() if k != "states"})
        *totals, paused, limits_version = cursor.fetchone()
    return Totals(*(int(v) for v in totals)), bool(paused), int(limits_version)


def _totals_params(*, payment: Payment, agent_id: str | None, session_id: str, now: datetime, velocity_hours: int,
                   cumulative_hours: int, exclude_refund_id: str) -> dict:
    windows = limit_windows(now, velocity_hours=velocity_hours, cumulative_hours=cumulative_hours)
    return {"exclude": exclude_refund_id, "payment": payment.pk, "customer": payment.customer_id, "currency": payment.currency,
            # None, not "": the currency's own buckets are kept under agent_id "" (models/totals.py)
            "agent": agent_id or None, "session": session_id or "", "states": [str(s) for s in COUNTING_STATES],
            "day": windows.day, "day_bucket": first_bucket_from(windows.day),
            "day_end": windows.day_end, "day_end_bucket": last_bucket_until(windows.day_end),
            "hour": windows.hour, "hour_bucket": first_bucket_from(windows.hour), "month": windows.month,
            "velocity": windows.velocity, "cumulative": windows.cumulative,
            # The cumulative threshold adds up refunds of the asker's kind: agents', or people's.
            "cumulative_origin": str(Refund.Origin.AGENT if agent_id else Refund.Origin.STAFF)}


def running_totals_orm(*, payment: Payment, agent_id: str | None, session_id: str, now: datetime,
                       velocity_hours: int = 24, cumulative_hours: int = 24, exclude_refund_id: str = "") -> Totals:
    """``running_totals`` as the embedded SQLite mode reads them (the refunds summed through the ORM, no
    kept totals), on any database: what the statement's reading must agree with."""
    return _running_totals_orm(_totals_params(payment=payment, agent_id=agent_id, session_id=session_id, now=now,
                                              velocity_hours=velocity_hours, cumulative_hours=cumulative_hours,
                                              exclude_refund_id=exclude_refund_id))


def _running_totals_orm(p: dict) -> Totals:
    """The same totals through the ORM, for the embedded SQLite mode (and to check the SQL above)."""
    counting = (Refund.objects.filter(status__in=p["states"], currency=p["currency"])
                .exclude(pk=p["exclude"]))

    def total(q: Q) -> Sum:
        return Sum("amount_minor", filter=q, default=0)

    # The asker's kind, as cumulative_origin in the statement (Totals.agents_payment_minor).
    by_agents = Q(origin=Refund.Origin.AGENT if p["agent"] else Refund.Origin.STAFF)
    today = Q(counted_at__gte=p["day"], counted_at__lt=p["day_end"])
    customer = counting.filter(payment__customer_id=p["customer"],
                               counted_at__gte=min(p["month"], p["velocity"], p["cumulative"])).aggregate(
        day_count=Count("id", filter=today), day_sum=total(today),
        m_count=Count("id", filter=Q(counted_at__gte=p["month"])), m_sum=total(Q(counted_at__gte=p["month"])),
        velocity=Count("id", filter=Q(counted_at__gte=p["velocity"])),
        agents=total(by_agents & Q(counted_at__gte=p["cumulative"])))
    # The payment's refunds in every currency, as the statement counts them (a refund is written in
    # its payment's currency; counting any other too is the stricter reading).
    on_payment = (Refund.objects.filter(status__in=p["states"], payment_id=p["payment"]).exclude(pk=p["exclude"])
                  .aggregate(count=Count("id"), agents=total(by_agents)))
    agent = {"hour": 0, "day": 0, "session": 0}
    if p["agent"]:
        in_session = Q(agent_session_id=p["session"]) if p["session"] else Q(pk__in=[])
        recent = Q(counted_at__gte=min(p["day"], p["hour"]))
        agent = counting.filter(agent_id=p["agent"]).filter(recent | in_session).aggregate(
            hour=total(Q(counted_at__gte=p["hour"])), day=total(today),
            session=total(in_session))
    return Totals(
        payment_refund_count=on_payment["count"],
        customer_day_count=customer["day_count"], customer_day_minor=customer["day_sum"],
        customer_30d_count=customer["m_count"], customer_30d_minor=customer["m_sum"],
        customer_velocity_count=customer["velocity"], agent_hour_minor=agent["hour"],
        agent_day_minor=agent["day"], session_minor=agent["session"],
        global_day_minor=counting.filter(today).aggregate(s=total(Q()))["s"],
        agents_payment_minor=on_payment["agents"], agents_customer_window_minor=customer["agents"])


def payment_json(payment: Payment) -> dict:
    """What ``payments.read`` may see: amounts, state, method type and last four. Never card data."""
    return {
        "id": payment.pk, "status": payment.status, "currency": payment.currency,
        "amount_authorized": payment.amount_authorized_minor, "amount_captured": payment.amount_captured_minor,
        "amount_refunded": payment.amount_refunded_minor, "amount_refund_pending": payment.amount_reserved_minor,
        "amount_refundable": max(payment.refundable_minor, 0),
        "method": {"type": payment.method_type, "brand": payment.method_brand or None,
                   "last4": payment.method_last4 or None},
        "customer_id": payment.customer_id, "order_reference": payment.order_reference or None,
        "order_amount": payment.order_amount_minor, "amount_owed": payment.amount_owed_minor,
        "dispute_status": payment.dispute_status, "fraud_flagged": bool(payment.fraud_flags),
        "processor": payment.processor,
        "captured_at": payment.captured_at.isoformat() if payment.captured_at else None,
    }
