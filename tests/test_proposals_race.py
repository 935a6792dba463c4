"""Review of four eyes (issue 28, finding 1) under concurrency: two approvers approving two
proposals that change the same field of one control at once. The stale check must read the control
under the lock its write takes, or the second approval writes over the first one's change though
its proposer never saw it (a lost update), or fails with a 500."""

from __future__ import annotations

import threading

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.db import transaction

from approvals.models import ApprovalAuthority
from audit.models import AuditEntry
from proposals.models import Proposal
from proposals.services import ProposalError, approve_proposal, propose_change
from refundops.models import Agent, HoldRules, RefundLimits
from tests.conftest import make_limits, make_rules, race, wait_until_another_connection_waits_for_a_lock

K = Proposal.Kind


def person(username: str, role: str) -> User:
    user = User.objects.create_user(username, password="pw")
    call_command("grant_role", username, role, stdout=open("/dev/null", "w"))
    return User.objects.get(pk=user.pk)


def approve_both_at_once(first: Proposal, second: Proposal, first_by: User, second_by: User):
    """The first approval commits while the second is under way: it holds its transaction open
    until the second waits on a lock, then commits. Returns what the second approval did. (Give the
    two proposals different proposers: the proposal's row lock also locks its proposer's user row,
    which would serialise them by accident.)"""
    approved = threading.Event()

    def work(i: int):
        if i == 0:
            with transaction.atomic():
                approve_proposal(proposal_id=first.pk, approver=first_by)
                approved.set()
                wait_until_another_connection_waits_for_a_lock()
            return None
        approved.wait(10)
        try:
            approve_proposal(proposal_id=second.pk, approver=second_by)
        except ProposalError as refused:
            return refused.code
        return "approved"

    return race(2, work)[1]


@pytest.mark.django_db(transaction=True)
def test_two_authority_proposals_of_one_amount_approved_at_once_the_second_is_stale():
    admin1, admin2, admin3, admin4 = (person(f"admin{n}", "administrator") for n in range(1, 5))
    approver = person("approver", "finance approver")
    authority = ApprovalAuthority.objects.create(user=approver, currency="USD", max_amount_minor=100_000)
    subject = f"{approver.pk}:USD"
    lower = propose_change(kind=K.APPROVAL_AUTHORITY, subject_id=subject, proposer=admin1,
                           changes={"max_amount_minor": 10_000})
    raise_ = propose_change(kind=K.APPROVAL_AUTHORITY, subject_id=subject, proposer=admin4,
                            changes={"max_amount_minor": 500_000})

    assert approve_both_at_once(lower, raise_, admin2, admin3) == "PROPOSAL_STALE"
    authority.refresh_from_db()
    assert authority.max_amount_minor == 10_000  # the lowering stays: nobody saw 10,000 -> 500,000
    raise_.refresh_from_db()
    assert raise_.status == Proposal.Status.PENDING
    assert AuditEntry.objects.filter(action="proposal.refused_stale", subject_id=raise_.pk).exists()


@pytest.mark.django_db(transaction=True)
def test_two_hold_rule_proposals_of_one_field_approved_at_once_the_second_is_stale_not_a_500():
    make_rules(contact_change_days=7)
    admin1, admin2, admin3, admin4 = (person(f"analyst{n}", "fraud analyst") for n in range(1, 5))
    first = propose_change(kind=K.HOLD_RULES, proposer=admin1, changes={"contact_change_days": 14})
    second = propose_change(kind=K.HOLD_RULES, proposer=admin4, changes={"contact_change_days": 30})

    assert approve_both_at_once(first, second, admin2, admin3) == "PROPOSAL_STALE"
    assert list(HoldRules.objects.order_by("version").values_list("version", "contact_change_days")) == [
        (1, 7), (2, 14)]


@pytest.mark.django_db(transaction=True)
def test_two_limit_proposals_of_one_field_approved_at_once_the_second_is_stale():
    make_limits(approval_threshold_minor=20_000)
    admin1, admin2, admin3, admin4 = (person(f"finance{n}", "finance approver") for n in range(1, 5))
    first = propose_change(kind=K.REFUND_LIMITS, subject_id="USD", proposer=admin1,
                           changes={"approval_threshold_minor": 10_000})
    second = propose_change(kind=K.REFUND_LIMITS, subject_id="USD", proposer=admin4,
                            changes={"approval_threshold_minor": 90_000})

    assert approve_both_at_once(first, second, admin2, admin3) == "PROPOSAL_STALE"
    latest = RefundLimits.objects.filter(currency="USD").order_by("-version").first()
    assert latest.approval_threshold_minor == 10_000


@pytest.mark.django_db(transaction=True)
def test_two_proposals_of_different_fields_approved_at_once_both_apply():
    make_rules(contact_change_days=7)
    admin1, admin2, admin3, admin4 = (person(f"analyst{n}", "fraud analyst") for n in range(1, 5))
    first = propose_change(kind=K.HOLD_RULES, proposer=admin1, changes={"contact_change_days": 14})
    second = propose_change(kind=K.HOLD_RULES, proposer=admin4, changes={"hold_flagged": False})

    assert approve_both_at_once(first, second, admin2, admin3) == "approved"
    latest = HoldRules.objects.order_by("-version").first()
    assert (latest.version, latest.contact_change_days, latest.hold_flagged) == (3, 14, False)


@pytest.mark.django_db(transaction=True)
def test_a_capability_grant_approved_while_a_revoke_commits_is_stale_and_the_revoke_stays():
    """A revoke is one person's act at once (the agent's row lock); a grant approved meanwhile read
    the list before the revoke committed: it must see the revoke, as in the sequential case."""
    from refundops.services import agents

    agent = Agent.objects.create(name="bot", capabilities=["payments.read", "refunds.create"])
    op1, op2, op3 = (person(f"op{n}", "operator") for n in range(1, 4))
    grant = propose_change(kind=K.AGENT_CAPABILITIES, subject_id=agent.pk, proposer=op1,
                           changes={"capabilities": ["payments.read", "refunds.create", "payments.capture"]})
    revoking = threading.Event()

    def work(i: int):
        if i == 0:
            with transaction.atomic():
                agents.revoke_capability(agent_id=agent.pk, capability="refunds.create", actor=op3)
                revoking.set()
                wait_until_another_connection_waits_for_a_lock()
            return None
        revoking.wait(10)
        try:
            approve_proposal(proposal_id=grant.pk, approver=op2)
        except ProposalError as refused:
            return refused.code
        return "approved"

    assert race(2, work)[1] == "PROPOSAL_STALE"
    assert Agent.objects.get(pk=agent.pk).capabilities == ["payments.read"]


@pytest.mark.django_db
def test_a_set_posted_in_another_order_is_nothing_to_change_and_no_older_proposal_goes_stale_by_it():
    """Capabilities, allowed reasons and event types are sets kept as lists: the same members in
    another order (a form's, an API client's) are no change, and an order written since is no move."""
    make_limits(allowed_reasons=["customer_request", "duplicate"])
    op1, op2 = person("op1", "operator"), person("op2", "operator")
    fin1 = person("fin1", "finance approver")
    agent = Agent.objects.create(name="bot", capabilities=["payments.read", "refunds.create"])

    with pytest.raises(ProposalError) as same:
        propose_change(kind=K.AGENT_CAPABILITIES, subject_id=agent.pk, proposer=op1,
                       changes={"capabilities": ["refunds.create", "payments.read"]})
    assert same.value.code == "NOTHING_TO_CHANGE"
    with pytest.raises(ProposalError) as same:
        propose_change(kind=K.REFUND_LIMITS, subject_id="USD", proposer=fin1,
                       changes={"allowed_reasons": ["duplicate", "customer_request"]})
    assert same.value.code == "NOTHING_TO_CHANGE"

    grant = propose_change(kind=K.AGENT_CAPABILITIES, subject_id=agent.pk, proposer=op1,
                           changes={"capabilities": ["payments.read", "refunds.create", "payments.capture"]})
    Agent.objects.filter(pk=agent.pk).update(capabilities=["refunds.create", "payments.read"])  # reordered only
    approve_proposal(proposal_id=grant.pk, approver=op2)
    assert set(Agent.objects.get(pk=agent.pk).capabilities) == {"payments.read", "refunds.create",
                                                                "payments.capture"}


@pytest.mark.django_db
def test_a_crash_between_applying_and_auditing_leaves_the_control_and_the_proposal_as_they_were(monkeypatch):
    """Applying, deciding and auditing an approval are one transaction: a crash in the audit undoes
    the change."""
    import proposals.services as services

    admin1, admin2 = person("admin1", "administrator"), person("admin2", "administrator")
    approver = person("approver", "finance approver")
    ApprovalAuthority.objects.create(user=approver, currency="USD", max_amount_minor=100_000)
    proposal = propose_change(kind=K.APPROVAL_AUTHORITY, subject_id=f"{approver.pk}:USD", proposer=admin1,
                              changes={"max_amount_minor": 500_000})

    def crash(**kwargs):
        raise RuntimeError("the audit chain is down")

    monkeypatch.setattr(services, "record_audit", crash)
    with pytest.raises(RuntimeError):
        approve_proposal(proposal_id=proposal.pk, approver=admin2)
    assert ApprovalAuthority.objects.get(user=approver).max_amount_minor == 100_000
    proposal.refresh_from_db()
    assert (proposal.status, proposal.decided_by_id, proposal.result_id) == (Proposal.Status.PENDING, None, "")


@pytest.mark.django_db
def test_a_field_moved_and_moved_back_is_not_stale_the_approver_sees_what_is_in_force():
    """A -> B -> A: an older proposal A -> C reads the control as its proposer saw it, so its diff
    still says what approving it does; it applies (the last approved change of the field is C)."""
    admin1, admin2, admin3 = (person(f"admin{n}", "administrator") for n in range(1, 4))
    approver = person("approver", "finance approver")
    ApprovalAuthority.objects.create(user=approver, currency="USD", max_amount_minor=100_000)
    subject = f"{approver.pk}:USD"
    older = propose_change(kind=K.APPROVAL_AUTHORITY, subject_id=subject, proposer=admin1,
                           changes={"max_amount_minor": 150_000})
    for amount in (0, 100_000):
        moved = propose_change(kind=K.APPROVAL_AUTHORITY, subject_id=subject, proposer=admin3,
                               changes={"max_amount_minor": amount})
        approve_proposal(proposal_id=moved.pk, approver=admin2)
    approve_proposal(proposal_id=older.pk, approver=admin2)
    assert ApprovalAuthority.objects.get(user=approver).max_amount_minor == 150_000
