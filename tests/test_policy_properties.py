"""Properties: no sequence of requests pays more than any bound.

Two levels. The pure policy, driven with running totals kept by a reference model of the refunds
it let through; and the real service on PostgreSQL, whose totals come from the database. In both,
every refund that was not refused (approved or held: a held refund reserves its amount) counts.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import timedelta

import pytest
from django.db import transaction
from django.utils import timezone
from hypothesis import HealthCheck, given, settings as hsettings, strategies as st

from refundops.callers import Caller
from refundops.models import COUNTING_STATES, Customer, Payment, Refund, RefundLimits
from refundops.policy import RefundAsk, Totals, evaluate_refund
from refundops.services.refunds import request_refund
from tests.conftest import make_agent_key, make_customer, make_limits, make_payment, make_staff

AGENTS = ("ag_a", "ag_b", None)  # None: a staff member in the admin
SESSIONS = ("", "s1", "s2")


@dataclass(frozen=True)
class Ask:
    payment: int
    amount: int | None
    agent: str | None
    session: str


@st.composite
def scenarios(draw):
    customers = draw(st.integers(1, 3))
    payments = draw(st.lists(st.tuples(st.integers(0, customers - 1), st.integers(1, 6_000)),
                             min_size=1, max_size=5))
    limits = {
        "approval_threshold_minor": draw(st.integers(0, 6_000)),
        "max_refunds_per_payment": draw(st.integers(1, 4)),
        "customer_daily_count": draw(st.integers(1, 6)),
        "customer_daily_amount_minor": draw(st.integers(0, 9_000)),
        "customer_30d_count": draw(st.integers(1, 10)),
        "customer_30d_amount_minor": draw(st.integers(0, 12_000)),
        "agent_hourly_amount_minor": draw(st.integers(0, 9_000)),
        "agent_daily_amount_minor": draw(st.integers(0, 12_000)),
        "session_amount_minor": draw(st.integers(0, 6_000)),
        "global_daily_amount_minor": draw(st.integers(0, 15_000)),
    }
    asks = draw(st.lists(st.builds(Ask, st.integers(0, len(payments) - 1),
                                   st.one_of(st.none(), st.integers(1, 7_000)),
                                   st.sampled_from(AGENTS), st.sampled_from(SESSIONS)), max_size=30))
    return customers, payments, limits, asks


@dataclass
class Paid:
    payment: int
    customer: int
    amount: int
    agent: str | None
    session: str


def reference_totals(paid: list[Paid], *, payment: int, customer: int, ask: Ask) -> Totals:
    mine = [p for p in paid if p.customer == customer]
    by_agent = [p for p in paid if ask.agent is not None and p.agent == ask.agent]
    return Totals(
        payment_refund_count=sum(1 for p in paid if p.payment == payment),
        customer_day_count=len(mine), customer_day_minor=sum(p.amount for p in mine),
        customer_30d_count=len(mine), customer_30d_minor=sum(p.amount for p in mine),
        customer_velocity_count=len(mine),
        agent_hour_minor=sum(p.amount for p in by_agent), agent_day_minor=sum(p.amount for p in by_agent),
        session_minor=sum(p.amount for p in by_agent if ask.session and p.session == ask.session),
        global_day_minor=sum(p.amount for p in paid))


def assert_within_bounds(paid: list[Paid], payments: list[tuple[int, int]], limits: dict[str, int]) -> None:
    for i, (_, captured) in enumerate(payments):
        on_payment = [p.amount for p in paid if p.payment == i]
        assert sum(on_payment) <= captured
        assert len(on_payment) <= limits["max_refunds_per_payment"]
    for customer in {p.customer for p in paid}:
        amounts = [p.amount for p in paid if p.customer == customer]
        assert sum(amounts) <= min(limits["customer_daily_amount_minor"], limits["customer_30d_amount_minor"])
        assert len(amounts) <= min(limits["customer_daily_count"], limits["customer_30d_count"])
    for agent in {p.agent for p in paid if p.agent}:  # staff refunds answer to every bound but these
        by_agent = [p for p in paid if p.agent == agent]
        assert sum(p.amount for p in by_agent) <= min(limits["agent_hourly_amount_minor"],
                                                       limits["agent_daily_amount_minor"])
        for session in {p.session for p in by_agent if p.session}:
            assert sum(p.amount for p in by_agent if p.session == session) <= limits["session_amount_minor"]
    assert sum(p.amount for p in paid) <= limits["global_daily_amount_minor"]


@given(scenario=scenarios())
@hsettings(max_examples=300, deadline=None)
def test_the_policy_never_lets_a_sequence_past_a_bound(scenario):
    customers, payments, limit_values, asks = scenario
    now = timezone.now()
    limits = RefundLimits(currency="USD", version=1, allowed_reasons=["duplicate"], refund_window_days=90,
                          **limit_values)
    people = [Customer(id=f"cus_{i}", email=f"{i}@example.com") for i in range(customers)]
    rows = [Payment(id=f"txn_{i}", customer=people[c], currency="USD", status=Payment.Status.CAPTURED,
                    amount_authorized_minor=captured, amount_captured_minor=captured,
                    captured_at=now - timedelta(days=1))
            for i, (c, captured) in enumerate(payments)]
    paid: list[Paid] = []
    for ask in asks:
        payment, customer = rows[ask.payment], payments[ask.payment][0]
        payment.amount_reserved_minor = sum(p.amount for p in paid if p.payment == ask.payment)
        decision = evaluate_refund(
            payment=payment, limits=limits, rules=None, now=now, paused=False, breaker_open=False,
            totals=reference_totals(paid, payment=ask.payment, customer=customer, ask=ask),
            ask=RefundAsk(amount_minor=ask.amount, reason="duplicate", destination="original_method",
                          agent_id=ask.agent, session_id=ask.session))
        if decision.outcome != "denied":
            paid.append(Paid(ask.payment, customer, decision.amount_minor, ask.agent, ask.session))
    assert_within_bounds(paid, payments, limit_values)


@pytest.mark.django_db
@given(scenario=scenarios())
@hsettings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
def test_the_service_never_lets_a_sequence_past_a_bound(scenario, settings, rules, django_user_model):
    settings.BREAKER_MIN_COUNT = 10**6  # many examples in one minute: volume is not the point here
    customers, payments, limit_values, asks = scenario
    with transaction.atomic():
        make_limits(allowed_reasons=["duplicate"], **limit_values)
        people = [make_customer() for _ in range(customers)]
        rows = [make_payment(customer=people[c], amount=captured) for c, captured in payments]
        keys = {name: make_agent_key("refunds.create")[0] for name in AGENTS if name}
        staff = make_staff(f"staff-{uuid.uuid4().hex[:8]}")
        for ask in asks:
            caller = Caller.for_key(keys[ask.agent]) if ask.agent else Caller.for_user(staff)
            body = {"transaction_id": rows[ask.payment].pk, "reason": "duplicate",
                    **({"amount": ask.amount} if ask.amount else {}),
                    **({"agent": {"session_id": ask.session}} if ask.session else {})}
            request_refund(caller=caller, data=body, idempotency_key=uuid.uuid4().hex)
        counted = Refund.objects.filter(status__in=COUNTING_STATES)
        paid = [Paid(rows.index(next(r for r in rows if r.pk == refund.payment_id)),
                     people.index(next(p for p in people if p.pk == refund.payment.customer_id)),
                     refund.amount_minor, _name_of(keys, refund.agent_id), refund.agent_session_id)
                for refund in counted.select_related("payment")]
        assert_within_bounds(paid, payments, limit_values)
        for payment in Payment.objects.filter(pk__in=[r.pk for r in rows]):
            assert payment.amount_reserved_minor + payment.amount_refunded_minor <= payment.amount_captured_minor
        transaction.set_rollback(True)  # each example starts from an empty database


def _name_of(keys: dict, agent_id: str | None) -> str | None:
    return next((name for name, key in keys.items() if key.agent_id == agent_id), None)
