"""No row that every refund waits on: a decision locks its own scopes (payment, customer, agent) and
holds the platform's and the currency's locks shared, so refunds of different customers and agents
run side by side; the same customer or the same agent, a switch, and the last stretch of the global
daily limit serialise (refundops.locks). Real PostgreSQL, real threads."""

from __future__ import annotations

import threading
import uuid

import pytest
from django.db import connection, transaction
from django.utils import timezone

from refundops import locks
from refundops.callers import Caller
from refundops.models import Refund, RefundState
from refundops.services.agents import set_killswitch
from refundops.services.refunds import request_refund
from tests.conftest import make_agent_key, make_customer, make_limits, make_payment, make_rules, race
from tests.test_refund_concurrency import counted, outcomes, refund

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("quiet_breaker")]


def agent_refund(key, payment, amount: int = 1_000):
    return request_refund(caller=Caller.for_key(key), idempotency_key=uuid.uuid4().hex,
                          data={"transaction_id": payment.pk, "amount": amount, "reason": "customer_request"})


def in_thread(work) -> tuple[threading.Thread, list]:
    done: list = []

    def run() -> None:
        try:
            done.append(work())
        finally:
            connection.close()

    thread = threading.Thread(target=run)
    thread.start()
    return thread, done


def decision_in_flight(*, customer_id: str, agent_id: str | None, currency: str = "USD"):
    """What a refund decision holds from its locks to its commit (the caller opens the transaction)."""
    return locks.lock_scopes(customer_id=customer_id, agent_id=agent_id, currency=currency)


@pytest.fixture
def setup():
    make_limits(), make_rules()


def test_a_refund_of_another_customer_by_another_agent_does_not_wait_for_one_in_flight(setup):
    busy_key, _ = make_agent_key()
    busy = make_payment()
    key, _ = make_agent_key()
    payment = make_payment()  # another customer
    with transaction.atomic():
        decision_in_flight(customer_id=busy.customer_id, agent_id=busy_key.agent_id)
        thread, done = in_thread(lambda: agent_refund(key, payment).status)
        thread.join(timeout=10)
        assert not thread.is_alive() and done == [201]  # decided and committed while the other holds


@pytest.mark.parametrize("shared", ["customer", "agent"])
def test_a_refund_of_the_same_customer_or_by_the_same_agent_waits_for_the_one_in_flight(setup, shared):
    busy_key, _ = make_agent_key()
    busy = make_payment()
    key = busy_key if shared == "agent" else make_agent_key()[0]
    payment = make_payment(customer=busy.customer) if shared == "customer" else make_payment()
    with transaction.atomic():
        decision_in_flight(customer_id=busy.customer_id, agent_id=busy_key.agent_id)
        thread, done = in_thread(lambda: agent_refund(key, payment).status)
        thread.join(timeout=1.5)
        assert thread.is_alive() and not done  # its totals must include the one in flight
        held, awaited = _advisory_locks_of_others(granted=True), _advisory_locks_of_others(granted=False)
    thread.join(timeout=10)
    assert done == [201]
    # While it waited for the customer's or agent's lock it held no fast-path slot: a queue on one
    # customer never takes the slots that other customers' refunds need.
    slots = {locks.advisory_key("slot", "USD", str(i)) for i in range(locks.FAST_PATH_SLOTS)}
    assert awaited and not (held & slots)


def _advisory_locks_of_others(*, granted: bool) -> set[int]:
    """The advisory lock keys (one-key form) held (or awaited) by other sessions on this database."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT (classid::bigint << 32) | objid::bigint FROM pg_locks WHERE locktype = 'advisory' "
                       "AND granted = %s AND objsubid = 1 AND pid <> pg_backend_pid() "
                       "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
                       [granted])
        return {_signed(row[0]) for row in cursor.fetchall()}


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


def test_the_kill_switch_waits_for_decisions_in_flight_and_every_later_one_sees_it(setup):
    busy = make_payment()
    key, _ = make_agent_key()
    with transaction.atomic():
        decision_in_flight(customer_id=busy.customer_id, agent_id=None)
        switch, switched = in_thread(lambda: set_killswitch(on=True, actor="cli:test").refunds_paused)
        switch.join(timeout=1.5)
        assert switch.is_alive() and not switched  # the decision under way is taken before it
    switch.join(timeout=10)
    assert switched == [True]
    answer = agent_refund(key, make_payment())
    assert (answer.status, answer.code) == (503, "CIRCUIT_OPEN")


@pytest.mark.parametrize("amounts", [(100,), (100, 250, 400)])
def test_the_global_daily_limit_holds_exactly_across_the_fast_path_and_the_exclusive_one(setup, monkeypatch, amounts):
    """Many customers, many agents: the first refunds pass on the fast path (the day is far from its
    limit; one slot of 100 each, or three or four for the larger ones), the last stretch is decided
    under the currency's lock held exclusively. The day never passes its limit, and both paths were
    taken. With one amount, the day ends exactly on its limit."""
    amount = 100
    limit = 128 * amount  # a slot covers a 128th of the limit
    make_limits(global_daily_amount_minor=limit)
    # The day already three quarters spent, less 20 refunds: about 20 pass fast, then the rest queue.
    filler = make_payment(amount=limit)
    Refund.objects.create(payment=filler, amount_minor=3 * limit // 4 - 20 * amount, currency="USD",
                          reason="duplicate", status=RefundState.SETTLED, counted_at=timezone.now())
    keys = [make_agent_key()[1] for _ in range(60)]
    payments = [make_payment().pk for _ in range(60)]  # 60 customers
    taken: list[bool] = []
    lock_scopes = locks.lock_scopes

    def spy(**kwargs):
        taken.append(kwargs["exclusive"])
        return lock_scopes(**kwargs)

    monkeypatch.setattr("refundops.services.refunds.lock_scopes", spy)
    results = race(60, lambda i: refund(keys[i], payments[i], amounts[i % len(amounts)]))
    room = limit - (3 * limit // 4 - 20 * amount)
    if len(amounts) == 1:
        assert outcomes(results) == {"approved": room // amount, "DAILY_LIMIT_REACHED": 60 - room // amount}
        assert counted()[1] == limit
    else:
        assert set(outcomes(results)) == {"approved", "DAILY_LIMIT_REACHED"}
        assert limit - max(amounts) < counted()[1] <= limit
    assert False in taken and True in taken, taken


def test_the_fast_path_takes_a_slot_for_each_share_of_the_headroom_an_amount_fills():
    limit = 128_000  # headroom 32,000 in 32 slots of 1,000
    assert [locks.slots_for(a, limit) for a in (1, 1_000, 1_001, 32_000, 32_001)] == [1, 1, 2, 32, 33]
    assert locks.slots_for(500, None) == 0  # no limits: nothing global to count against
    two = locks.ScopeLocks(exclusive=False, slots=2)
    assert two.global_fast_path(limit_minor=limit, committed_minor=0, amount_minor=2_000)
    assert not two.global_fast_path(limit_minor=limit, committed_minor=0, amount_minor=2_001)  # a third slot
    # The day past three quarters of its limit: nothing passes on the committed total alone.
    assert two.global_fast_path(limit_minor=limit, committed_minor=limit - 32_000 - 1_000, amount_minor=1_000)
    assert not two.global_fast_path(limit_minor=limit, committed_minor=limit - 32_000 - 999, amount_minor=1_000)
    assert locks.ScopeLocks(exclusive=True, slots=0).global_fast_path(
        limit_minor=limit, committed_minor=limit - 1, amount_minor=1)  # it saw every refund in flight


def test_a_decision_holds_the_slots_its_amount_fills_and_no_more(setup):
    key, _ = make_agent_key()
    payment = make_payment(amount=10_000)
    with transaction.atomic():
        scopes = locks.lock_scopes(customer_id=payment.customer_id, agent_id=key.agent_id, currency="USD", slots=3)
        with connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid() "
                           "AND mode = 'ExclusiveLock' AND objsubid = 1")
            exclusive_held = cursor.fetchone()[0]
    assert scopes.slots == 3 and not scopes.exclusive
    assert exclusive_held == 3 + 2  # the slots, the customer's and the agent's


def test_a_one_slot_refund_finding_every_slot_busy_waits_for_one_and_stays_on_the_fast_path(setup, monkeypatch):
    """Deciding it exclusively instead would queue every refund in the currency behind it."""
    busy = make_payment()
    key, _ = make_agent_key()
    taken: list[bool] = []
    lock_scopes = locks.lock_scopes

    def spy(**kwargs):
        scopes = lock_scopes(**kwargs)
        taken.append(scopes.exclusive)
        return scopes

    monkeypatch.setattr("refundops.services.refunds.lock_scopes", spy)
    with transaction.atomic():
        held = locks.lock_scopes(customer_id=busy.customer_id, agent_id=None, currency="USD",
                                 slots=locks.FAST_PATH_SLOTS)  # a large refund in flight holds them all
        assert held.slots == locks.FAST_PATH_SLOTS
        thread, done = in_thread(lambda: agent_refund(key, make_payment()).status)
        thread.join(timeout=1.5)
        assert thread.is_alive() and not done
        awaited = _advisory_locks_of_others(granted=False)
        slots = {locks.advisory_key("slot", "USD", str(i)) for i in range(locks.FAST_PATH_SLOTS)}
        assert awaited and awaited <= slots  # waiting for a slot, not for the currency exclusively
    thread.join(timeout=10)
    assert done == [201] and taken == [False]
