"""Held refunds and the people who decide them: authority, rejection, expiry, reservations."""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta

import pytest
from django.conf import settings
from django.contrib.auth.models import Permission, User
from django.db import connection
from django.utils import timezone

from approvals.models import ApprovalAuthority
from approvals.services import ApprovalError, approve_refund, expire_held_refunds, reject_refund
from audit.models import AuditEntry
from refundops.callers import Caller
from refundops.models import Refund, RefundState
from refundops.services.refunds import request_refund
from tests.conftest import make_agent_key, make_limits, make_payment, make_rules

pytestmark = pytest.mark.django_db


@pytest.fixture
def held_policy(db):
    """Agents may refund up to 50.00 USD alone; above that a person decides."""
    return make_limits(approval_threshold_minor=5_000), make_rules()


def approver(username: str = "alice", *, limit: int | None = 20_000, currency: str = "USD",
             can_decide: bool = True) -> User:
    user = User.objects.create_user(username=username, is_staff=True)
    if can_decide:
        user.user_permissions.add(Permission.objects.get(codename="approve_refund"))
    if limit is not None:
        ApprovalAuthority.objects.create(user=user, currency=currency, max_amount_minor=limit)
    return User.objects.get(pk=user.pk)


def ask(caller: Caller, payment, amount: int) -> dict:
    answer = request_refund(caller=caller, idempotency_key=uuid.uuid4().hex,
                            data={"transaction_id": payment.pk, "amount": amount, "reason": "product_issue"})
    return answer.body


def held_refund(amount: int = 9_000, *, payment=None, caller: Caller | None = None) -> Refund:
    payment = payment or make_payment(amount=20_000)
    body = ask(caller or Caller.for_key(make_agent_key()[0]), payment, amount)
    assert body["status"] == "held", body
    return Refund.objects.get(pk=body["refund"]["id"])


def test_approving_within_authority_approves_and_hands_the_refund_to_the_worker(
        held_policy, django_capture_on_commit_callbacks):
    refund = held_refund(9_000)
    alice = approver(limit=10_000)
    with django_capture_on_commit_callbacks(execute=True) as callbacks:
        approve_refund(refund_id=refund.pk, approver=alice, note="checked the order")
    assert len(callbacks) == 1
    refund.refresh_from_db()
    assert refund.status == RefundState.SUBMITTED  # the eager worker paid it through the sandbox
    assert refund.processor_refund_id.startswith("sbre_")
    approved = refund.history.filter(status=RefundState.APPROVED).get()
    assert approved.history_change_reason == "approved by alice: checked the order"
    entry = AuditEntry.objects.get(action="refund.approved", subject_id=refund.pk)
    assert entry.actor == "user:alice" and entry.data["note"] == "checked the order"


def test_approving_above_ones_authority_is_refused_with_the_amounts(held_policy):
    refund = held_refund(9_000)
    with pytest.raises(ApprovalError) as refused:
        approve_refund(refund_id=refund.pk, approver=approver(limit=5_000))
    assert refused.value.code == "APPROVAL_NOT_AUTHORIZED"
    assert refused.value.message == "90.00 USD is above alice's authority of 50.00 USD."
    refund.refresh_from_db()
    assert refund.status == RefundState.HELD


@pytest.mark.parametrize("authority", ["none", "other currency", "inactive"])
def test_approving_without_authority_in_the_refunds_currency_is_refused(held_policy, authority):
    refund = held_refund(9_000)
    bob = approver("bob", limit=None if authority == "none" else 1_000_000,
                   currency="EUR" if authority == "other currency" else "USD")
    if authority == "inactive":
        ApprovalAuthority.objects.filter(user=bob).update(is_active=False)
    with pytest.raises(ApprovalError, match="bob has no refund authority in USD"):
        approve_refund(refund_id=refund.pk, approver=bob)
    refund.refresh_from_db()
    assert refund.status == RefundState.HELD and not AuditEntry.objects.filter(action="refund.approved").exists()


def test_rejecting_releases_the_reservation_and_records_who_and_why(held_policy):
    payment = make_payment(amount=20_000)
    refund = held_refund(9_000, payment=payment)
    reject_refund(refund_id=refund.pk, approver=approver(), note="customer kept the goods")
    refund.refresh_from_db()
    payment.refresh_from_db()
    assert (refund.status, refund.failure_code, refund.failure_message) == (
        RefundState.REJECTED, "REJECTED", "customer kept the goods")
    assert payment.amount_reserved_minor == 0 and payment.refundable_minor == 20_000
    assert refund.history.latest().history_change_reason == "rejected by alice: customer kept the goods"
    assert AuditEntry.objects.get(action="refund.rejected", subject_id=refund.pk).actor == "user:alice"


@pytest.mark.parametrize("decide", [approve_refund, reject_refund])
def test_approving_or_rejecting_needs_the_permission_to_decide(held_policy, decide):
    refund = held_refund()
    with pytest.raises(ApprovalError, match="may not decide held refunds"):
        decide(refund_id=refund.pk, approver=approver(can_decide=False))
    refund.refresh_from_db()
    assert refund.status == RefundState.HELD


def test_a_refund_that_is_not_held_cannot_be_approved_or_rejected(held_policy):
    body = ask(Caller.for_key(make_agent_key()[0]), make_payment(), 1_000)
    assert body["refund"]["status"] == "approved"
    for decide in (approve_refund, reject_refund):
        with pytest.raises(ApprovalError) as refused:
            decide(refund_id=body["refund"]["id"], approver=approver(f"u{decide.__name__}"))
        assert refused.value.code == "REFUND_NOT_HELD"


def test_held_refunds_expire_after_the_configured_hours_and_give_their_amount_back(held_policy):
    payment = make_payment(amount=20_000)
    old = held_refund(9_000, payment=payment)
    hours = settings.HELD_REFUND_EXPIRY_HOURS
    then = timezone.now() - timedelta(hours=hours, minutes=1)
    Refund.objects.filter(pk=old.pk).update(created_at=then, counted_at=then)
    fresh = held_refund(8_000, payment=payment)
    assert expire_held_refunds() == 1
    old.refresh_from_db()
    fresh.refresh_from_db()
    payment.refresh_from_db()
    assert (old.status, fresh.status) == (RefundState.EXPIRED, RefundState.HELD)
    assert payment.amount_reserved_minor == 8_000
    assert old.history.latest().history_change_reason == f"no decision within {hours}h"
    assert AuditEntry.objects.get(action="refund.expired", subject_id=old.pk).actor == "system:expiry"


def test_a_held_refund_reserves_its_amount_until_it_leaves_held(held_policy):
    payment = make_payment(amount=10_000)
    caller = Caller.for_key(make_agent_key()[0])
    refund = held_refund(9_000, payment=payment, caller=caller)
    payment.refresh_from_db()
    assert payment.amount_reserved_minor == 9_000 and payment.refundable_minor == 1_000
    refused = ask(caller, payment, 2_000)
    assert refused["error"]["code"] == "AMOUNT_EXCEEDS_REFUNDABLE"
    reject_refund(refund_id=refund.pk, approver=approver())
    assert ask(caller, payment, 2_000)["refund"]["status"] == "approved"


def test_a_person_cannot_approve_a_refund_they_asked_for_but_a_colleague_can(held_policy):
    alice = approver("alice", limit=50_000)
    refund = held_refund(9_000, caller=Caller.for_user(alice))
    assert refund.origin == Refund.Origin.STAFF and refund.requested_by == alice
    with pytest.raises(ApprovalError, match="cannot decide a refund they asked for"):
        approve_refund(refund_id=refund.pk, approver=alice)
    approve_refund(refund_id=refund.pk, approver=approver("bob", limit=50_000))
    refund.refresh_from_db()
    assert refund.status == RefundState.APPROVED


@pytest.mark.django_db(transaction=True)
def test_two_people_deciding_the_same_refund_at_once_decide_it_once():
    make_limits(approval_threshold_minor=5_000)
    make_rules()
    refund = held_refund(9_000)
    people = [approver("alice"), approver("bob")]
    barrier = threading.Barrier(2)
    outcomes: list[str] = []

    def decide(person, action):
        barrier.wait()
        try:
            action(refund_id=refund.pk, approver=person)
            outcomes.append("done")
        except ApprovalError as refused:
            outcomes.append(refused.code)
        finally:
            connection.close()

    threads = [threading.Thread(target=decide, args=(people[0], approve_refund)),
               threading.Thread(target=decide, args=(people[1], reject_refund))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(outcomes) == ["REFUND_NOT_HELD", "done"]
    assert AuditEntry.objects.filter(action__in=["refund.approved", "refund.rejected"]).count() == 1


def test_a_person_resubmits_a_failed_refund_as_a_new_gateway_attempt(held_policy, django_capture_on_commit_callbacks):
    from approvals.services import resubmit_refund
    from refundops.services import payouts

    refund = held_refund(9_000)
    alice = approver("alice", limit=50_000)
    approve_refund(refund_id=refund.pk, approver=alice)
    first_key = payouts.gateway_idempotency_key(Refund.objects.get(pk=refund.pk))
    payouts.record_gateway_failure(refund_id=refund.pk, code="card_closed", message="card was closed")
    with django_capture_on_commit_callbacks() as queued:
        resubmitted = resubmit_refund(refund_id=refund.pk, approver=alice, note="customer has a new card")
    assert resubmitted.status == RefundState.APPROVED and len(queued) == 1
    assert payouts.gateway_idempotency_key(resubmitted) != first_key
    assert resubmitted.payment.amount_reserved_minor == 9_000
    with pytest.raises(ApprovalError) as refused:
        resubmit_refund(refund_id=refund.pk, approver=alice)
    assert refused.value.code == "REFUND_NOT_FAILED"


def test_a_failed_refund_that_no_longer_fits_is_not_resubmitted(held_policy):
    from approvals.services import resubmit_refund
    from refundops.services import payouts

    payment = make_payment(amount=20_000)
    refund = held_refund(9_000, payment=payment)
    alice = approver("alice", limit=50_000)
    approve_refund(refund_id=refund.pk, approver=alice)
    payouts.record_gateway_failure(refund_id=refund.pk, code="card_closed", message="card was closed")
    ask(Caller.for_key(make_agent_key()[0]), payment, 15_000)  # the freed amount is taken meanwhile
    with pytest.raises(ApprovalError) as refused:
        resubmit_refund(refund_id=refund.pk, approver=alice)
    assert refused.value.code == "AMOUNT_EXCEEDS_REFUNDABLE"
    assert Refund.objects.get(pk=refund.pk).status == RefundState.FAILED
