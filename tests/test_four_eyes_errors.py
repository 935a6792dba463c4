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
