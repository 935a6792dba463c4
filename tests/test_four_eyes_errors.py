"""Four eyes without a 500: a capability grant approved by proposal, two proposals creating the same
name, a refund id that does not exist. (Issue 28, findings 4 and 5.)"""

from __future__ import annotations

import pytest
from django.contrib.admin.utils import quote
from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import Client

from approvals.models import ApprovalAuthority
from audit.models import AuditEntry
from proposals.models import Proposal
from refundops.models import Agent, Merchant, PaymentLinkTemplate, Refund
from refundops.management.commands.demo_data import DEMO_AGENT

pytestmark = pytest.mark.django_db


def staff(username: str, role: str, **authority: int) -> tuple[User, Client]:
    user = User.objects.create_user(username, password="pw")
    call_command("grant_role", username, role, stdout=open("/dev/null", "w"))
    for currency, amount in authority.items():
        ApprovalAuthority.objects.create(user=user, currency=currency, max_amount_minor=amount)
    user = User.objects.get(pk=user.pk)
    client = Client(raise_request_exception=False)
    client.force_login(user)
    return user, client


def messages_of(response) -> str:
    return " ".join(str(m) for m in response.context["messages"])


def agent_form(capabilities: list[str]) -> dict:
    return {"capabilities": capabilities, "keys-TOTAL_FORMS": "0", "keys-INITIAL_FORMS": "0",
            "keys-MIN_NUM_FORMS": "0", "keys-MAX_NUM_FORMS": "1000"}


def test_the_demo_operators_approve_a_capability_grant_in_the_admin_and_the_audit_keeps_the_whole_story():
    agent = Agent.objects.create(name=DEMO_AGENT, capabilities=["payments.read"])
    _, operator = staff("operator", "operator")
    _, operator2 = staff("operator2", "operator")
    operator.post(f"/admin/refundops/agent/{quote(agent.pk)}/change/",
                  agent_form(["payments.read", "authorizations.void", "payment_links.send"]))
    proposal = Proposal.objects.get(kind=Proposal.Kind.AGENT_CAPABILITIES, status=Proposal.Status.PENDING)

    response = operator2.post(f"/admin/proposals/proposal/{quote(proposal.pk)}/approve/", {"note": "ok"},
                              follow=True)
    assert response.status_code == 200 and "Approved" in messages_of(response)
    assert Agent.objects.get(pk=agent.pk).capabilities == ["payments.read", "payment_links.send",
                                                           "authorizations.void"]
    granted = AuditEntry.objects.get(action="capability.granted", data__capability="authorizations.void")
    assert granted.actor == "user:operator2"
    assert (granted.data["proposal_id"], granted.data["proposed_by"]) == (proposal.pk, "operator")
    reasons = list(agent.history.values_list("history_change_reason", flat=True))
    assert all(len(reason) <= 100 for reason in reasons if reason)
    assert agent.history.filter(history_user__username="operator2").count() == 2


def test_a_history_reason_longer_than_its_column_is_cut_to_fit_and_the_audit_entry_keeps_it_whole():
    """Every act's history row: a long name or note never fails the change."""
    from refundops.services.agents import grant_capability

    agent = Agent.objects.create(name="bot", capabilities=["payments.read"])
    actor = "cli:" + "a-very-long-operator-login-name" * 5
    grant_capability(agent_name_or_id=agent.pk, capability="refunds.create", actor=actor)
    reason = agent.history.latest().history_change_reason
    assert len(reason) == 100 and reason.startswith("capability refunds.create granted by cli:") \
        and reason.endswith("…")
    assert AuditEntry.objects.get(action="capability.granted").actor == actor


def test_approving_the_second_of_two_proposals_creating_the_same_name_is_refused_and_changes_nothing():
    _, maker = staff("approver", "finance approver")
    _, checker = staff("approver2", "finance approver")
    for message in ("Pay $amount: $url", "Please pay $amount at $url"):
        response = maker.post("/admin/refundops/paymentlinktemplate/add/",
                              {"name": "pay up", "message": message, "active": "on"})
        assert response.status_code == 302
    first, second = Proposal.objects.filter(kind=Proposal.Kind.LINK_TEMPLATE).order_by("proposed_at")
    checker.post(f"/admin/proposals/proposal/{quote(first.pk)}/approve/")
    before = AuditEntry.objects.count()

    response = checker.post(f"/admin/proposals/proposal/{quote(second.pk)}/approve/", follow=True)
    assert response.status_code == 200
    said = messages_of(response)
    assert "PROPOSAL_INVALID" in said and "pay up" in said and "already" in said
    assert list(PaymentLinkTemplate.objects.values_list("message", flat=True)) == ["Pay $amount: $url"]
    second.refresh_from_db()
    assert second.status == Proposal.Status.PENDING and AuditEntry.objects.count() == before


def test_renaming_a_merchant_to_a_name_taken_since_is_refused_and_changes_nothing():
    from proposals.services import ProposalError, approve_proposal, propose_change

    finance, _ = staff("approver", "finance approver")
    finance2, _ = staff("approver2", "finance approver")
    shop = Merchant.objects.create(name="Shop two")
    proposal = propose_change(kind=Proposal.Kind.MERCHANT, subject_id=shop.pk, changes={"name": "Shop three"},
                              proposer=finance)
    Merchant.objects.create(name="Shop three")
    with pytest.raises(ProposalError) as refused:
        approve_proposal(proposal_id=proposal.pk, approver=finance2)
    assert refused.value.code == "PROPOSAL_INVALID" and "Shop three" in refused.value.message
    assert Merchant.objects.get(pk=shop.pk).name == "Shop two"


@pytest.mark.parametrize("verb", ["approve", "reject"])
def test_deciding_a_refund_that_does_not_exist_says_so(verb):
    from approvals.services import ApprovalError, approve_refund, reject_refund

    approver, client = staff("approver", "finance approver", USD=100_000)
    response = client.post(f"/admin/refundops/refund/rf_nothing/{verb}/", follow=True)
    assert response.status_code == 200
    assert "No refund 'rf_nothing'" in messages_of(response)

    decide = approve_refund if verb == "approve" else reject_refund
    with pytest.raises(ApprovalError) as refused:
        decide(refund_id="rf_nothing", approver=approver)
    assert (refused.value.code, refused.value.status) == ("REFUND_NOT_FOUND", 404)
    assert not Refund.objects.exists()


def test_a_long_note_on_a_refund_decision_is_kept_whole_in_the_audit_entry():
    from tests.conftest import make_limits, make_payment
    from refundops.callers import Caller
    from refundops.services.refunds import request_refund

    make_limits(approval_threshold_minor=1_000)
    approver, client = staff("approver", "finance approver", USD=100_000)
    payment = make_payment(amount=50_000)
    asker = User.objects.create_user("asker", is_staff=True)
    request_refund(caller=Caller.for_user(asker), idempotency_key="k1",
                   data={"transaction_id": payment.pk, "amount": 5_000, "reason": "customer_request"})
    refund = Refund.objects.get(payment=payment)
    note = "Customer called twice; the parcel came back damaged and the courier confirmed it. " * 3
    response = client.post(f"/admin/refundops/refund/{quote(refund.pk)}/approve/", {"note": note}, follow=True)
    assert response.status_code == 200 and "Approved 1" in messages_of(response)
    assert AuditEntry.objects.get(action="refund.approved").data["note"] == note.strip()
    assert len(refund.history.latest().history_change_reason) == 100
