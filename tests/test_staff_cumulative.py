"""Staff do not split around the threshold: a person's refunds count toward the cumulative threshold
and toward the requester's own authority, as agents' do; the dashboard counts decisions only.
(Issue 28, finding 3.)"""

from __future__ import annotations

import re
from datetime import timedelta

import pytest
from django.contrib.admin.utils import quote
from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import Client
from django.utils import timezone

from approvals.models import ApprovalAuthority
from approvals.services import ApprovalError, approve_refund
from refundops import reports
from refundops.callers import Caller
from refundops.models import Refund, RefundState
from refundops.services.refunds import request_refund
from tests.conftest import make_agent_key, make_limits, make_payment, make_rules

pytestmark = pytest.mark.django_db

THRESHOLD = 20_000  # 200.00 USD


def staff(username: str, authority: int) -> tuple[User, Client]:
    user = User.objects.create_user(username, password="pw")
    call_command("grant_role", username, "finance approver", stdout=open("/dev/null", "w"))
    ApprovalAuthority.objects.create(user=user, currency="USD", max_amount_minor=authority)
    user = User.objects.get(pk=user.pk)
    client = Client()
    client.force_login(user)
    return user, client


def refund_in_admin(client: Client, payment, amount: str) -> Refund:
    """As a person does it: the payment's refund page, then its form."""
    page = client.get(f"/admin/refundops/payment/{quote(payment.pk)}/refund/").content.decode()
    key = re.search(r'name="idempotency_key" value="(\w+)"', page).group(1)
    client.post(f"/admin/refundops/payment/{quote(payment.pk)}/refund/",
                {"amount": amount, "reason": "product_issue", "idempotency_key": key})
    return Refund.objects.filter(payment=payment).order_by("-created_at").first()


@pytest.fixture
def policy(db):
    make_limits(approval_threshold_minor=THRESHOLD)
    make_rules()


@pytest.mark.usefixtures("policy", "quiet_breaker")
def test_three_staff_refunds_of_100_by_an_approver_with_100_of_authority_are_held_as_one_of_300_is():
    approver, client = staff("approver", authority=10_000)
    approver2, _ = staff("approver2", authority=100_000)
    payment = make_payment(amount=50_000)

    first = refund_in_admin(client, payment, "100.00")
    assert (first.status, first.hold_reasons) == (RefundState.APPROVED, [])
    second = refund_in_admin(client, payment, "100.00")  # 200.00 on the payment: above their 100.00
    assert (second.status, second.hold_reasons) == (RefundState.HELD, ["ABOVE_REQUESTER_AUTHORITY"])
    approve_refund(refund_id=second.pk, approver=approver2)
    third = refund_in_admin(client, payment, "100.00")  # 300.00: above the threshold too
    assert third.status == RefundState.HELD
    assert set(third.hold_reasons) == {"APPROVAL_REQUIRED_CUMULATIVE", "ABOVE_REQUESTER_AUTHORITY"}
    check = next(c for c in third.verdict.checks if c["name"] == "requester_authority")
    assert (check["limit"], check["observed"]) == (10_000, 30_000)

    whole = refund_in_admin(client, make_payment(amount=50_000), "300.00")
    assert whole.status == RefundState.HELD
    assert set(whole.hold_reasons) == {"APPROVAL_REQUIRED", "ABOVE_REQUESTER_AUTHORITY"}


@pytest.mark.usefixtures("policy", "quiet_breaker")
def test_staff_refunds_to_one_customer_across_payments_add_up_too():
    approver, _ = staff("approver", authority=100_000)
    first = make_payment(amount=50_000)
    second = make_payment(amount=50_000, customer=first.customer)
    caller = Caller.for_user(approver)
    ask = {"amount": 15_000, "reason": "customer_request"}
    assert request_refund(caller=caller, idempotency_key="a", data={"transaction_id": first.pk, **ask}).status == 201
    held = request_refund(caller=caller, idempotency_key="b", data={"transaction_id": second.pk, **ask})
    assert held.status == 202 and held.body["hold_reasons"] == ["APPROVAL_REQUIRED_CUMULATIVE"]


@pytest.mark.usefixtures("policy", "quiet_breaker")
def test_people_and_agents_each_add_up_their_own_kind_of_refunds():
    """A person's refunds do not use up what agents may move alone (tests/test_cumulative_threshold.py),
    nor agents' what a person may: each kind is split-proof on its own."""
    approver, _ = staff("approver", authority=100_000)
    payment = make_payment(amount=100_000)
    key, _ = make_agent_key()

    def refund(caller, amount: int):
        return request_refund(caller=caller, idempotency_key=f"{caller.label}-{amount}-{Refund.objects.count()}",
                              data={"transaction_id": payment.pk, "amount": amount, "reason": "customer_request"})

    assert refund(Caller.for_key(key), 15_000).status == 201
    assert refund(Caller.for_user(approver), 15_000).status == 201
    held = refund(Caller.for_user(approver), 6_000)
    assert held.status == 202 and held.body["hold_reasons"] == ["APPROVAL_REQUIRED_CUMULATIVE"]
    check = next(c for c in Refund.objects.get(pk=held.body["refund"]["id"]).verdict.checks
                 if c["name"] == "approval_threshold_cumulative")
    assert check["inputs"]["people_on_payment"] == 15_000 and check["observed"] == 21_000
    assert check["message"].startswith("150.00 USD already refunded by people ")


@pytest.mark.usefixtures("policy", "quiet_breaker")
def test_the_dashboard_counts_decisions_of_held_refunds_not_a_persons_own_refunds():
    approver, client = staff("approver", authority=10_000)
    approver2, client2 = staff("approver2", authority=100_000)
    payment = make_payment(amount=50_000)
    refund_in_admin(client, payment, "50.00")  # approved by the policy: nobody decided it
    refund_in_admin(client, payment, "50.00")
    held = refund_in_admin(client, payment, "50.00")
    assert held.status == RefundState.HELD
    client2.post(f"/admin/refundops/refund/{quote(held.pk)}/approve/")

    since = timezone.now() - timedelta(days=1)
    assert reports.decisions_by_person(since=since) == {"approver2": {"approved": 1, "rejected": 0}}
    assert client2.get("/admin/refundops/refund/dashboard/").status_code == 200


@pytest.mark.usefixtures("quiet_breaker")
def test_an_approver_approves_a_refund_exactly_at_their_authority_and_not_one_unit_more():
    """docs/CONTRACT.md and the model: the authority is the largest refund a person may approve."""
    make_limits(approval_threshold_minor=0)  # every refund is held
    make_rules()
    approver, _ = staff("approver", authority=10_000)
    asker = User.objects.create_user("asker", is_staff=True)
    at, above = (Refund.objects.get(pk=request_refund(
        caller=Caller.for_user(asker), idempotency_key=f"k{amount}",
        data={"transaction_id": make_payment(amount=50_000).pk, "amount": amount, "reason": "customer_request"},
    ).body["refund"]["id"]) for amount in (10_000, 10_001))
    assert approve_refund(refund_id=at.pk, approver=approver).status == RefundState.APPROVED
    with pytest.raises(ApprovalError) as refused:
        approve_refund(refund_id=above.pk, approver=approver)
    assert refused.value.code == "APPROVAL_NOT_AUTHORIZED" and "above approver's authority" in refused.value.message
    assert Refund.objects.get(pk=above.pk).status == RefundState.HELD
