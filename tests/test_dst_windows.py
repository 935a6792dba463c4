"""Daylight-saving nights and odd offsets (issue 27, finding 2): every window the limits count in
starts where a plain computation over the refunds' instants says, whatever the clocks do.

The limits' day is the local day of ``TIME_ZONE`` (the only source of it: no merchant or limits
row carries a zone). Where the clocks fall back at midnight (Atlantic/Azores, America/Havana) the
day's first hour happens twice: a refund in the first of them is today's, and still is during the
second. Where they spring forward at midnight (America/Santiago, Asia/Beirut, Africa/Cairo,
America/Havana, Atlantic/Azores in spring) midnight never happens: the day starts at the jump."""

from __future__ import annotations

import functools
import threading
import uuid
from datetime import UTC, date, datetime, time, timedelta
from zoneinfo import ZoneInfo

import pytest
import time_machine
from django.test import override_settings

from refundops.callers import Caller
from refundops.models import COUNTING_STATES, Refund, RefundState
from refundops.policy import Totals
from refundops.services.refunds import request_refund
from tests.conftest import make_agent_key, make_customer, make_limits, make_payment, make_rules, race

LOOSE = 10**12


def local(zone: str, day: date, hour: int, minute: int = 0, *, fold: int = 0) -> datetime:
    """The instant (UTC) the clocks of ``zone`` show ``day hour:minute`` (the second time when ``fold``)."""
    return datetime.combine(day, time(hour, minute), tzinfo=ZoneInfo(zone)).replace(fold=fold).astimezone(UTC)


# Clocks fall back from 01:00 to 00:00: 00:30 happens twice, an hour apart.
FALL_BACK_AT_MIDNIGHT = [("Atlantic/Azores", date(2026, 10, 25)), ("America/Havana", date(2026, 11, 1))]


def _ask(caller: Caller, payment, amount: int, at: datetime):
    with time_machine.travel(at, tick=False):
        return request_refund(caller=caller, data={"transaction_id": payment.pk, "reason": "duplicate",
                                                   "amount": amount}, idempotency_key=uuid.uuid4().hex)


@pytest.mark.parametrize("zone, day", FALL_BACK_AT_MIDNIGHT)
@pytest.mark.parametrize("limit, same_customer", [
    ("customer_daily_count", True), ("customer_daily_amount_minor", True),
    ("global_daily_amount_minor", False), ("agent_daily_amount_minor", False)])
def test_a_midnight_that_happens_twice_does_not_double_a_daily_limit(db, settings, zone, day, limit, same_customer):
    """The issue's night: two 100.00 refunds at 00:30 local, an hour apart, against a limit of one
    refund (or 100.00) a day. The second is today's second: refused. Before the fix the day began
    at the second midnight, the first refund was yesterday's, and both were approved."""
    settings.TIME_ZONE = zone
    settings.BREAKER_MIN_COUNT = 10**6
    first, second = local(zone, day, 0, 30), local(zone, day, 0, 30, fold=1)
    assert second - first == timedelta(hours=1)
    with time_machine.travel(first - timedelta(days=1), tick=False):
        make_limits(allowed_reasons=["duplicate"], **{
            "customer_daily_count": 1_000, "customer_daily_amount_minor": LOOSE,
            "global_daily_amount_minor": LOOSE, "agent_daily_amount_minor": LOOSE,
            limit: 1 if limit.endswith("count") else 10_000})
        make_rules()
        customer = make_customer()
        payments = [make_payment(amount=50_000, customer=customer if same_customer else None) for _ in range(2)]
        caller = Caller.for_key(make_agent_key("refunds.create")[0])
    approved = _ask(caller, payments[0], 10_000, first)
    assert approved.status == 201, approved.body
    refused = _ask(caller, payments[1], 10_000, second)
    assert (refused.status, refused.code) == (422, "DAILY_LIMIT_REACHED"), refused.body
    assert Refund.objects.filter(status__in=COUNTING_STATES).count() == 1


@pytest.mark.parametrize("zone, day", [*FALL_BACK_AT_MIDNIGHT, ("Pacific/Kiritimati", date(2026, 12, 7))])
@pytest.mark.parametrize("raced", [False, True])
def test_two_refunds_either_side_of_midnight_are_each_the_first_of_its_day(transactional_db, settings, monkeypatch,
                                                                            zone, day, raced):
    """A decision takes its instant before it waits for its locks. One asked a microsecond before
    local midnight (yesterday's first) that gets its locks after one asked at midnight (today's
    first) is still yesterday's first: with one refund a day per customer, both are approved.
    Before, yesterday's window ran on past midnight and counted today's refund: refused.
    Each thread reads its own clock; raced: released together, or the later ask decided first."""
    from django.utils import timezone as django_timezone

    settings.TIME_ZONE = zone
    settings.BREAKER_MIN_COUNT = 10**6
    midnight = local(zone, day, 0)
    with time_machine.travel(midnight - timedelta(days=1), tick=False):
        make_limits(allowed_reasons=["duplicate"], customer_daily_count=1)
        make_rules()
        customer = make_customer()
        payments = [make_payment(amount=50_000, customer=customer) for _ in range(2)]
        caller = Caller.for_key(make_agent_key("refunds.create")[0])
    clock, real_now = threading.local(), django_timezone.now
    monkeypatch.setattr(django_timezone, "now", lambda: getattr(clock, "now", None) or real_now())
    asked_at = [midnight - timedelta(microseconds=1), midnight]

    def ask(i: int):
        clock.now = asked_at[i]
        return request_refund(caller=caller, data={"transaction_id": payments[i].pk, "reason": "duplicate",
                                                   "amount": 1_000}, idempotency_key=uuid.uuid4().hex)

    answers = race(2, ask) if raced else list(reversed([ask(1), ask(0)]))
    assert [a.status for a in answers] == [201, 201], [a.body for a in answers]
    counted = sorted(Refund.objects.filter(status__in=COUNTING_STATES).values_list("counted_at", flat=True))
    assert counted == asked_at


# ---- every window, against a plain computation over the refunds' instants ------------------------

def transitions(zone: str, year: int) -> list[datetime]:
    """The instants (UTC, to the second) the clocks of ``zone`` change offset in ``year``."""
    tz, found = ZoneInfo(zone), []
    at, end = datetime(year, 1, 1, tzinfo=UTC), datetime(year + 1, 1, 1, tzinfo=UTC)
    while at < end:
        nxt = at + timedelta(hours=1)
        if at.astimezone(tz).utcoffset() != nxt.astimezone(tz).utcoffset():
            low, high = at, nxt
            while high - low > timedelta(seconds=1):
                middle = low + (high - low) / 2
                low, high = (middle, high) if middle.astimezone(tz).utcoffset() == at.astimezone(tz).utcoffset() \
                    else (low, middle)
            found.append(high)
        at = nxt
    return found


@functools.cache
def reference_day_start(day: date, zone: str) -> datetime:
    """The first minute (UTC) at which the clocks of ``zone`` show the date ``day``: found by
    looking at every minute of the 28 hours around it (every offset in use, and every transition
    here, is a whole number of minutes)."""
    tz = ZoneInfo(zone)
    around = datetime.combine(day, time(0), tzinfo=UTC)
    minutes = (around + timedelta(minutes=m) for m in range(-15 * 60, 13 * 60))
    return min(t for t in minutes if t.astimezone(tz).date() == day)


# Zones and the days their clocks change (and one without daylight saving): midnight twice (Azores,
# Havana in the autumn), midnight skipped (Azores, Havana, Santiago, Beirut, Cairo in the spring), the
# day before's last hour twice (Santiago, Beirut in the autumn), a 30-minute shift (Lord Howe), a
# half-hour offset (Adelaide, St John's), a 45-minute one (Kathmandu), and history: Goose Bay fell back
# from 00:01 to 23:01 (today, then yesterday again), Apia skipped 2011-12-30, Kathmandu moved from
# +05:30 to +05:45 at midnight (skipped: 00:00 to 00:15).
DAY_CASES = [(zone, edge.astimezone(ZoneInfo(zone)).date() + timedelta(days=shift))
             for zone in ("Atlantic/Azores", "America/Havana", "America/Santiago", "Asia/Beirut", "Africa/Cairo",
                          "America/Nuuk", "Australia/Lord_Howe", "Australia/Adelaide", "America/St_Johns")
             for year in (2026, 2027) for edge in transitions(zone, year) for shift in (-1, 0, 1)] + [
    ("Asia/Kathmandu", date(2026, 12, 7)), ("Asia/Kathmandu", date(1986, 1, 1)), ("Pacific/Apia", date(2011, 12, 31)),
    ("America/Goose_Bay", date(1988, 10, 30)), ("America/Goose_Bay", date(1988, 4, 3)), ("UTC", date(2026, 12, 7))]


def test_the_first_instant_of_a_local_day_is_the_first_minute_its_clocks_show_that_date():
    from refundops.selectors import start_of_day, start_of_local_day

    assert len(DAY_CASES) > 100
    for zone, day in DAY_CASES:
        first = reference_day_start(day, zone)
        assert start_of_local_day(day, ZoneInfo(zone)) == first, (zone, day)
        # from any instant of that day, whatever zone it is written in (Goose Bay's clocks went back to
        # the day before a minute into it: those instants are yesterday's)
        later = [first, first + timedelta(minutes=59, seconds=59),
                 reference_day_start(day + timedelta(days=1), zone) - timedelta(microseconds=1)]
        for later in [t for t in later if t.astimezone(ZoneInfo(zone)).date() == day]:
            assert start_of_day(later, ZoneInfo(zone)) == first, (zone, day, later)
            assert start_of_day(later.astimezone(ZoneInfo(zone)), ZoneInfo(zone)) == first, (zone, day, later)
        assert start_of_day(first - timedelta(microseconds=1), ZoneInfo(zone)) < first


SWEEP_STATES = [RefundState.APPROVED, RefundState.SETTLED, RefundState.FAILED, RefundState.HELD,
                RefundState.REQUESTED, RefundState.CANCELED, RefundState.SUBMITTED]


def reference_totals(refunds: list[Refund], customers: dict[str, str], *, payment, agent_id: str | None,
                     now: datetime, zone: str, velocity_hours: int, cumulative_hours: int, exclude: str) -> Totals:
    """What each limit's window holds at ``now``, summed in Python from the refunds' instants: the
    day from its first minute (reference_day_start), the others in elapsed time. A refund counts
    in an elapsed window from its start on, also one counted after ``now`` (a clock ahead), as the
    services do; in the day until the next day's first minute (that refund is tomorrow's)."""
    now = now.astimezone(UTC)
    today = now.astimezone(ZoneInfo(zone)).date()
    day, day_end = reference_day_start(today, zone), reference_day_start(today + timedelta(days=1), zone)
    hour, month = now - timedelta(hours=1), now - timedelta(hours=30 * 24)
    velocity, cumulative = now - timedelta(hours=velocity_hours), now - timedelta(hours=cumulative_hours)
    counting = [r for r in refunds if r.status in COUNTING_STATES and r.pk != exclude]
    in_currency = [r for r in counting if r.currency == payment.currency]
    mine = [r for r in in_currency if customers[r.payment_id] == payment.customer_id]
    agents = [r for r in in_currency if agent_id and r.agent_id == agent_id]
    on_payment = [r for r in counting if r.payment_id == payment.pk]
    kind = Refund.Origin.AGENT if agent_id else Refund.Origin.STAFF  # the cumulative threshold's: the asker's

    def total(rows, since=None, until=None):
        return sum(r.amount_minor for r in rows
                   if (since is None or r.counted_at >= since) and (until is None or r.counted_at < until))

    return Totals(
        payment_refund_count=len(on_payment),
        customer_day_count=sum(day <= r.counted_at < day_end for r in mine),
        customer_day_minor=total(mine, day, day_end),
        customer_30d_count=sum(r.counted_at >= month for r in mine), customer_30d_minor=total(mine, month),
        customer_velocity_count=sum(r.counted_at >= velocity for r in mine),
        agent_hour_minor=total(agents, hour), agent_day_minor=total(agents, day, day_end), session_minor=0,
        global_day_minor=total(in_currency, day, day_end),
        agents_payment_minor=total([r for r in on_payment if r.origin == kind]),
        agents_customer_window_minor=total([r for r in mine if r.origin == kind], cumulative))


# The days' edges of the others (Beirut, Cairo, Nuuk, St John's) are checked above; their windows are these.
SWEEP_ZONES = ["Atlantic/Azores", "America/Havana", "America/Santiago", "Australia/Lord_Howe", "Australia/Adelaide",
               "Asia/Kathmandu"]


@pytest.mark.parametrize("zone", SWEEP_ZONES)
def test_every_window_sums_what_the_refunds_instants_say_across_both_transitions(db, settings, zone):
    """Both transitions of 2026 in each zone (Kathmandu has none: a day of 2026 instead): refunds every
    23 minutes from two days before to a day after (and around 30 days before), statuses, agents,
    customers and origins mixed, a few on the first instant of each day and a microsecond before it;
    then ``now`` every 67 minutes across it, and at each day's first instant, the transition, and
    00:30 twice. At each, for an agent's payment and a staff one, with a refund excluded in turn:
    the statement on the kept totals (half of them folded), the ORM's sum (the embedded mode's
    reading) and the reference agree, window by window; again after a rebuild of the kept totals
    and the drop of the old ones.
    ``now`` is given in UTC and in the zone, in turn: the windows are the same instants."""
    from refundops.selectors import running_totals, running_totals_orm
    from refundops.services.totals import drop_old_totals, fold_totals, rebuild_totals

    settings.TIME_ZONE = zone
    tz = ZoneInfo(zone)
    edges = transitions(zone, 2026) or [local(zone, date(2026, 10, 25), 0)]
    agents = [make_agent_key()[0].agent for _ in range(2)]
    for currency, edge in zip(["USD", "EUR", "GBP"], edges, strict=False):
        people = [make_customer(), make_customer()]
        payments = [make_payment(amount=10**9, currency=currency, customer=people[i % 2]) for i in range(3)]
        customers = {p.pk: p.customer_id for p in payments}
        days = {(edge + timedelta(hours=h)).astimezone(tz).date() for h in range(-60, 30, 6)}
        firsts = [reference_day_start(d, zone) for d in sorted(days)]
        instants = ([edge + timedelta(minutes=23 * k) for k in range(-130, 68)]
                    + [edge - timedelta(days=30) + timedelta(minutes=47 * k) for k in range(-36, 36)]
                    + [f + step for f in firsts for step in (-timedelta(microseconds=1), timedelta(0))])
        refunds = []
        for i, at in enumerate(sorted(instants)):
            agent = [agents[0], None, agents[1]][i % 3]
            origin = Refund.Origin.AGENT if agent else [Refund.Origin.STAFF, Refund.Origin.EXTERNAL][i % 2]
            refunds.append(Refund.objects.create(
                payment=payments[i % 3], amount_minor=100 + i, currency=currency, reason="duplicate", agent=agent,
                origin=origin, status=SWEEP_STATES[i % len(SWEEP_STATES)], counted_at=at))
            if at < edge <= at + timedelta(minutes=23):
                fold_totals()  # the buckets before the transition folded, those after not yet
        nows = ([edge + timedelta(minutes=67 * m) for m in range(-23, 24)] + [edge, edge - timedelta(microseconds=1)]
                + [f + step for f in firsts for step in (-timedelta(microseconds=1), timedelta(0))]
                + [local(zone, edge.astimezone(tz).date(), 0, 30, fold=fold) for fold in (0, 1)])
        checked = 0
        for i, now in enumerate(sorted(nows)):
            given = now if i % 2 else now.astimezone(tz)
            exclude = refunds[i * 7 % len(refunds)].pk if i % 3 else ""
            for payment, agent_id in ((payments[0], agents[0].pk), (payments[1], None)):
                ask = dict(payment=payment, agent_id=agent_id, session_id="", now=given, velocity_hours=5,
                           cumulative_hours=30, exclude_refund_id=exclude)
                expected = reference_totals(refunds, customers, payment=payment, agent_id=agent_id, now=now,
                                            zone=zone, velocity_hours=5, cumulative_hours=30, exclude=exclude)
                assert running_totals(**ask) == expected, (zone, now, given, exclude)
                assert running_totals_orm(**ask) == expected, (zone, now, given, exclude)
                checked += 1
        with time_machine.travel(min(nows), tick=False):  # keeps what a decision from then on reads
            assert rebuild_totals() > 0
            drop_old_totals()  # and the hourly drop, by the same clock, leaves it
        for now in sorted(nows)[::5]:
            for payment, agent_id in ((payments[0], agents[0].pk), (payments[1], None)):
                assert running_totals(payment=payment, agent_id=agent_id, session_id="", now=now) == \
                    reference_totals(refunds, customers, payment=payment, agent_id=agent_id, now=now, zone=zone,
                                     velocity_hours=24, cumulative_hours=24, exclude=""), (zone, now, "rebuilt")
        assert checked > 100


# ---- where the limits' zone comes from -----------------------------------------------------------

def test_the_limits_day_is_time_zones_not_the_zone_active_in_the_thread(db, settings):
    """``TIME_ZONE`` (settings, from the environment) is the one source of the limits' day: no
    merchant, limits row or request carries a zone. A zone activated for a person's display
    (``timezone.override``) does not move it. Before, the day was the active zone's: at 11:00 UTC
    with Kiritimati (+14) active, "today" began at 10:00 UTC, and a refund at 09:00 UTC the same
    UTC day was yesterday's."""
    from django.utils import timezone

    from refundops.selectors import limit_windows, limits_zone

    settings.TIME_ZONE = "UTC"
    settings.BREAKER_MIN_COUNT = 10**6
    day = date(2026, 12, 7)
    with time_machine.travel(datetime(2026, 12, 6, tzinfo=UTC), tick=False):
        make_limits(allowed_reasons=["duplicate"], customer_daily_count=1)
        make_rules()
        customer = make_customer()
        payments = [make_payment(amount=50_000, customer=customer) for _ in range(2)]
        caller = Caller.for_key(make_agent_key("refunds.create")[0])
    with timezone.override(ZoneInfo("Pacific/Kiritimati")):
        assert _ask(caller, payments[0], 1_000, datetime.combine(day, time(9), tzinfo=UTC)).status == 201
        refused = _ask(caller, payments[1], 1_000, datetime.combine(day, time(11), tzinfo=UTC))
        assert (refused.status, refused.code) == (422, "DAILY_LIMIT_REACHED"), refused.body
        assert limits_zone() == ZoneInfo("UTC")
        assert limit_windows(datetime(2026, 12, 7, 11, tzinfo=UTC)).day == datetime(2026, 12, 7, tzinfo=UTC)
    with override_settings(TIME_ZONE="Pacific/Kiritimati"):  # the setting does move it
        assert limit_windows(datetime(2026, 12, 7, 11, tzinfo=UTC)).day == datetime(2026, 12, 7, 10, tzinfo=UTC)


# ---- the breaker's minutes -----------------------------------------------------------------------

# Five minutes of clock readings across a transition, one elapsed minute apart, given in the zone.
BREAKER_NIGHTS = [
    ("Atlantic/Azores", date(2026, 10, 25), [(0, 57, 0), (0, 58, 0), (0, 59, 0), (0, 0, 1), (0, 1, 1), (0, 2, 1)]),
    ("Australia/Lord_Howe", date(2026, 10, 4), [(1, 57, 0), (1, 58, 0), (1, 59, 0), (2, 30, 0), (2, 31, 0), (2, 32, 0)]),
    ("Australia/Lord_Howe", date(2026, 4, 5), [(1, 57, 0), (1, 58, 0), (1, 59, 0), (1, 30, 1), (1, 31, 1), (1, 32, 1)]),
    ("America/Havana", date(2026, 3, 8), [(23, 57, 0), (23, 58, 0), (23, 59, 0), (1, 0, 0), (1, 1, 0), (1, 2, 0)]),
]


@pytest.mark.parametrize("zone, day, readings", BREAKER_NIGHTS)
@pytest.mark.parametrize("last, opens", [(4, True), (5, False)])
def test_the_breakers_window_is_elapsed_minutes_across_a_transition(db, settings, zone, day, readings, last, opens):
    """The breaker counts agent refunds in the last ``BREAKER_WINDOW_MINUTES`` elapsed minutes. Six
    refunds, the first five one elapsed minute apart across the jump (the clocks read 00:59 then
    00:00, or 01:59 then 02:30), the sixth in the fifth minute: six in five minutes, over the floor
    of five, opens it; the sixth a minute later (the first has left the window): five, stays closed."""
    from refundops import breaker

    settings.BREAKER_WINDOW_MINUTES, settings.BREAKER_BASELINE_MINUTES, settings.BREAKER_FACTOR = 5, 60, 5
    settings.BREAKER_MIN_COUNT, settings.BREAKER_MIN_VALUE = 5, 10**9
    tz = ZoneInfo(zone)
    instants = [datetime.combine(day - timedelta(days=h == 23), time(h, m), tzinfo=tz).replace(fold=f)
                for h, m, f in readings]  # given in the zone (their difference there is wall-clock time)
    assert [b.timestamp() - a.timestamp() for a, b in zip(instants, instants[1:])] == [60] * 5

    def later(at: datetime, seconds: int) -> datetime:  # elapsed seconds, written in the zone again
        return (at.astimezone(UTC) + timedelta(seconds=seconds)).astimezone(tz)

    for at in [*instants[:5], instants[last]]:
        breaker.record_refund(100, "USD", later(at, 30))
    assert breaker.is_open(now=later(instants[last], 31)) is opens


# ---- the dashboard's days -------------------------------------------------------------------------

@pytest.mark.parametrize("zone, day", FALL_BACK_AT_MIDNIGHT)
def test_the_dashboards_day_counts_its_first_hour_during_its_second(db, settings, zone, day):
    """The dashboard's refunds per day (against the global daily limit) start at the same first
    instant as the limits: the refund of the first 00:10 is on today during the second 00:30."""
    from refundops.reports import dashboard

    settings.TIME_ZONE = zone
    make_limits()
    payment = make_payment(amount=50_000)
    with time_machine.travel(local(zone, day, 0, 10), tick=False):
        Refund.objects.create(payment=payment, amount_minor=700, currency="USD", reason="duplicate",
                              status=RefundState.SETTLED)
    for days in (1, 2):
        board = dashboard(now=local(zone, day, 0, 30, fold=1), days=days)
        # (compared as timestamps: Python never finds an instant of a repeated hour, written in its
        # zone, equal to one written in another)
        assert board.since.timestamp() == local(zone, day - timedelta(days=days - 1), 0).timestamp()
        (usd,) = board.per_currency
        assert [(d.day, d.count, d.amount_minor) for d in usd.days] == \
            [(day - timedelta(days=1), 0, 0), (day, 1, 700)][-days:]


@pytest.mark.parametrize("zone, day", [*FALL_BACK_AT_MIDNIGHT, ("Pacific/Chatham", date(2026, 9, 27))])
def test_the_dashboards_day_of_a_refund_is_the_day_the_limits_counted_it_on(db, settings, zone, day):
    """A decision takes its instant before it waits for its locks, and the refund is written after:
    one asked a microsecond before local midnight and written just after is counted (``counted_at``)
    on the day before, and a failed refund sent again days later is counted on the day it is sent
    again. The dashboard's bars stand against the global daily limit: each refund is on the day the
    limit counted it, not the day its row was written (``created_at``)."""
    from refundops.reports import dashboard

    settings.TIME_ZONE = zone
    make_limits()
    payment = make_payment(amount=50_000)
    midnight = local(zone, day, 0)
    with time_machine.travel(midnight + timedelta(milliseconds=3), tick=False):  # written after the lock wait
        Refund.objects.create(payment=payment, amount_minor=700, currency="USD", reason="duplicate",
                              status=RefundState.SETTLED, counted_at=midnight - timedelta(microseconds=1))
    with time_machine.travel(midnight - timedelta(days=5), tick=False):  # failed, sent again today
        Refund.objects.create(payment=payment, amount_minor=300, currency="USD", reason="duplicate",
                              status=RefundState.APPROVED, counted_at=midnight + timedelta(hours=2))
    board = dashboard(now=midnight + timedelta(hours=3), days=2)
    (usd,) = board.per_currency
    assert [(d.day, d.count, d.amount_minor) for d in usd.days] == \
        [(day - timedelta(days=1), 1, 700), (day, 1, 300)]
