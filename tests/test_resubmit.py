"""Resubmitting a failed refund is a new ask today: it runs under the locks a new refund takes,
counts in today's totals, and the policy decides it again (issue 8, finding 4)."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.utils import timezone

from approvals.services import ApprovalError, resubmit_refund
from audit.models import Verdict
from refundops.callers import Caller
from refundops.models import Refund, RefundState
from refundops.selectors import running_totals
from refundops.services import payouts
from refundops.services.refunds import request_refund
from tests.conftest import make_agent_key, make_customer, make_limits, make_payment, make_rules, make_staff, race
from tests.test_approvals import approver


def failed_refund(amount: int, *, payment=None, key=None, days_ago: float = 2) -> Refund:
    """An agent's refund the gateway refused ``days_ago`` days ago (as the worker records a decline)."""
    payment = payment or make_payment(amount=20_000)
    then = timezone.now() - timedelta(days=days_ago)
    refund = Refund.objects.create(payment=payment, amount_minor=amount, currency=payment.currency,
                                   reason="product_issue", agent=(key or make_agent_key()[0]).agent,
                                   status=RefundState.FAILED, failure_code="card_closed")
    Refund.objects.filter(pk=refund.pk).update(created_at=then, counted_at=then)
    return Refund.objects.get(pk=refund.pk)


def totals_now(refund: Refund):
    return running_totals(payment=refund.payment, agent_id=refund.agent_id, session_id="",
                          now=timezone.now())


@pytest.mark.django_db
def test_a_resubmitted_refund_counts_in_todays_customer_agent_and_global_totals():
    make_limits(), make_rules()
    refund = failed_refund(3_000, days_ago=2)
    assert totals_now(refund).global_day_minor == 0
    resubmit_refund(refund_id=refund.pk, approver=approver("alice", limit=50_000))
    totals = totals_now(refund)
    assert (totals.customer_day_count, totals.customer_day_minor) == (1, 3_000)
    assert (totals.agent_day_minor, totals.agent_hour_minor, totals.global_day_minor) == (3_000, 3_000, 3_000)
    refund.refresh_from_db()
    assert refund.created_at < timezone.now() - timedelta(days=1)  # still the day it was asked for


@pytest.mark.django_db
def test_a_resubmission_over_todays_limit_is_refused_with_a_verdict_and_stays_failed():
    make_limits(customer_daily_amount_minor=5_000), make_rules()
    customer = make_customer()
    refund = failed_refund(3_000, payment=make_payment(amount=20_000, customer=customer))
    other = make_payment(amount=20_000, customer=customer)
    answer = request_refund(caller=Caller.for_key(make_agent_key()[0]), idempotency_key=uuid.uuid4().hex,
                            data={"transaction_id": other.pk, "amount": 2_500, "reason": "product_issue"})
    assert answer.status == 201  # today's customer total: 2,500 of 5,000
    with pytest.raises(ApprovalError) as refused:
        resubmit_refund(refund_id=refund.pk, approver=approver("alice", limit=50_000))
    assert refused.value.code == "DAILY_LIMIT_REACHED"
    assert Refund.objects.get(pk=refund.pk).status == RefundState.FAILED
    verdict = Verdict.objects.get(operation="refund.resubmit", refund_id=refund.pk)
    assert (verdict.outcome, verdict.code, verdict.staff_username) == ("denied", "DAILY_LIMIT_REACHED", "alice")
    assert verdict.totals["customer_day_minor"] == 2_500


@pytest.mark.django_db
def test_a_resubmission_the_policy_would_hold_now_waits_for_a_decision():
    make_limits(), make_rules()
    refund = failed_refund(3_000)
    refund.payment.fraud_flags = ["velocity"]  # flagged since the refund was approved
    refund.payment.save()
    resubmitted = resubmit_refund(refund_id=refund.pk, approver=approver("alice", limit=50_000))
    assert resubmitted.status == RefundState.HELD
    assert resubmitted.hold_reasons == ["PAYMENT_FLAGGED"]
    verdict = Verdict.objects.get(operation="refund.resubmit", refund_id=refund.pk)
    assert (verdict.outcome, verdict.hold_reasons) == ("held", ["PAYMENT_FLAGGED"])
    assert totals_now(refund).global_day_minor == 3_000  # held refunds count too


@pytest.mark.django_db
def test_the_resubmitting_persons_authority_stands_for_the_approval_threshold():
    make_limits(approval_threshold_minor=1_000), make_rules()
    payment = make_payment(amount=20_000)
    staff = make_staff("bob")
    answer = request_refund(caller=Caller.for_user(staff), idempotency_key=uuid.uuid4().hex,
                            data={"transaction_id": payment.pk, "amount": 3_000, "reason": "product_issue"})
    assert answer.status == 202  # above the threshold: held for someone else
    from approvals.services import approve_refund
    alice = approver("alice", limit=50_000)
    approve_refund(refund_id=answer.body["refund"]["id"], approver=alice)
    payouts.record_gateway_failure(refund_id=answer.body["refund"]["id"], code="card_closed", message="closed")
    resubmitted = resubmit_refund(refund_id=answer.body["refund"]["id"], approver=alice)
    assert resubmitted.status == RefundState.APPROVED
    verdict = Verdict.objects.get(operation="refund.resubmit", refund_id=resubmitted.pk)
    assert verdict.outcome == "approved"


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("quiet_breaker")
def test_a_resubmission_and_new_refunds_racing_for_the_global_limit_never_pass_it():
    make_limits(global_daily_amount_minor=4_000), make_rules()
    alice = approver("alice", limit=50_000)
    failed = failed_refund(3_000, days_ago=0)  # counted today until it failed; now it does not count
    fresh = [make_payment(amount=20_000) for _ in range(5)]
    keys = [make_agent_key()[0] for _ in range(5)]

    def work(i: int) -> str:
        if i == 5:
            try:
                return resubmit_refund(refund_id=failed.pk, approver=alice).status
            except ApprovalError as refused:
                return refused.code
        answer = request_refund(caller=Caller.for_key(keys[i]), idempotency_key=uuid.uuid4().hex,
                                data={"transaction_id": fresh[i].pk, "amount": 1_000, "reason": "product_issue"})
        return answer.body["refund"]["status"] if answer.ok else answer.code

    results = race(6, work)
    # Whatever the order, the day fills exactly: 3,000 + 1,000, or four of 1,000 and the resubmission refused.
    assert totals_now(failed).global_day_minor == 4_000, results
    assert set(results) == {"approved", "DAILY_LIMIT_REACHED"}, results


@pytest.mark.django_db(transaction=True)
def test_a_resubmission_waits_for_every_refund_decision_in_flight():
    import threading

    from django.db import connection, transaction

    from refundops.locks import lock_scopes
    from tests.conftest import make_customer

    make_limits(), make_rules()
    alice = approver("alice", limit=50_000)
    failed = failed_refund(3_000)
    done = []

    def resubmit() -> None:
        try:
            done.append(resubmit_refund(refund_id=failed.pk, approver=alice).status)
        finally:
            connection.close()

    with transaction.atomic():
        # Another customer's refund being decided right now: the resubmission takes the currency's
        # lock exclusively, so it waits for that one's totals to commit.
        lock_scopes(customer_id=make_customer().pk, agent_id=None, currency="USD")
        worker = threading.Thread(target=resubmit)
        worker.start()
        worker.join(timeout=1.5)
        assert worker.is_alive() and not done  # decided only after that refund's totals commit
    worker.join(timeout=10)
    assert done == [RefundState.APPROVED]


@pytest.mark.django_db
def test_the_resubmitting_persons_authority_stands_for_the_cumulative_threshold_too():
    make_limits(approval_threshold_minor=5_000), make_rules()
    payment = make_payment(amount=20_000)
    key = make_agent_key()[0]
    first = request_refund(caller=Caller.for_key(key), idempotency_key=uuid.uuid4().hex,
                           data={"transaction_id": payment.pk, "amount": 4_000, "reason": "product_issue"})
    assert first.status == 201
    failed = failed_refund(3_000, payment=payment, key=key, days_ago=0.1)  # 40.00 + 30.00 pass 50.00
    resubmitted = resubmit_refund(refund_id=failed.pk, approver=approver("alice", limit=50_000))
    assert resubmitted.status == RefundState.APPROVED
    verdict = Verdict.objects.get(operation="refund.resubmit", refund_id=resubmitted.pk)
    check = next(c for c in verdict.checks if c["name"] == "approval_threshold_cumulative")
    assert check["result"] == "pass" and "whose authority covers it" in check["message"]
