"""A proposal carries only what its proposer changed and applies only that; one whose fields moved
since it was proposed is refused as stale, changes nothing, and the refusal is audited.
(Issue 28, finding 1.)

Each control kind that proposals cover, driven through the admin as the demo roles: P1 is proposed
from the admin's form (which posts every field of the control), P2 changes another field and is
approved; approving P1 then must leave P2's change in force."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Callable

import pytest
from django.contrib.admin.utils import quote, unquote
from django.contrib.auth.models import User
from django.test import Client

from approvals.models import ApprovalAuthority
from approvals.services import ApprovalError, approve_refund
from audit.models import AuditEntry
from proposals.models import Proposal
from proposals.services import ProposalError, approve_proposal, propose_change
from refundops.models import (Agent, HoldRules, Merchant, MerchantEndpoint, PaymentLinkTemplate, Refund, RefundLimits,
                              RefundState)
from refundops.callers import Caller
from refundops.services.refunds import request_refund
from tests.conftest import make_limits, make_payment, make_rules
from tests.test_four_eyes import staff

pytestmark = pytest.mark.django_db


MULTIPLE_CHOICES = ("allowed_reasons",)  # checkboxes: one value per box ticked


def form_of(instance, fields: tuple[str, ...], **changes) -> dict[str, Any]:
    """What the admin's change form posts: every field, as the browser sends it."""
    data: dict[str, Any] = {}
    for name in fields:
        value = changes.get(name, getattr(instance, name))
        if isinstance(value, bool):
            if value:
                data[name] = "on"
        elif isinstance(value, list) and name in MULTIPLE_CHOICES:
            data[name] = value
        elif isinstance(value, (list, dict)):
            data[name] = json.dumps(value)
        else:
            data[name] = "" if value is None else value
    return data


def propose_in_admin(client: Client, url: str, data: dict[str, Any]) -> Proposal:
    response = client.post(url, data)
    assert response.status_code == 302 and "/proposals/proposal/" in response.url, \
        re.findall(r'<ul class="errorlist[^>]*>.*?</ul>', response.content.decode(), re.S)
    return Proposal.objects.get(pk=unquote(response.url.rstrip("/").split("/")[-2]))


def approve_in_admin(client: Client, proposal: Proposal) -> str:
    """The messages the approver sees after pressing Approve."""
    response = client.post(f"/admin/proposals/proposal/{quote(proposal.pk)}/approve/", {"note": "ok"}, follow=True)
    assert response.status_code == 200
    return " ".join(str(m) for m in response.context["messages"])


LIMIT_FORM = tuple(f.name for f in RefundLimits._meta.fields if f.name not in ("id", "version", "created_by",
                                                                                  "created_at"))
RULE_FORM = ("note", "hold_disputed", "hold_flagged", "hold_recent_contact_change", "contact_change_days",
             "hold_customer_velocity", "velocity_max_refunds", "velocity_window_hours")


@dataclass
class Kind:
    kind: str
    role: str
    make: Callable[[], Any]  # the control as it stands before either proposal
    url: Callable[[Any], str]  # its admin change page
    fields: tuple[str, ...]  # what that page posts
    now: Callable[[Any], Any]  # the control in force (read again)
    first: dict[str, Any]  # P1 changes this ...
    second: dict[str, Any]  # ... P2 another field
    clash: dict[str, Any]  # and a P2 that changes P1's own field


def _latest_limits(_):
    return RefundLimits.objects.filter(currency="USD").order_by("-version").first()


def _latest_rules(_):
    return HoldRules.objects.order_by("-version").first()


def _authority():
    target, _ = staff("approver", "finance approver", USD=100_000)
    return ApprovalAuthority.objects.get(user=target)


KINDS = [
    Kind(Proposal.Kind.REFUND_LIMITS, "finance approver", lambda: make_limits(approval_threshold_minor=20_000),
         lambda v1: f"/admin/refundops/refundlimits/{v1.pk}/change/", LIMIT_FORM, _latest_limits,
         first={"approval_threshold_minor": 30_000}, second={"customer_daily_count": 5},
         clash={"approval_threshold_minor": 40_000}),
    Kind(Proposal.Kind.HOLD_RULES, "fraud analyst", lambda: make_rules(hold_flagged=False),
         lambda v1: f"/admin/refundops/holdrules/{v1.pk}/change/", RULE_FORM, _latest_rules,
         first={"contact_change_days": 14}, second={"hold_flagged": True}, clash={"contact_change_days": 30}),
    Kind(Proposal.Kind.APPROVAL_AUTHORITY, "administrator", _authority,
         lambda a: f"/admin/approvals/approvalauthority/{a.pk}/change/", ("max_amount_minor", "is_active"),
         lambda a: ApprovalAuthority.objects.get(pk=a.pk),
         first={"max_amount_minor": 150_000}, second={"is_active": False}, clash={"max_amount_minor": 120_000}),
    Kind(Proposal.Kind.LINK_TEMPLATE, "finance approver",
         lambda: PaymentLinkTemplate.objects.create(name="pay up", message="Pay $amount: $url", active=True),
         lambda t: f"/admin/refundops/paymentlinktemplate/{quote(t.pk)}/change/", ("name", "message", "active"),
         lambda t: PaymentLinkTemplate.objects.get(pk=t.pk),
         first={"message": "Please pay $amount: $url"}, second={"active": False}, clash={"message": "Pay: $url"}),
    Kind(Proposal.Kind.MERCHANT_ENDPOINT, "administrator",
         lambda: MerchantEndpoint.objects.create(url="https://merchant.example/hook"),
         lambda e: f"/admin/refundops/merchantendpoint/{quote(e.pk)}/change/",
         ("url", "active", "event_types", "description"), lambda e: MerchantEndpoint.objects.get(pk=e.pk),
         first={"description": "orders team"}, second={"url": "https://merchant.example/hook-v2"},
         clash={"description": "billing team"}),
    Kind(Proposal.Kind.MERCHANT, "finance approver", lambda: Merchant.objects.create(name="Shop two"),
         lambda m: f"/admin/refundops/merchant/{quote(m.pk)}/change/", ("name", "require_session_id"),
         lambda m: Merchant.objects.get(pk=m.pk),
         first={"name": "Shop 2"}, second={"require_session_id": True}, clash={"name": "Shop II"}),
]


@pytest.mark.parametrize("case", KINDS, ids=[k.kind for k in KINDS])
def test_approving_an_older_proposal_keeps_a_later_approved_change_of_another_field(case: Kind):
    maker, maker_client = staff("maker", case.role)
    _, checker_client = staff("checker", case.role)
    control = case.make()
    before = case.now(control)
    p1 = propose_in_admin(maker_client, case.url(control), form_of(before, case.fields, **case.first))
    p2 = propose_in_admin(maker_client, case.url(control), form_of(before, case.fields, **case.second))

    assert "Approved" in approve_in_admin(checker_client, p2)
    assert "Approved" in approve_in_admin(checker_client, p1)
    now = case.now(control)
    for field, value in {**case.first, **case.second}.items():
        assert getattr(now, field) == value, (case.kind, field)
    approved = AuditEntry.objects.get(action="proposal.approved", subject_id=p1.pk).data
    assert set(approved["diff"]) == set(case.first)
    p1.refresh_from_db()
    assert set(p1.changes) == set(case.first)  # only what its proposer changed


@pytest.mark.parametrize("case", KINDS, ids=[k.kind for k in KINDS])
def test_an_older_proposal_whose_field_moved_is_refused_as_stale_changes_nothing_and_is_audited(case: Kind):
    _, maker_client = staff("maker", case.role)
    _, checker_client = staff("checker", case.role)
    control = case.make()
    before = case.now(control)
    p1 = propose_in_admin(maker_client, case.url(control), form_of(before, case.fields, **case.first))
    p2 = propose_in_admin(maker_client, case.url(control), form_of(before, case.fields, **case.clash))
    approve_in_admin(checker_client, p2)
    in_force = {f: getattr(case.now(control), f) for f in case.fields}

    said = approve_in_admin(checker_client, p1)
    assert "PROPOSAL_STALE" in said and ", ".join(case.first) in said
    assert {f: getattr(case.now(control), f) for f in case.fields} == in_force
    p1.refresh_from_db()
    assert p1.status == Proposal.Status.PENDING and p1.result_id == ""
    refused = AuditEntry.objects.get(action="proposal.refused_stale", subject_id=p1.pk)
    assert refused.actor == "user:checker"
    assert refused.data["moved"] == {field: [p1.diff[field][0], p2.diff[field][1]] for field in case.first}


def agent_form(agent: Agent, capabilities: list[str]) -> dict[str, Any]:
    return {"capabilities": capabilities, "keys-TOTAL_FORMS": "0", "keys-INITIAL_FORMS": "0",
            "keys-MIN_NUM_FORMS": "0", "keys-MAX_NUM_FORMS": "1000"}


def test_a_capability_grant_overtaken_by_a_revoke_is_refused_as_stale_and_grants_nothing():
    agent = Agent.objects.create(name="bot", capabilities=["payments.read", "refunds.create"])
    _, op1 = staff("op1", "operator")
    _, op2 = staff("op2", "operator")
    url = f"/admin/refundops/agent/{quote(agent.pk)}/change/"
    grant = propose_in_admin(op1, url, agent_form(agent, ["payments.read", "refunds.create", "payments.capture"]))
    op2.post(url, agent_form(agent, ["payments.read"]))  # a revoke: one person, at once
    assert Agent.objects.get(pk=agent.pk).capabilities == ["payments.read"]

    assert "PROPOSAL_STALE" in approve_in_admin(op2, grant)
    assert Agent.objects.get(pk=agent.pk).capabilities == ["payments.read"]  # refunds.create stays revoked
    assert AuditEntry.objects.filter(action="proposal.refused_stale", subject_id=grant.pk).exists()


def test_the_issues_scenario_a_suspended_authority_stays_suspended_and_cannot_approve():
    """P1 raises the approver's USD authority 1,000 -> 1,500; P2 suspends it and is approved; P1's
    approval leaves it suspended, and the approver cannot approve a held 300.00 refund."""
    make_limits(approval_threshold_minor=20_000)
    _, admin1 = staff("admin1", "administrator")
    _, admin2 = staff("admin2", "administrator")
    approver, _ = staff("approver", "finance approver", USD=100_000)
    authority = ApprovalAuthority.objects.get(user=approver)
    url = f"/admin/approvals/approvalauthority/{authority.pk}/change/"
    p1 = propose_in_admin(admin1, url, {"max_amount_minor": 150_000, "is_active": "on"})
    p2 = propose_in_admin(admin1, url, {"max_amount_minor": 100_000})
    approve_in_admin(admin2, p2)
    approve_in_admin(admin2, p1)
    authority.refresh_from_db()
    assert (authority.max_amount_minor, authority.is_active) == (150_000, False)

    payment = make_payment(amount=50_000)
    asker = User.objects.create_user("asker", is_staff=True)
    request_refund(caller=Caller.for_user(asker), idempotency_key="k1",
                   data={"transaction_id": payment.pk, "amount": 30_000, "reason": "customer_request"})
    refund = Refund.objects.get(payment=payment)
    assert refund.status == RefundState.HELD
    with pytest.raises(ApprovalError) as refused:
        approve_refund(refund_id=refund.pk, approver=approver)
    assert refused.value.code == "APPROVAL_NOT_AUTHORIZED"


def test_a_proposal_stored_before_the_upgrade_applies_only_its_diff():
    """Pending proposals written by the old admin carry every field in ``changes``: what they change
    is their diff, read so on approval, and the migration trims what is stored to it."""
    from importlib import import_module

    from django.apps import apps

    _, _ = staff("admin1", "administrator")
    admin1 = User.objects.get(username="admin1")
    admin2, _ = staff("admin2", "administrator")
    approver, _ = staff("approver", "finance approver", USD=100_000)
    subject = f"{approver.pk}:USD"
    old = Proposal.objects.create(kind=Proposal.Kind.APPROVAL_AUTHORITY, subject_id=subject, summary="old",
                                  changes={"max_amount_minor": 150_000, "is_active": True},
                                  diff={"max_amount_minor": [100_000, 150_000]}, proposed_by=admin1)
    migrated = Proposal.objects.create(kind=Proposal.Kind.APPROVAL_AUTHORITY, subject_id=subject, summary="old",
                                       changes={"max_amount_minor": 100_000, "is_active": True},
                                       diff={"is_active": [True, False]}, proposed_by=admin1)
    import_module("proposals.migrations.0003_changes_are_the_diff").trim_changes_to_the_diff(apps, None)
    assert Proposal.objects.get(pk=migrated.pk).changes == {"is_active": False}

    approve_proposal(proposal_id=migrated.pk, approver=admin2)
    old.changes = {"max_amount_minor": 150_000, "is_active": True}  # as if the migration had not run
    Proposal.objects.filter(pk=old.pk).update(changes=old.changes)
    approve_proposal(proposal_id=old.pk, approver=admin2)
    authority = ApprovalAuthority.objects.get(user=approver)
    assert (authority.max_amount_minor, authority.is_active) == (150_000, False)


def test_a_service_proposal_that_names_unchanged_fields_carries_only_the_changed_ones():
    v1 = make_limits(approval_threshold_minor=20_000)
    alice, _ = staff("alice", "finance approver")
    proposal = propose_change(kind=Proposal.Kind.REFUND_LIMITS, subject_id="USD", proposer=alice,
                              changes={"approval_threshold_minor": 30_000,
                                       "customer_daily_count": v1.customer_daily_count})
    assert proposal.changes == {"approval_threshold_minor": 30_000}
    with pytest.raises(ProposalError):
        propose_change(kind=Proposal.Kind.REFUND_LIMITS, subject_id="USD", proposer=alice,
                       changes={"customer_daily_count": v1.customer_daily_count})
