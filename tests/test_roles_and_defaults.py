"""Roles come with the migrations, least privilege each; a fresh database fails closed; deciding
a refund, either way, needs authority; a person's own refund above their authority waits for
someone else. (Issue 9, findings 1 to 3.)"""

from __future__ import annotations

import uuid

import pytest
from django.contrib.auth.models import Group, Permission, User
from django.core.management import CommandError, call_command

from approvals.models import ApprovalAuthority
from approvals.services import ApprovalError, approve_refund, reject_refund
from audit.models import AuditEntry
from refundops.callers import Caller
from refundops.models import HoldRules, Refund, RefundState
from refundops.services.refunds import request_refund
from tests.conftest import make_agent_key, make_limits, make_payment

pytestmark = pytest.mark.django_db


def agent_asks(payment, amount: int = 1_000) -> dict:
    return request_refund(caller=Caller.for_key(make_agent_key()[0]), idempotency_key=uuid.uuid4().hex,
                          data={"transaction_id": payment.pk, "amount": amount, "reason": "customer_request"}).body


def staff_asks(user, payment, amount: int) -> dict:
    return request_refund(caller=Caller.for_user(user), idempotency_key=uuid.uuid4().hex,
                          data={"transaction_id": payment.pk, "amount": amount, "reason": "product_issue"}).body


def person(username: str, *, authority: int | None = None, currency: str = "USD", role: str = "") -> User:
    user = User.objects.create_user(username=username, password="pw", is_staff=True)
    if role:
        call_command("grant_role", username, role, stdout=open("/dev/null", "w"))
    if authority is not None:
        ApprovalAuthority.objects.create(user=user, currency=currency, max_amount_minor=authority)
    return User.objects.get(pk=user.pk)


# -- finding 3: fail closed ---------------------------------------------------------------------

def test_a_fresh_migrated_database_holds_a_refund_on_a_flagged_payment():
    make_limits()  # generous limits; the hold rules are only what the migrations installed
    rules = HoldRules.objects.get()
    assert (rules.version, rules.hold_disputed, rules.hold_flagged, rules.hold_recent_contact_change,
            rules.hold_customer_velocity) == (1, True, True, True, True)
    body = agent_asks(make_payment(fraud_flags=["card_testing"]))
    assert body["status"] == "held" and "PAYMENT_FLAGGED" in body["hold_reasons"], body
    assert agent_asks(make_payment(dispute_status="open"))["hold_reasons"] == ["PAYMENT_DISPUTED"]


def test_with_no_hold_rules_saved_at_all_every_hold_still_applies():
    make_limits()
    HoldRules.objects.all().delete()
    body = agent_asks(make_payment(fraud_flags=["card_testing"]))
    assert body["status"] == "held" and body["hold_reasons"] == ["PAYMENT_FLAGGED"], body
    assert body["verdict"]["policy_version"].endswith("/ default rules")


# -- finding 2: roles in a migration ---------------------------------------------------------------

def perms(group: str) -> set[str]:
    return {f"{p.content_type.app_label}.{p.codename}"
            for p in Group.objects.get(name=group).permissions.select_related("content_type")}


def test_the_migrations_install_five_roles_each_with_only_its_own_rights():
    assert {"Finance approvers", "Fraud analysts", "Auditors", "Operators", "Administrators"} <= set(
        Group.objects.values_list("name", flat=True))
    finance, fraud, operators, admins = (perms(g) for g in ("Finance approvers", "Fraud analysts", "Operators",
                                                           "Administrators"))
    assert {"refundops.approve_refund", "refundops.add_refund", "refundops.change_refundlimits"} <= finance
    assert "refundops.change_holdrules" in fraud and "refundops.approve_refund" not in fraud
    assert {"refundops.change_platformstate", "refundops.change_agent", "refundops.change_agentkey",
            "processors.change_sandboxcontrol"} <= operators
    assert {"auth.change_user", "approvals.change_approvalauthority", "refundops.change_merchantendpoint"} <= admins
    # Nobody edits someone else's controls, and no role deletes anything.
    assert "refundops.change_holdrules" not in finance | operators | admins
    assert "refundops.change_refundlimits" not in fraud | operators | admins
    assert "refundops.approve_refund" not in operators | admins
    assert "refundops.change_agent" not in finance | fraud | admins
    assert "auth.change_group" not in finance | fraud | operators | admins
    assert not [p for p in finance | fraud | operators | admins if ".delete_" in p]
    auditor = perms("Auditors")
    every_view = {f"{p.content_type.app_label}.{p.codename}"
                  for p in Permission.objects.filter(codename__startswith="view_").select_related("content_type")}
    # Every view, and the evidence pack (built and downloaded, audited): nothing that changes a row of the product.
    assert auditor == every_view | {"audit.build_evidencepack"} and "refundops.view_holdrules" in auditor
    assert "audit.build_evidencepack" not in finance | fraud | operators | admins


def test_grant_role_gives_a_person_a_role_and_the_audit_log_says_who():
    bob = User.objects.create_user("bob", password="pw")
    call_command("grant_role", "bob", "fraud", "analyst", stdout=open("/dev/null", "w"))
    bob = User.objects.get(pk=bob.pk)
    assert bob.is_staff and bob.has_perm("refundops.change_holdrules")
    assert not bob.has_perm("refundops.change_refundlimits")
    entry = AuditEntry.objects.get(action="role.granted", subject_id=str(bob.pk))
    assert entry.data == {"username": "bob", "role": "fraud analyst"} and entry.actor.startswith("cli:")
    call_command("grant_role", "bob", "fraud-analyst", "--revoke", stdout=open("/dev/null", "w"))
    assert not User.objects.get(pk=bob.pk).has_perm("refundops.change_holdrules")
    with pytest.raises(CommandError, match="roles: finance approver, fraud analyst, auditor"):
        call_command("grant_role", "bob", "superhero")
    with pytest.raises(CommandError, match="No user"):
        call_command("grant_role", "nobody", "auditor")


# -- findings 1 and 2: deciding a refund takes authority, and never one's own -------------------------

@pytest.fixture
def held_refund(db):
    make_limits(approval_threshold_minor=5_000)
    body = agent_asks(make_payment(amount=50_000), 9_000)
    assert body["status"] == "held", body
    return Refund.objects.get(pk=body["refund"]["id"])


def test_rejecting_a_held_refund_needs_authority_over_it(held_refund):
    no_authority = person("carol", role="finance approver")
    too_small = person("dave", role="finance approver", authority=5_000)
    for who in (no_authority, too_small):
        with pytest.raises(ApprovalError) as refused:
            reject_refund(refund_id=held_refund.pk, approver=who, note="no")
        assert refused.value.code == "APPROVAL_NOT_AUTHORIZED"
    held_refund.refresh_from_db()
    assert held_refund.status == RefundState.HELD
    reject_refund(refund_id=held_refund.pk, approver=person("erin", role="finance approver", authority=10_000))
    held_refund.refresh_from_db()
    assert held_refund.status == RefundState.REJECTED


def test_a_staff_refund_above_the_requesters_own_authority_is_held_for_someone_else():
    make_limits(approval_threshold_minor=10**12)  # even with the threshold out of the way
    alice = person("alice", role="finance approver", authority=100_000)
    payment = make_payment(amount=1_000_000)
    small = staff_asks(alice, payment, 90_000)
    assert small["refund"]["status"] == "approved", small
    big = staff_asks(alice, payment, 400_000)
    assert big["status"] == "held" and big["hold_reasons"] == ["ABOVE_REQUESTER_AUTHORITY"], big
    refund_id = big["refund"]["id"]
    with pytest.raises(ApprovalError, match="cannot decide a refund they asked for"):
        approve_refund(refund_id=refund_id, approver=alice)
    with pytest.raises(ApprovalError, match="cannot decide a refund they asked for"):
        reject_refund(refund_id=refund_id, approver=alice)
    approve_refund(refund_id=refund_id, approver=person("bob", role="finance approver", authority=500_000))
    assert Refund.objects.get(pk=refund_id).status == RefundState.APPROVED


def test_a_person_with_no_authority_refunds_nothing_alone():
    make_limits(approval_threshold_minor=10**12)
    clerk = person("clerk", role="finance approver")
    body = staff_asks(clerk, make_payment(amount=5_000), 100)
    assert body["status"] == "held" and body["hold_reasons"] == ["ABOVE_REQUESTER_AUTHORITY"], body
