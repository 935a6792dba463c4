"""Races on refundops.locks' scopes that tests/test_scope_locks.py does not cover: a decision held in
flight (paused after its decision, before its commit) while others decide, switches change or the
limits do. Real PostgreSQL, real threads."""

from __future__ import annotations

import threading
import uuid

import pytest
from django.db import connection
from django.db.models import Sum

from audit.models import AuditEntry, Verdict
from processors.base import RefundResult, WebhookEvent
from processors.money import Money
from proposals.models import Proposal
from proposals.services import approve_proposal, propose_change
from refundops import locks
from refundops.callers import Caller
from refundops.models import COUNTING_STATES, Refund, RefundState
from refundops.services.gateway_events import record_external_refund
from refundops.services.refunds import request_refund
from tests.conftest import make_agent_key, make_limits, make_payment, make_rules, make_staff, race
from tests.test_four_eyes import staff
from tests.test_scope_locks import _signed, agent_refund, in_thread

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("quiet_breaker")]


class Paused:
    """Pauses the refund decision of one thread after it decided and wrote its refund, before its
    commit (at its audit entry, made after the refund was sent), until ``release``; the other threads
    pass through."""

    def __init__(self, monkeypatch) -> None:
        import refundops.services.refunds as refunds

        self.thread: threading.Thread | None = None
        self.decided, self.go = threading.Event(), threading.Event()
        new_audit_entry = refunds.new_audit_entry

        def paused(**kwargs):
            if threading.current_thread() is self.thread:
                self.decided.set()
                assert self.go.wait(timeout=30)
            return new_audit_entry(**kwargs)

        monkeypatch.setattr(refunds, "new_audit_entry", paused)

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
    waited = later.is_alive()  # for the refund of its customer in flight
    switch, switched = in_thread(lambda: set_agents_disabled(disabled=True, actor="cli:test").agents_disabled)
    switch.join(timeout=1.5)
    paused.release()
    assert waited
    for thread in (first, switch, later):
        thread.join(timeout=20)
        assert not thread.is_alive()
    assert first_done == [201] and switched == [True]
    assert later_done == ["CIRCUIT_OPEN"], later_done


# -- attacks that held on 478f0b9: kept so they keep holding -------------------------------------

def _slots_and_currency_held_by(thread_pid: int, currency: str = "USD") -> tuple[int, str]:
    """How many fast-path slots the backend ``thread_pid`` holds, and its mode on the currency's lock."""
    slots = [locks.advisory_key("slot", currency, str(i)) for i in range(locks.FAST_PATH_SLOTS)]
    with connection.cursor() as cursor:
        cursor.execute("SELECT (classid::bigint << 32) | objid::bigint, mode FROM pg_locks "
                       "WHERE locktype = 'advisory' AND granted AND objsubid = 1 AND pid = %s", [thread_pid])
        held = {_signed(key): mode for key, mode in cursor.fetchall()}
    return sum(key in held for key in slots), held.get(locks.advisory_key("currency", currency), "")


def _pid_of_the_paused_one() -> int:
    """The backend of the one other session holding this database's currency lock (a paused decision)."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1 "
                       "AND pid <> pg_backend_pid() AND ((classid::bigint << 32) | objid::bigint) = %s "
                       "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
                       [locks.advisory_key("currency", "USD") & ((1 << 64) - 1)])
        pids = {row[0] for row in cursor.fetchall()}
    assert len(pids) == 1, pids
    return pids.pop()


def test_a_refund_of_the_whole_refundable_holds_the_slots_that_amount_fills(monkeypatch):
    """No amount asked: the policy decides on what is still refundable, and the fast path took its
    slots for that same amount (7,500 of slots of 1,000: eight), not for none."""
    make_rules(), make_limits(global_daily_amount_minor=128_000)
    person = make_staff("finance-whole")
    payment = make_payment(amount=7_500)
    paused = Paused(monkeypatch)
    thread, done = paused.start(lambda: request_refund(
        caller=Caller.for_user(person), idempotency_key=uuid.uuid4().hex,
        data={"transaction_id": payment.pk, "reason": "customer_request"}).body["refund"]["amount"])
    try:
        slots, currency_mode = _slots_and_currency_held_by(_pid_of_the_paused_one())
    finally:
        paused.release()
    thread.join(timeout=20)
    assert done == [7_500]
    assert (slots, currency_mode) == (8, "ShareLock")


def test_a_decision_near_the_limit_is_redone_holding_the_currency_exclusively_no_slot_and_one_of_each(monkeypatch):
    """Past three quarters of the day's limit the fast path gives way: the savepoint is undone (its
    slots and shared locks go) and the decision is taken again holding the currency's lock
    exclusively. What the first try read leaves nothing: one verdict, one refund, one audit entry."""
    make_rules(), make_limits(global_daily_amount_minor=12_800)
    filler = make_payment(amount=12_800)
    Refund.objects.create(payment=filler, amount_minor=9_600, currency="USD", reason="duplicate",
                          status=RefundState.SETTLED)
    key, _ = make_agent_key()
    payment = make_payment()
    paused = Paused(monkeypatch)
    thread, done = paused.start(lambda: agent_refund(key, payment, 100).body["refund"]["id"])
    try:
        slots, currency_mode = _slots_and_currency_held_by(_pid_of_the_paused_one())
    finally:
        paused.release()
    thread.join(timeout=20)
    assert (slots, currency_mode) == (0, "ExclusiveLock")
    [refund_id] = done
    assert Verdict.objects.filter(payment_id=payment.pk).count() == 1
    assert Refund.objects.filter(payment=payment).count() == 1
    assert AuditEntry.objects.filter(subject_id=refund_id, action="refund.approved").count() == 1


def test_an_external_refund_waits_for_a_fast_path_refund_in_flight_and_the_next_decision_counts_both(monkeypatch):
    """A refund made on the gateway counts in the day's total at once; it is no decision holding
    slots, so it takes the currency's lock exclusively: it waits for the fast-path refund in flight,
    and a decision after it sees them both (12,800 limit: 1,000 + 9,000, then 2,801 is over it)."""
    make_rules(), make_limits(global_daily_amount_minor=12_800)
    key, _ = make_agent_key()
    paused = Paused(monkeypatch)
    first, first_done = paused.start(lambda: agent_refund(key, make_payment(), 1_000).status)
    gateway_paid = make_payment(amount=9_000)
    external, recorded = in_thread(lambda: record_external_refund(
        payment_id=gateway_paid.pk, reason="customer_request",
        result=RefundResult(processor_refund_id="re_dashboard", status="succeeded", amount=Money(9_000, "USD")),
        event=WebhookEvent(processor="sandbox", event_id="evt_dashboard", type="refund.created",
                           object_id="re_dashboard")))
    external.join(timeout=1.5)
    waited = external.is_alive() and not recorded  # the refund in flight is decided before it
    paused.release()
    assert waited
    for thread in (first, external):
        thread.join(timeout=20)
        assert not thread.is_alive()
    assert first_done == [201] and "recorded external refund" in recorded[0]
    assert agent_refund(key, make_payment(), 2_801).code == "DAILY_LIMIT_REACHED"
    assert agent_refund(key, make_payment(), 2_800).status == 201


def test_every_writer_of_the_day_total_racing_on_shared_customers_and_agents_deadlocks_none_and_keeps_the_limit():
    """Agents' refunds (fast and exclusive), people's refunds of the whole refundable, resubmissions,
    refunds made on the gateway, the kill switch going on and off and a change of the limits, all at
    once on three customers and three agents, across the day's three-quarter mark: nothing waits on
    anything in a circle (PostgreSQL would fail one with a deadlock), and the decided refunds keep the
    day's limit (the gateway's refunds are facts: only they may take it over)."""
    from approvals.services import ApprovalError, resubmit_refund
    from refundops.services.agents import set_killswitch
    from tests.test_approvals import approver
    from tests.test_resubmit import failed_refund

    make_rules()
    limit = 12_800  # slots of 100
    make_limits(global_daily_amount_minor=limit)
    customers = [make_payment().customer for _ in range(3)]
    Refund.objects.create(payment=make_payment(amount=limit, customer=customers[0]), amount_minor=9_400,
                          currency="USD", reason="duplicate", status=RefundState.SETTLED)
    keys = [make_agent_key() for _ in range(3)]
    person, resubmitter = make_staff("finance-race"), approver("alice", limit=50_000)
    maker, _ = staff("maker", "finance approver")
    checker, _ = staff("checker", "finance approver")
    proposal = propose_change(kind=Proposal.Kind.REFUND_LIMITS, subject_id="USD",
                              changes={"customer_30d_count": 9_999}, proposer=maker)
    failed = [failed_refund(200, payment=make_payment(amount=1_000, customer=customers[i]), key=keys[i][0])
              for i in range(2)]
    jobs = []
    for i in range(14):
        payment = make_payment(customer=customers[i % 3])
        jobs.append(lambda i=i, payment=payment: agent_refund(keys[i % 3][0], payment, 100 + 100 * (i % 3)).code
                    or "approved")
    for i in range(2):
        payment = make_payment(amount=300, customer=customers[i])
        jobs.append(lambda payment=payment: request_refund(
            caller=Caller.for_user(person), idempotency_key=uuid.uuid4().hex,
            data={"transaction_id": payment.pk, "reason": "customer_request"}).code or "approved")
    for refund in failed:
        def resubmit(refund=refund):
            try:
                return resubmit_refund(refund_id=refund.pk, approver=resubmitter).status
            except ApprovalError as refused:
                return refused.code
        jobs.append(resubmit)
    for i in range(2):
        payment = make_payment(amount=1_000, customer=customers[i + 1])
        jobs.append(lambda i=i, payment=payment: record_external_refund(
            payment_id=payment.pk, reason="customer_request",
            result=RefundResult(processor_refund_id=f"re_race{i}", status="succeeded", amount=Money(100, "USD")),
            event=WebhookEvent(processor="sandbox", event_id=f"evt_race{i}", type="refund.created",
                               object_id=f"re_race{i}")) and "external")
    jobs.append(lambda: (set_killswitch(on=True, actor="cli:race"), set_killswitch(on=False, actor="cli:race"))
                and "switched")
    jobs.append(lambda: approve_proposal(proposal_id=proposal.pk, approver=checker).status)

    results = race(len(jobs), lambda i: jobs[i]())  # fails on any thread's error: a deadlock is one
    assert set(results) <= {"approved", "held", "DAILY_LIMIT_REACHED", "CIRCUIT_OPEN", "external", "switched",
                            Proposal.Status.APPROVED}, results
    assert "approved" in results, results  # (how many the limit or the switch refused depends on the order)
    assert counted_today() <= limit + 2 * 100


def test_two_books_each_with_a_refund_in_the_others_currency_recorded_at_once_deadlock_neither():
    """One transaction records a payment's gateway refunds one after the other (import_payments,
    reconciliation). A refund in another currency than its payment's fits nowhere (it is raised as a
    discrepancy), so it must not take that other currency's lock: two such books, USD then EUR and
    EUR then USD, would each hold one currency exclusively and wait for the other's."""
    from django.db import transaction

    payments = {"USD": make_payment(amount=5_000, currency="USD"), "EUR": make_payment(amount=5_000, currency="EUR")}
    halfway = threading.Barrier(2)

    def record(payment, currency: str, n: str) -> str:
        return record_external_refund(
            payment_id=payment.pk, reason="customer_request",
            result=RefundResult(processor_refund_id=f"re_{n}", status="succeeded", amount=Money(100, currency)),
            event=WebhookEvent(processor="sandbox", event_id=f"evt_{n}", type="refund.created", object_id=f"re_{n}"))

    def book(i: int) -> list[str]:
        own, other = ("USD", "EUR") if i == 0 else ("EUR", "USD")
        with transaction.atomic():
            said = [record(payments[own], own, f"{own}_own")]
            halfway.wait(timeout=10)
            return [*said, record(payments[own], other, f"{own}_in_{other}")]

    results = race(2, book)  # fails on any thread's error: a deadlock is one
    assert all("recorded external refund" in first and "ledger discrepancy" in second for first, second in results)
    assert counted_today("USD") == counted_today("EUR") == 100


def test_no_scope_lock_shares_a_key_with_another_scope_or_the_audit_sealer():
    """One advisory key space (PostgreSQL's one-key form) holds the scopes and audit/chain.py's
    sealer lock: the fixed keys (platform, each currency's total and slots) are all distinct and
    none is the sealer's; a customer's or agent's key is named by its kind first, so no id (even one
    holding the separator) makes it another kind's."""
    from audit.chain import _CHAIN_LOCK_ID
    from processors.money import CURRENCY_CHOICES

    fixed = [locks.PLATFORM_KEY]
    for currency, _ in CURRENCY_CHOICES:
        fixed += [locks.advisory_key("currency", currency), *locks._slot_keys(currency)]
    assert len(set(fixed)) == len(fixed) and _CHAIN_LOCK_ID not in fixed
    assert all(-(1 << 63) <= key < (1 << 63) for key in fixed)  # a bigint
    crafted = "USD\x1f0"  # a slot's name after its kind: as a customer's or agent's id it stays theirs
    assert locks.advisory_key("customer", crafted) not in fixed and locks.advisory_key("agent", crafted) not in fixed
    assert locks.advisory_key("customer", "c1") != locks.advisory_key("agent", "c1")
