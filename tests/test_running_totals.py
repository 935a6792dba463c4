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
