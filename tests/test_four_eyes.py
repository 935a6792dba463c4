"""Maker-checker: no one changes a control or moves money alone. (Issue 9, finding 1.)

The insider path of the finding, step by step, as the demo approver (authority 1,000.00 USD):
raise the limits, refund 4,000.00 by hand, approve it; change hold rules, authorities, link
templates, users, groups and merchant endpoints. Each step is refused or waits for a second
person, and what a second person approves is in the audit chain with both names and the diff."""

from __future__ import annotations

import json
import re

import pytest
from django.contrib.admin.utils import quote
from django.contrib.auth.models import Group, User
from django.core.management import call_command
from django.test import Client

from approvals.models import ApprovalAuthority
from approvals.services import ApprovalError, approve_refund
from audit.models import AuditEntry
from proposals.models import Proposal
from proposals.services import ProposalError, approve_proposal, propose_change, reject_proposal
from refundops.models import (Agent, HoldRules, Merchant, MerchantEndpoint, PaymentLinkTemplate, Refund, RefundLimits,
                              RefundState)
from tests.conftest import make_agent_key, make_limits, make_payment

pytestmark = pytest.mark.django_db


def staff(username: str, role: str, **authority: int) -> tuple[User, Client]:
    user = User.objects.create_user(username, password="pw")
    call_command("grant_role", username, role, stdout=open("/dev/null", "w"))
    for currency, amount in authority.items():
        ApprovalAuthority.objects.create(user=user, currency=currency, max_amount_minor=amount)
    user = User.objects.get(pk=user.pk)
    client = Client()
    client.force_login(user)
    return user, client


def limits_form(limits: RefundLimits, **changes) -> dict:
    data = {f.name: getattr(limits, f.name) for f in RefundLimits._meta.fields
            if f.name not in ("id", "version", "created_by", "created_at")}
    data.update(changes)
    data["reason_thresholds"] = json.dumps(data["reason_thresholds"])
    return data


def pending(kind: str) -> Proposal:
    return Proposal.objects.get(kind=kind, status=Proposal.Status.PENDING)


def refused_code(call) -> str:
    with pytest.raises(ProposalError) as refused:
        call()
    return refused.value.code


def test_the_insider_path_of_finding_one_is_refused_at_each_step():
    v1 = make_limits(approval_threshold_minor=20_000)
    approver, client = staff("approver", "finance approver", USD=100_000)

    # 1. A limits version with a threshold of 10^12: only a proposal; v1 still decides.
    response = client.post(f"/admin/refundops/refundlimits/{v1.pk}/change/",
                           limits_form(v1, approval_threshold_minor=10**12))
    proposal = pending(Proposal.Kind.REFUND_LIMITS)
    assert response.status_code == 302 and response.url.endswith(f"/proposals/proposal/{quote(proposal.pk)}/change/")
    assert list(RefundLimits.objects.values_list("version", flat=True)) == [1]
    assert refused_code(lambda: approve_proposal(proposal_id=proposal.pk, approver=approver)) == "PROPOSAL_OWN"
    client.post(f"/admin/proposals/proposal/{quote(proposal.pk)}/approve/", {"note": "fine by me"})
    proposal.refresh_from_db()
    assert proposal.status == Proposal.Status.PENDING and RefundLimits.objects.count() == 1

    # 2. A 4,000.00 staff refund: held for someone else, and not theirs to approve.
    payment = make_payment(amount=500_000)
    page = client.get(f"/admin/refundops/payment/{quote(payment.pk)}/refund/").content.decode()
    key = re.search(r'name="idempotency_key" value="(\w+)"', page).group(1)
    client.post(f"/admin/refundops/payment/{quote(payment.pk)}/refund/",
                {"amount": "4000.00", "reason": "product_issue", "idempotency_key": key})
    refund = Refund.objects.get(payment=payment)
    assert refund.status == RefundState.HELD
    assert set(refund.hold_reasons) == {"APPROVAL_REQUIRED", "ABOVE_REQUESTER_AUTHORITY"}
    with pytest.raises(ApprovalError, match="cannot decide a refund they asked for"):
        approve_refund(refund_id=refund.pk, approver=approver)
    client.post(f"/admin/refundops/refund/{quote(refund.pk)}/approve/")
    refund.refresh_from_db()
    assert refund.status == RefundState.HELD

    # 3. Hold rules, approval authorities, users, groups, merchant endpoints, agents: not theirs at all.
    rules = HoldRules.objects.get()
    for url in (f"/admin/refundops/holdrules/{rules.pk}/change/", "/admin/approvals/approvalauthority/add/",
                "/admin/auth/user/add/", f"/admin/auth/user/{approver.pk}/change/", "/admin/auth/group/add/",
                "/admin/refundops/merchantendpoint/add/"):
        assert client.post(url, {"hold_flagged": "", "max_amount_minor": 10**12}).status_code == 403, url
    assert refused_code(lambda: propose_change(kind=Proposal.Kind.APPROVAL_AUTHORITY, subject_id=f"{approver.pk}:USD",
                                               changes={"max_amount_minor": 10**12}, proposer=approver)) \
        == "PROPOSAL_NOT_AUTHORIZED"
    assert HoldRules.objects.get().hold_flagged is True
    assert ApprovalAuthority.objects.get(user=approver).max_amount_minor == 100_000
    assert list(approver.groups.values_list("name", flat=True)) == ["Finance approvers"]

    # 4. A link template they write is a proposal; they cannot approve it either.
    client.post("/admin/refundops/paymentlinktemplate/add/", {"name": "pay up", "message": "Pay $amount: $url",
                                                              "active": "on"})
    template = pending(Proposal.Kind.LINK_TEMPLATE)
    assert refused_code(lambda: approve_proposal(proposal_id=template.pk, approver=approver)) == "PROPOSAL_OWN"
    assert not PaymentLinkTemplate.objects.exists()


def test_a_second_finance_approver_puts_the_limits_in_effect_and_the_audit_names_both():
    v1 = make_limits(approval_threshold_minor=20_000)
    alice, alice_client = staff("alice", "finance approver")
    bob, bob_client = staff("bob", "finance approver")
    alice_client.post(f"/admin/refundops/refundlimits/{v1.pk}/change/",
                      limits_form(v1, approval_threshold_minor=30_000, note="peak season"))
    proposal = pending(Proposal.Kind.REFUND_LIMITS)
    assert proposal.diff == {"approval_threshold_minor": [20_000, 30_000], "note": ["", "peak season"]}
    review = bob_client.get(f"/admin/proposals/proposal/{quote(proposal.pk)}/change/").content.decode()
    assert "20000" in review and "30000" in review and 'value="Approve"' in review
    assert 'value="Approve"' not in alice_client.get(f"/admin/proposals/proposal/{quote(proposal.pk)}/change/").content.decode()

    assert bob_client.post(f"/admin/proposals/proposal/{quote(proposal.pk)}/approve/", {"note": "agreed"}).status_code == 302
    v2 = RefundLimits.objects.get(currency="USD", version=2)
    assert (v2.approval_threshold_minor, v2.created_by) == (30_000, "alice, approved by bob")
    assert RefundLimits.objects.get(pk=v1.pk).approval_threshold_minor == 20_000
    entry = AuditEntry.objects.get(action="proposal.approved", subject_id=proposal.pk)
    assert entry.actor == "user:bob"
    assert {k: entry.data[k] for k in ("proposed_by", "decided_by", "diff", "result_id", "decision_note")} == {
        "proposed_by": "alice", "decided_by": "bob", "decision_note": "agreed", "result_id": str(v2.pk),
        "diff": {"approval_threshold_minor": [20_000, 30_000], "note": ["", "peak season"]}}
    assert entry.data["proposed_at"] < entry.data["decided_at"]
    assert AuditEntry.objects.filter(action="proposal.created", subject_id=proposal.pk, actor="user:alice").exists()


def test_each_control_takes_effect_only_when_another_person_with_the_right_approves():
    fraud1, _ = staff("fraud1", "fraud analyst")
    fraud2, _ = staff("fraud2", "fraud analyst")
    admin1, _ = staff("admin1", "administrator")
    admin2, _ = staff("admin2", "administrator")
    finance, _ = staff("fin", "finance approver")
    op1, _ = staff("op1", "operator")
    op2, _ = staff("op2", "operator")
    agent = Agent.objects.create(name="bot", capabilities=["payments.read"])
    finance2, _ = staff("fin2", "finance approver")
    merchant = Merchant.objects.create(name="Shop two")

    cases = [
        (fraud1, fraud2, finance, dict(kind=Proposal.Kind.HOLD_RULES, changes={"hold_flagged": False}),
         lambda: HoldRules.objects.order_by("-version").first().hold_flagged is False),
        (admin1, admin2, fraud1, dict(kind=Proposal.Kind.APPROVAL_AUTHORITY, subject_id=f"{finance.pk}:USD",
                                      changes={"max_amount_minor": 50_000, "is_active": True}),
         lambda: ApprovalAuthority.objects.filter(user=finance, max_amount_minor=50_000).exists()),
        (admin1, admin2, op1, dict(kind=Proposal.Kind.MERCHANT_ENDPOINT,
                                   changes={"url": "https://merchant.example/hook", "active": True,
                                            "event_types": [], "description": ""}),
         lambda: MerchantEndpoint.objects.filter(url="https://merchant.example/hook").exists()),
        (finance, finance2, fraud1, dict(kind=Proposal.Kind.MERCHANT, subject_id=merchant.pk,
                                         changes={"require_session_id": True}),
         lambda: Merchant.objects.get(pk=merchant.pk).require_session_id is True),
        (op1, op2, admin1, dict(kind=Proposal.Kind.AGENT_CAPABILITIES, subject_id=agent.pk,
                                changes={"capabilities": ["payments.read", "refunds.create"]}),
         lambda: Agent.objects.get(pk=agent.pk).has_capability("refunds.create")),
    ]
    for maker, checker, outsider, ask, in_effect in cases:
        proposal = propose_change(proposer=maker, **ask)
        assert not in_effect(), ask["kind"]
        assert refused_code(lambda: approve_proposal(proposal_id=proposal.pk, approver=maker)) == "PROPOSAL_OWN"
        assert refused_code(lambda: approve_proposal(proposal_id=proposal.pk, approver=outsider)) \
            == "PROPOSAL_NOT_AUTHORIZED"
        assert refused_code(lambda: propose_change(proposer=outsider, **ask)) == "PROPOSAL_NOT_AUTHORIZED"
        approve_proposal(proposal_id=proposal.pk, approver=checker)
        assert in_effect(), ask["kind"]
        approved = AuditEntry.objects.get(action="proposal.approved", subject_id=proposal.pk).data
        assert (approved["kind"], approved["proposed_by"], approved["decided_by"], approved["diff"]) == (
            ask["kind"], maker.username, checker.username, proposal.diff), ask["kind"]
        assert approved["diff"] and approved["proposed_at"] <= approved["decided_at"], ask["kind"]
        assert refused_code(lambda: approve_proposal(proposal_id=proposal.pk, approver=checker)) == "PROPOSAL_DECIDED"


def test_nobody_approves_a_change_to_their_own_authority():
    admin1, _ = staff("admin1", "administrator")
    admin2, _ = staff("admin2", "administrator", USD=1_000)
    proposal = propose_change(kind=Proposal.Kind.APPROVAL_AUTHORITY, subject_id=f"{admin2.pk}:USD",
                              changes={"max_amount_minor": 10**9}, proposer=admin1)
    assert refused_code(lambda: approve_proposal(proposal_id=proposal.pk, approver=admin2)) == "PROPOSAL_OWN"
    assert ApprovalAuthority.objects.get(user=admin2).max_amount_minor == 1_000


def test_a_proposal_overtaken_by_another_change_is_refused_and_a_rejected_one_changes_nothing():
    v1 = make_limits(approval_threshold_minor=20_000)
    alice, _ = staff("alice", "finance approver")
    bob, _ = staff("bob", "finance approver")
    first = propose_change(kind=Proposal.Kind.REFUND_LIMITS, subject_id="USD",
                           changes={"approval_threshold_minor": 30_000}, proposer=alice)
    second = propose_change(kind=Proposal.Kind.REFUND_LIMITS, subject_id="USD",
                            changes={"approval_threshold_minor": 40_000}, proposer=alice)
    approve_proposal(proposal_id=first.pk, approver=bob)
    assert refused_code(lambda: approve_proposal(proposal_id=second.pk, approver=bob)) == "PROPOSAL_STALE"
    reject_proposal(proposal_id=second.pk, approver=bob, note="overtaken")
    assert list(RefundLimits.objects.filter(currency="USD").values_list("approval_threshold_minor", flat=True)
                .order_by("version")) == [v1.approval_threshold_minor, 30_000]
    assert AuditEntry.objects.get(action="proposal.rejected", subject_id=second.pk).data["decided_by"] == "bob"


def test_the_database_refuses_a_proposal_decided_by_its_own_proposer():
    from django.db import IntegrityError

    alice, _ = staff("alice", "fraud analyst")
    proposal = propose_change(kind=Proposal.Kind.HOLD_RULES, changes={"hold_flagged": False}, proposer=alice)
    with pytest.raises(IntegrityError):
        Proposal.objects.filter(pk=proposal.pk).update(status="approved", decided_by=alice)


def test_an_operator_revokes_a_capability_alone_but_a_grant_waits_for_a_second_operator():
    key, _ = make_agent_key("payments.read", "refunds.create")
    op1, client = staff("op1", "operator")
    url = f"/admin/refundops/agent/{quote(key.agent_id)}/change/"
    inline = {"keys-TOTAL_FORMS": "1", "keys-INITIAL_FORMS": "1", "keys-MIN_NUM_FORMS": "0",
              "keys-MAX_NUM_FORMS": "1000"}
    assert client.post(url, {"capabilities": ["payments.read"], **inline}).status_code == 302
    assert Agent.objects.get(pk=key.agent_id).capabilities == ["payments.read"]
    client.post(url, {"capabilities": ["payments.read", "refunds.create", "payments.capture"], **inline})
    assert Agent.objects.get(pk=key.agent_id).capabilities == ["payments.read"]
    proposal = pending(Proposal.Kind.AGENT_CAPABILITIES)
    approve_proposal(proposal_id=proposal.pk, approver=staff("op2", "operator")[0])
    assert set(Agent.objects.get(pk=key.agent_id).capabilities) == {"payments.read", "refunds.create",
                                                                   "payments.capture"}
    assert AuditEntry.objects.filter(action="capability.granted", actor__startswith="user:op2").count() == 2


def test_an_administrator_cannot_give_roles_or_superuser_status_in_the_admin():
    admin1, client = staff("admin1", "administrator")
    target = User.objects.create_user("target", password="pw", is_staff=True)
    finance = Group.objects.get(name="Finance approvers")
    client.post(f"/admin/auth/user/{target.pk}/change/", {
        "username": "target", "is_active": "on", "is_staff": "on", "is_superuser": "on",
        "groups": [finance.pk], "date_joined_0": "2026-01-01", "date_joined_1": "00:00:00"})
    target.refresh_from_db()
    assert not target.is_superuser and not target.groups.exists()
    client.post(f"/admin/auth/user/{admin1.pk}/change/", {
        "username": "admin1", "is_active": "on", "is_staff": "on", "is_superuser": "on",
        "groups": [finance.pk], "date_joined_0": "2026-01-01", "date_joined_1": "00:00:00"})
    admin1.refresh_from_db()
    assert not admin1.is_superuser and list(admin1.groups.values_list("name", flat=True)) == ["Administrators"]
    assert client.get(f"/admin/auth/user/{target.pk}/password/").status_code == 403


def test_a_merchants_settings_change_in_the_admin_is_a_proposal():
    merchant = Merchant.objects.create(name="Shop two")
    finance, client = staff("fin", "finance approver")
    response = client.post(f"/admin/refundops/merchant/{quote(merchant.pk)}/change/",
                           {"name": "Shop two", "require_session_id": "on"})
    proposal = pending(Proposal.Kind.MERCHANT)
    assert response.status_code == 302 and response.url.endswith(f"/proposals/proposal/{quote(proposal.pk)}/change/")
    assert proposal.diff == {"require_session_id": [False, True]}
    assert Merchant.objects.get(pk=merchant.pk).require_session_id is False
    approve_proposal(proposal_id=proposal.pk, approver=staff("fin2", "finance approver")[0])
    assert Merchant.objects.get(pk=merchant.pk).require_session_id is True
    assert client.post("/admin/refundops/merchant/add/", {"name": "Shop three"}).status_code == 403
