"""Properties: no sequence of requests, spread over minutes, hours and days, pays more than any bound.

Two levels. The pure policy, driven with running totals kept by a reference model of the refunds
it let through, each at its own time, so that every window (the hour, the local day, the velocity
and cumulative windows, 30 days) is crossed; and the real service on PostgreSQL, whose totals come
from the database: its every outcome must be the reference model's. In both, every refund that
was not refused (approved or held: a held refund reserves its amount) counts.

The generated limits let most requests through (a test whose every request is refused proves
nothing about the totals): run with ``--hypothesis-show-statistics`` to see how many reach a
decision.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pytest
import time_machine
from django.db import transaction
from django.utils import timezone
from hypothesis import HealthCheck, event, example, given, settings as hsettings, strategies as st

from refundops.callers import Caller
from refundops.models import COUNTING_STATES, Customer, HoldRules, Payment, Refund, RefundLimits
from refundops.policy import Decision, RefundAsk, Totals, evaluate_refund
from refundops.selectors import start_of_day
from refundops.services.refunds import request_refund
from tests.conftest import make_agent_key, make_customer, make_limits, make_payment, make_rules, make_staff

AGENTS = ("ag_a", "ag_b", None)  # None: a staff member in the admin
SESSIONS = ("", "s1", "s2")
# Minutes between one request and the next, on one time scale per scenario, so that several
# refunds share a window and its edge gets crossed: a burst; either side of the hour; hours, either
# side of a day (the velocity and default cumulative windows); days.
GAPS = ((0, 1, 5, 10), (20, 30, 59, 61, 90), (180, 360, 600, 23 * 60, 25 * 60), (25 * 60, 3 * 24 * 60, 8 * 24 * 60))
VELOCITY_HOURS = 24
STAFF_AUTHORITY = 10**12


@dataclass(frozen=True)
class Ask:
    payment: int
    amount: int | None
    agent: str | None
    session: str
    gap_minutes: int


@dataclass(frozen=True)
class Scenario:
    customers: int
    payments: list[tuple[int, int]]  # (customer, captured)
    limits: dict[str, int]
    velocity_max_refunds: int  # hold rule: more than this many refunds to a customer in 24 hours
    before_midnight: int  # minutes from the first request's time to the next local midnight
    asks: list[Ask]

    def start(self) -> datetime:
        midnight = start_of_day(timezone.now()) + timedelta(days=1)
        return midnight - timedelta(minutes=self.before_midnight)


@st.composite
def scenarios(draw):
    customers = draw(st.integers(1, 3))
    payments = draw(st.lists(st.tuples(st.integers(0, customers - 1), st.integers(20_000, 80_000)),
                             min_size=1, max_size=5))
    # Generous limits, so most requests reach a decision, except one bound (or none) drawn tight
    # enough that the requests reach it: each window's edge gets crossed, one scenario at a time.
    bounds = {  # name: (tight, generous)
        "max_refunds_per_payment": ((1, 3), (4, 10)),
        "customer_daily_count": ((1, 4), (5, 15)),
        "customer_daily_amount_minor": ((1_000, 8_000), (40_000, 200_000)),
        "customer_30d_count": ((2, 6), (10, 40)),
        "customer_30d_amount_minor": ((2_000, 12_000), (60_000, 400_000)),
        "agent_hourly_amount_minor": ((1_000, 6_000), (15_000, 80_000)),
        "agent_daily_amount_minor": ((1_000, 8_000), (20_000, 120_000)),
        "session_amount_minor": ((1_000, 6_000), (10_000, 80_000)),
        "global_daily_amount_minor": ((2_000, 12_000), (80_000, 400_000)),
    }
    tight = draw(st.sampled_from([*bounds, None]))
    limits = {name: draw(st.integers(*ranges[name != tight])) for name, ranges in bounds.items()}
    limits["approval_threshold_minor"] = draw(st.integers(0, 15_000))
    limits["cumulative_window_hours"] = draw(st.sampled_from((1, 24, 72)))
    # About one in 20: no amount, the whole refundable amount.
    amount = st.tuples(st.sampled_from(range(20)), st.integers(1, 3_000)).map(lambda t: t[1] if t[0] else None)
    gaps = draw(st.sampled_from(GAPS))
    asks = draw(st.lists(st.builds(Ask, st.integers(0, len(payments) - 1), amount, st.sampled_from(AGENTS),
                                   st.sampled_from(SESSIONS), st.sampled_from(gaps)), min_size=4, max_size=30))
    return Scenario(customers, payments, limits, draw(st.sampled_from((2, 5, 1_000))),
                    draw(st.integers(0, 24 * 60 - 1)), asks)


GENEROUS = {"max_refunds_per_payment": 10, "customer_daily_count": 15, "customer_daily_amount_minor": 10**6,
            "customer_30d_count": 40, "customer_30d_amount_minor": 10**6, "agent_hourly_amount_minor": 10**6,
            "agent_daily_amount_minor": 10**6, "session_amount_minor": 10**6, "global_daily_amount_minor": 10**6,
            "approval_threshold_minor": 15_000, "cumulative_window_hours": 24}


def edge(before_midnight: int = 600, velocity_max_refunds: int = 1_000, **limits) -> Callable:
    """An explicit example on one window's edge: two payments of one customer, three of another."""
    def asks(*steps: tuple[int, int, str | None, int]) -> Scenario:
        return Scenario(2, [(0, 50_000), (0, 50_000), (1, 50_000)], {**GENEROUS, **limits}, velocity_max_refunds,
                        before_midnight, [Ask(p, amount, agent, "", gap) for p, amount, agent, gap in steps])
    return asks


# Each window's edge, crossed once on purpose (the generated scenarios reach them too, less surely).
EDGES = [
    # An agent that names no session: its key's UTC hour is its session (14:00, 14:01 refused, 15:01 fits).
    edge(session_amount_minor=1_000)((0, 600, "ag_a", 0), (0, 600, "ag_a", 1), (0, 600, "ag_a", 60)),
    # The agent's hour: the third refund is 61 minutes after the first, which no longer counts.
    edge(agent_hourly_amount_minor=5_000)((0, 3_000, "ag_a", 0), (0, 3_000, "ag_a", 59), (1, 2_500, "ag_a", 2)),
    # The local day: 23:30, 23:50 (refused), then 00:10 of the next day.
    edge(before_midnight=30, customer_daily_amount_minor=5_000)(
        (0, 3_000, None, 0), (0, 3_000, None, 20), (1, 3_000, None, 20)),
    # 30 days: a refund 31 days later fits again.
    edge(customer_30d_amount_minor=5_000)((0, 3_000, None, 0), (0, 3_000, None, 29 * 24 * 60),
                                          (1, 3_000, None, 2 * 24 * 60)),
    # The cumulative window (1 hour here) for the customer; on the payment it never ends.
    edge(approval_threshold_minor=5_000, cumulative_window_hours=1)(
        (0, 3_000, "ag_a", 0), (1, 3_000, "ag_b", 59), (1, 1_000, "ag_b", 62), (0, 2_500, "ag_a", 120)),
    # The velocity hold (more than 3 in 24 hours): a fourth refund 24 hours and a minute after the
    # first is not held; a fifth a minute later is.
    edge(velocity_max_refunds=3)((0, 100, None, 0), (0, 100, None, 60), (1, 100, None, 60),
                                 (1, 100, None, 24 * 60 + 1 - 120), (1, 100, None, 1)),
]


def with_edges(test):
    for scenario in EDGES:
        test = example(scenario=scenario)(test)
    return test


@dataclass
class Paid:
    payment: int
    customer: int
    amount: int
    agent: str | None
    session: str
    at: datetime
    held: bool


def reference_totals(paid: list[Paid], *, payment: int, customer: int, ask: Ask, now: datetime,
                     cumulative_hours: int) -> Totals:
    day, hour, month = start_of_day(now), now - timedelta(hours=1), now - timedelta(days=30)
    velocity, cumulative = now - timedelta(hours=VELOCITY_HOURS), now - timedelta(hours=cumulative_hours)
    mine = [p for p in paid if p.customer == customer]
    by_agent = [p for p in paid if ask.agent is not None and p.agent == ask.agent]
    return Totals(
        payment_refund_count=sum(1 for p in paid if p.payment == payment),
        customer_day_count=sum(1 for p in mine if p.at >= day),
        customer_day_minor=sum(p.amount for p in mine if p.at >= day),
        customer_30d_count=sum(1 for p in mine if p.at >= month),
        customer_30d_minor=sum(p.amount for p in mine if p.at >= month),
        customer_velocity_count=sum(1 for p in mine if p.at >= velocity),
        agent_hour_minor=sum(p.amount for p in by_agent if p.at >= hour),
        agent_day_minor=sum(p.amount for p in by_agent if p.at >= day),
        session_minor=sum(p.amount for p in by_agent if ask.session and p.session == ask.session),
        global_day_minor=sum(p.amount for p in paid if p.at >= day),
        # The asker's kind: agents' refunds for an agent, people's for a person (issue 28).
        agents_payment_minor=sum(p.amount for p in paid if p.payment == payment
                                 and (p.agent is None) == (ask.agent is None)),
        agents_customer_window_minor=sum(p.amount for p in mine if (p.agent is None) == (ask.agent is None)
                                         and p.at >= cumulative))


def assert_within_bounds(paid: list[Paid], payments: list[tuple[int, int]], limits: dict[str, int]) -> None:
    """Every refund that counts, with those before it in each window that ends at its time."""
    for i, (_, captured) in enumerate(payments):
        on_payment = [p.amount for p in paid if p.payment == i]
        assert sum(on_payment) <= captured
        assert len(on_payment) <= limits["max_refunds_per_payment"]
    for n, p in enumerate(paid):
        upto = paid[:n + 1]
        day, month = start_of_day(p.at), p.at - timedelta(days=30)
        mine = [q for q in upto if q.customer == p.customer]
        assert sum(q.amount for q in mine if q.at >= day) <= limits["customer_daily_amount_minor"]
        assert sum(1 for q in mine if q.at >= day) <= limits["customer_daily_count"]
        assert sum(q.amount for q in mine if q.at >= month) <= limits["customer_30d_amount_minor"]
        assert sum(1 for q in mine if q.at >= month) <= limits["customer_30d_count"]
        assert sum(q.amount for q in upto if q.at >= day) <= limits["global_daily_amount_minor"]
        if p.agent is None:  # staff refunds answer to every bound but the agents' own ...
            if not p.held:  # ... and what people moved without a second person stays within the threshold
                window = p.at - timedelta(hours=limits["cumulative_window_hours"])
                people = [q for q in upto if q.agent is None]
                assert sum(q.amount for q in people if q.payment == p.payment) <= limits["approval_threshold_minor"]
                assert sum(q.amount for q in people if q.customer == p.customer and q.at >= window) <= \
                    limits["approval_threshold_minor"]
            continue
        by_agent = [q for q in upto if q.agent == p.agent]
        assert sum(q.amount for q in by_agent if q.at >= p.at - timedelta(hours=1)) <= limits["agent_hourly_amount_minor"]
        assert sum(q.amount for q in by_agent if q.at >= day) <= limits["agent_daily_amount_minor"]
        if p.session:
            assert sum(q.amount for q in by_agent if q.session == p.session) <= limits["session_amount_minor"]
        if not p.held:  # what agents moved without a person never adds up past the threshold
            window = p.at - timedelta(hours=limits["cumulative_window_hours"])
            agents = [q for q in upto if q.agent is not None]
            assert sum(q.amount for q in agents if q.payment == p.payment) <= limits["approval_threshold_minor"]
            assert sum(q.amount for q in agents if q.customer == p.customer and q.at >= window) <= \
                limits["approval_threshold_minor"]


class Reference:
    """The pure policy over the reference model's totals: what the service must answer."""

    def __init__(self, scenario: Scenario) -> None:
        self.payments, payments, self.paid = scenario.payments, scenario.payments, []
        self.limits = RefundLimits(currency="USD", version=1, allowed_reasons=["duplicate"], refund_window_days=365,
                                   **scenario.limits)
        self.rules = HoldRules(version=1, velocity_max_refunds=scenario.velocity_max_refunds,
                               velocity_window_hours=VELOCITY_HOURS)
        start = scenario.start()
        people = [Customer(id=f"cus_{i}", email=f"{i}@example.com") for i in range(1 + max(c for c, _ in payments))]
        self.rows = [Payment(id=f"txn_{i}", customer=people[c], currency="USD", status=Payment.Status.CAPTURED,
                             amount_authorized_minor=captured, amount_captured_minor=captured,
                             captured_at=start - timedelta(days=1))
                     for i, (c, captured) in enumerate(payments)]

    def decide(self, ask: Ask, now: datetime) -> Decision:
        # An agent that names no session is counted as one session per key and UTC hour.
        if ask.agent and not ask.session:
            ask = dataclasses.replace(ask, session=f"key:{ask.agent}:{now.astimezone(UTC):%Y-%m-%dT%H}")
        payment, customer = self.rows[ask.payment], self.payments[ask.payment][0]
        payment.amount_reserved_minor = sum(p.amount for p in self.paid if p.payment == ask.payment)
        decision = evaluate_refund(
            payment=payment, limits=self.limits, rules=self.rules, now=now, paused=False, breaker_open=False, ledger_mismatch=False,
            totals=reference_totals(self.paid, payment=ask.payment, customer=customer, ask=ask, now=now,
                                    cumulative_hours=self.limits.cumulative_window_hours),
            ask=RefundAsk(amount_minor=ask.amount, reason="duplicate", destination="original_method",
                          agent_id=ask.agent, session_id=ask.session,
                          requester_authority_minor=None if ask.agent else STAFF_AUTHORITY))
        if decision.outcome != "denied":
            self.paid.append(Paid(ask.payment, customer, decision.amount_minor, ask.agent, ask.session, now,
                                  held=decision.outcome == "held"))
        return decision


def report(decisions: list[Decision]) -> None:
    if decisions:
        decided = sum(d.outcome != "denied" for d in decisions) / len(decisions)
        event(f"requests that reach a decision: {int(decided * 4) * 25}%+")


@given(scenario=scenarios())
@with_edges
@hsettings(max_examples=300, deadline=None)
def test_the_policy_never_lets_a_sequence_past_a_bound(scenario):
    reference, now, decisions = Reference(scenario), scenario.start(), []
    for ask in scenario.asks:
        now += timedelta(minutes=ask.gap_minutes)
        decisions.append(reference.decide(ask, now))
    report(decisions)
    assert_within_bounds(reference.paid, scenario.payments, scenario.limits)


@pytest.mark.django_db
@given(scenario=scenarios())
@with_edges
@hsettings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
def test_the_service_answers_as_the_reference_and_never_past_a_bound(scenario, settings):
    settings.BREAKER_MIN_COUNT = 10**6  # many examples in one minute: volume is not the point here
    customers, payments, limit_values, asks = scenario.customers, scenario.payments, scenario.limits, scenario.asks
    start = scenario.start()
    reference = Reference(scenario)
    with transaction.atomic():
        make_limits(allowed_reasons=["duplicate"], refund_window_days=365, **limit_values)
        make_rules(velocity_max_refunds=scenario.velocity_max_refunds, velocity_window_hours=VELOCITY_HOURS)
        people = [make_customer() for _ in range(customers)]
        rows = [make_payment(customer=people[c], amount=captured) for c, captured in payments]
        keys = {name: make_agent_key("refunds.create")[0] for name in AGENTS if name}
        staff = make_staff(f"staff-{uuid.uuid4().hex[:8]}", authority_minor=STAFF_AUTHORITY)
        now, decisions, refund_ids = start, [], []
        for ask in asks:
            now += timedelta(minutes=ask.gap_minutes)
            caller = Caller.for_key(keys[ask.agent]) if ask.agent else Caller.for_user(staff)
            body = {"transaction_id": rows[ask.payment].pk, "reason": "duplicate",
                    **({"amount": ask.amount} if ask.amount else {}),
                    **({"agent": {"session_id": ask.session}} if ask.session else {})}
            with time_machine.travel(now, tick=False):
                answer = request_refund(caller=caller, data=body, idempotency_key=uuid.uuid4().hex)
            expected = reference.decide(ask, now)
            decisions.append(expected)
            got = {201: "approved", 202: "held"}.get(answer.status, "denied")
            assert (got, answer.code or "", answer.body.get("hold_reasons", [])) == (
                expected.outcome, expected.code, expected.hold_reasons), (ask, now, answer.body)
            if answer.ok:
                refund_ids.append(answer.body["refund"]["id"])
        report(decisions)
        # The database's refunds in the order they were asked for (several can share a time).
        counted = Refund.objects.filter(status__in=COUNTING_STATES).select_related("payment").in_bulk()
        assert set(counted) == set(refund_ids)
        paid = [Paid(rows.index(next(r for r in rows if r.pk == refund.payment_id)),
                     people.index(next(p for p in people if p.pk == refund.payment.customer_id)),
                     refund.amount_minor, _name_of(keys, refund.agent_id), refund.agent_session_id,
                     refund.counted_at, held=refund.status == "held")
                for refund in (counted[pk] for pk in refund_ids)]
        assert_within_bounds(paid, payments, limit_values)
        for payment in Payment.objects.filter(pk__in=[r.pk for r in rows]):
            assert payment.amount_reserved_minor + payment.amount_refunded_minor <= payment.amount_captured_minor
        transaction.set_rollback(True)  # each example starts from an empty database


def _name_of(keys: dict, agent_id: str | None) -> str | None:
    return next((name for name, key in keys.items() if key.agent_id == agent_id), None)
