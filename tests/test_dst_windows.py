"""Daylight-saving nights and odd offsets (issue 27, finding 2): every window the limits count in
starts where a plain computation over the refunds' instants says, whatever the clocks do.

The limits' day is the local day of ``TIME_ZONE`` (the only source of it: no merchant or limits
row carries a zone). Where the clocks fall back at midnight (Atlantic/Azores, America/Havana) the
day's first hour happens twice: a refund in the first of them is today's, and still is during the
second. Where they spring forward at midnight (America/Santiago, Asia/Beirut, Africa/Cairo,
America/Havana, Atlantic/Azores in spring) midnight never happens: the day starts at the jump."""

from __future__ import annotations

import uuid
from datetime import UTC, date, datetime, time, timedelta
from zoneinfo import ZoneInfo

import pytest
import time_machine
from django.test import override_settings

from refundops.callers import Caller
from refundops.models import COUNTING_STATES, Refund
from refundops.services.refunds import request_refund
from tests.conftest import make_agent_key, make_customer, make_limits, make_payment, make_rules

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
