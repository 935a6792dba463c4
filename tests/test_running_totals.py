"""The running totals read in one PostgreSQL statement agree with the ORM's reading of them."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone
from hypothesis import given, settings as hsettings, strategies as st
from hypothesis.extra.django import TestCase

from refundops import selectors
from refundops.models import COUNTING_STATES, Refund, RefundState
from refundops.selectors import running_totals, start_of_day
from tests.conftest import make_agent_key, make_customer, make_payment

STATES = [s.value for s in RefundState]


class TotalsAgree(TestCase):
    @hsettings(max_examples=15, deadline=None)
    @given(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 1), st.sampled_from(STATES),
                              st.integers(1, 5_000), st.integers(0, 24 * 40), st.booleans(),
                              st.sampled_from(Refund.Origin.values)), max_size=10))
    def test_sql_and_orm_totals_agree(self, rows):
        now = timezone.now()
        customers = [make_customer(), make_customer()]
        payments = [make_payment(amount=10**7, customer=customers[i % 2], currency=c)
                    for i, c in enumerate(("USD", "USD", "EUR"))]
        agents = [make_agent_key()[0].agent, make_agent_key()[0].agent]
        for payment_i, agent_i, status, amount, hours_ago, in_session, origin in rows:
            payment = payments[payment_i]
            refund = Refund.objects.create(payment=payment, amount_minor=amount, currency=payment.currency,
                                           reason="duplicate", agent=agents[agent_i], origin=origin,
                                           agent_session_id="s1" if in_session else "s2")
            Refund.objects.filter(pk=refund.pk).update(status=status,
                                                       created_at=now - timedelta(hours=hours_ago),
                                                       counted_at=now - timedelta(hours=hours_ago))
        for payment in payments:
            for agent in (agents[0], None):
                params = {"exclude": "", "payment": payment.pk, "customer": payment.customer_id,
                          "currency": payment.currency, "agent": agent.pk if agent else None, "session": "s1",
                          "states": [str(s) for s in COUNTING_STATES], "day": start_of_day(now),
                          "day_end": selectors.limit_windows(now).day_end,
                          "hour": now - timedelta(hours=1), "month": now - timedelta(days=30),
                          "velocity": now - timedelta(hours=24), "cumulative": now - timedelta(hours=36),
                          "agent_origin": "agent"}
                sql = running_totals(payment=payment, agent_id=params["agent"], session_id="s1", now=now,
                                     cumulative_hours=36)
                assert sql == selectors._running_totals_orm(params)


@pytest.mark.django_db
def test_totals_count_only_refunds_that_hold_money(policy):
    payment = make_payment(amount=10_000)
    for status in STATES:
        refund = Refund.objects.create(payment=payment, amount_minor=100, currency="USD", reason="duplicate")
        Refund.objects.filter(pk=refund.pk).update(status=status)
    totals = running_totals(payment=payment, agent_id=None, session_id="", now=timezone.now())
    assert totals.payment_refund_count == len(COUNTING_STATES)
    assert totals.global_day_minor == 100 * len(COUNTING_STATES)


def _refund_rows_read(cursor) -> int:
    """Rows of refundops_refund read so far in this transaction (scanned, or fetched through an
    index), from PostgreSQL's own statistics for the transaction."""
    cursor.execute("SELECT pg_stat_get_xact_tuples_returned('refundops_refund'::regclass)"
                   " + pg_stat_get_xact_tuples_fetched('refundops_refund'::regclass)")
    return cursor.fetchone()[0]


@pytest.mark.django_db
def test_an_agents_totals_read_its_recent_refunds_not_its_whole_history(policy):
    """The totals' cost follows the day (and the session), not the history: with 2,000 of the agent's
    refunds from past days (other sessions, another customer's payment), one decision's totals read
    only the few of today and of the session, also once PostgreSQL keeps a generic plan of the
    prepared statement (forced here). The agent's sums are one scan with an OR (recent, or of the
    session) that PostgreSQL serves with two indexes; a plan that read every refund of the agent
    would cost 1 µs a refund of its whole history (issue 11, bench/day_volume.py)."""
    from django.db import connection

    key, _ = make_agent_key()
    now = timezone.now()
    payment, elsewhere = make_payment(amount=10**7), make_payment(amount=10**7)
    for session in ("s1", "s1", "s2"):  # today's: two in the session being decided
        Refund.objects.create(payment=payment, amount_minor=100, currency="USD", reason="duplicate",
                              agent=key.agent, agent_session_id=session, status=RefundState.APPROVED)
    old = Refund.objects.create(payment=elsewhere, amount_minor=100, currency="USD", reason="duplicate",
                                agent=key.agent, agent_session_id="old", status=RefundState.APPROVED,
                                counted_at=now - timedelta(days=2))
    with connection.cursor() as cursor:
        cursor.execute("""
            INSERT INTO refundops_refund
            SELECT (jsonb_populate_record(r, jsonb_build_object(
                       'id', 'rf_old' || g, 'agent_session_id', 'old' || g %% 50,
                       'counted_at', %s::timestamptz - make_interval(days => 2 + g %% 40)))).*
              FROM refundops_refund r, generate_series(1, 2000) g WHERE r.id = %s""", [now, old.pk])
        cursor.execute("ANALYZE refundops_refund")
        cursor.execute("SET LOCAL plan_cache_mode = force_generic_plan")
        totals = []
        for _ in range(7):  # past five runs PostgreSQL may keep a generic plan of the prepared statement
            before = _refund_rows_read(cursor)
            totals.append(running_totals(payment=payment, agent_id=key.agent_id, session_id="s1", now=now))
            read = _refund_rows_read(cursor) - before
            assert read < 100, f"one decision's totals read {read} refunds; today and the session hold 3"
    assert totals[-1].agent_day_minor == 300 and totals[-1].session_minor == 200
    assert totals[-1].global_day_minor == 300 and totals[-1].customer_day_count == 3
