"""Races on refundops.locks' scopes that tests/test_scope_locks.py does not cover: a decision held in
flight (paused after its decision, before its commit) while others decide, switches change or the
limits do. Real PostgreSQL, real threads."""

from __future__ import annotations

import threading

import pytest
from django.db.models import Sum

from proposals.models import Proposal
from proposals.services import approve_proposal, propose_change
from refundops.models import COUNTING_STATES, Refund
from tests.conftest import make_agent_key, make_limits, make_payment, make_rules
from tests.test_four_eyes import staff
from tests.test_scope_locks import agent_refund, in_thread

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("quiet_breaker")]


class Paused:
    """Pauses the refund decision of one thread after it decided and wrote its refund, before its
    commit (at its audit entry), until ``release``; the other threads pass through."""

    def __init__(self, monkeypatch) -> None:
        import refundops.services.refunds as refunds

        self.thread: threading.Thread | None = None
        self.decided, self.go = threading.Event(), threading.Event()
        record_audit = refunds.record_audit

        def paused(**kwargs):
            if threading.current_thread() is self.thread:
                self.decided.set()
                assert self.go.wait(timeout=30)
            return record_audit(**kwargs)

        monkeypatch.setattr(refunds, "record_audit", paused)

    def start(self, work) -> tuple[threading.Thread, list]:
        barrier = threading.Event()  # the thread is known before it decides
        results: list = []

        def run():
            barrier.wait()
            results.append(work())

        thread, _ = in_thread(run)
        self.thread = thread
        barrier.set()
        assert self.decided.wait(timeout=10), "the paused decision never got to its commit"
        return thread, results

    def release(self) -> None:
        self.go.set()


def counted_today(currency: str = "USD") -> int:
    return Refund.objects.filter(status__in=COUNTING_STATES, currency=currency).aggregate(s=Sum("amount_minor"))["s"]


def test_a_global_daily_limit_lowered_while_a_refund_is_in_flight_holds_for_the_next_decision(monkeypatch):
    """A refund decided on the fast path under the old limit is in flight (its slots are sized by that
    limit) when a person lowers the limit. A refund decided under the new limit must count it: the
    two together are over the new limit, so the later one is refused, as it was when every decision
    waited for the one before."""
    make_rules()
    make_limits(global_daily_amount_minor=128_000)  # slots of 1,000: 12,000 takes 12 of 32
    maker, _ = staff("maker", "finance approver")
    checker, _ = staff("checker", "finance approver")
    first_key, _ = make_agent_key()
    later_key, _ = make_agent_key()
    paused = Paused(monkeypatch)
    first, first_done = paused.start(lambda: agent_refund(first_key, make_payment(amount=20_000), 12_000).status)

    # New limit 12,800: slots of 100; 1,000 takes 10, and 12,000 + 1,000 is over it.
    proposal = propose_change(kind=Proposal.Kind.REFUND_LIMITS, subject_id="USD",
                              changes={"global_daily_amount_minor": 12_800}, proposer=maker)
    change, changed = in_thread(lambda: approve_proposal(proposal_id=proposal.pk, approver=checker).status)
    change.join(timeout=1.5)
    later, later_done = in_thread(lambda: agent_refund(later_key, make_payment(), 1_000).code)
    later.join(timeout=1.5)
    paused.release()
    for thread in (first, change, later):
        thread.join(timeout=20)
        assert not thread.is_alive()
    assert first_done == [201] and changed == [Proposal.Status.APPROVED]
    assert later_done == ["DAILY_LIMIT_REACHED"], later_done
    assert counted_today() == 12_000


def test_a_refund_decided_after_agents_are_switched_off_is_refused_though_its_key_was_checked_before(monkeypatch):
    """The key is checked when the request comes in; the switch commits while the request waits for
    its customer's lock (a refund of the same customer is in flight). The decision comes after the
    switch: like the kill switch, it must see it (refundops.locks.lock_platform)."""
    from refundops.access import authenticate_key
    from refundops.callers import Caller
    from refundops.services.agents import set_agents_disabled
    from refundops.services.refunds import request_refund

    make_rules(), make_limits()
    busy_key, _ = make_agent_key()
    key, raw = make_agent_key()
    busy = make_payment(amount=20_000)
    paused = Paused(monkeypatch)
    first, first_done = paused.start(lambda: agent_refund(busy_key, busy, 1_000).status)
    caller = Caller.for_key(authenticate_key(raw))  # agents are on when the request comes in
    later, later_done = in_thread(lambda: request_refund(
        caller=caller, idempotency_key="after-the-switch",
        data={"transaction_id": make_payment(customer=busy.customer).pk, "amount": 1_000,
              "reason": "customer_request"}).code)
    later.join(timeout=1.5)
    assert later.is_alive()  # waits for the refund of its customer in flight
    switch, switched = in_thread(lambda: set_agents_disabled(disabled=True, actor="cli:test").agents_disabled)
    switch.join(timeout=1.5)
    paused.release()
    for thread in (first, switch, later):
        thread.join(timeout=20)
        assert not thread.is_alive()
    assert first_done == [201] and switched == [True]
    assert later_done == ["CIRCUIT_OPEN"], later_done
