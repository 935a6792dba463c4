"""Where an agent's id is meant, the agent is looked up by id; an agent's name can never be shaped
like an id, and is unique. (Issue 28, finding 2.)

The attack: an agent named after another agent's id. Before, ``find_agent`` matched id or name and
took the first row, so the admin's revoke (which passes the id) took the capability from the
impostor while the victim kept it, and a grant by proposal went to the impostor."""

from __future__ import annotations

from io import StringIO

import pytest
from django.contrib.admin.utils import quote
from django.contrib.auth.models import User
from django.core.management import call_command
from django.db import IntegrityError
from django.test import Client

from audit.models import AuditEntry
from proposals.models import Proposal
from proposals.services import approve_proposal
from refundops.models import Agent
from refundops.models.agents import new_agent_id
from refundops.services import agents

pytestmark = pytest.mark.django_db


def operator(username: str) -> tuple[User, Client]:
    user = User.objects.create_user(username, password="pw")
    call_command("grant_role", username, "operator", stdout=StringIO())
    user = User.objects.get(pk=user.pk)
    client = Client()
    client.force_login(user)
    return user, client


def victim_and_impostor(*capabilities: str) -> tuple[Agent, Agent]:
    """The impostor is written first, under the name that is the victim's id (as a writer could before
    the check constraint, dropped here for this test's transaction only), so a lookup by "id or name"
    meets it first."""
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE refundops_agent DROP CONSTRAINT IF EXISTS agent_name_not_an_id")
    victim_id = new_agent_id()
    impostor = Agent.objects.create(name=victim_id, capabilities=list(capabilities))
    victim = Agent.objects.create(id=victim_id, name="support-bot", capabilities=list(capabilities))
    return victim, impostor


def inline() -> dict:
    return {"keys-TOTAL_FORMS": "0", "keys-INITIAL_FORMS": "0", "keys-MIN_NUM_FORMS": "0",
            "keys-MAX_NUM_FORMS": "1000"}


def test_the_admins_revoke_takes_the_capability_from_the_agent_on_the_page():
    victim, impostor = victim_and_impostor("payments.read", "refunds.create")
    _, client = operator("op1")
    response = client.post(f"/admin/refundops/agent/{quote(victim.pk)}/change/",
                           {"capabilities": ["payments.read"], **inline()}, follow=True)
    assert response.status_code == 200
    assert Agent.objects.get(pk=victim.pk).capabilities == ["payments.read"]
    assert Agent.objects.get(pk=impostor.pk).capabilities == ["payments.read", "refunds.create"]
    assert AuditEntry.objects.get(action="capability.revoked").subject_id == victim.pk


def test_a_capability_grant_by_proposal_goes_to_the_agent_it_names():
    victim, impostor = victim_and_impostor("payments.read")
    op1, client = operator("op1")
    op2, _ = operator("op2")
    client.post(f"/admin/refundops/agent/{quote(victim.pk)}/change/",
                {"capabilities": ["payments.read", "refunds.create"], **inline()})
    proposal = Proposal.objects.get(kind=Proposal.Kind.AGENT_CAPABILITIES)
    approve_proposal(proposal_id=proposal.pk, approver=op2)
    assert Agent.objects.get(pk=victim.pk).capabilities == ["payments.read", "refunds.create"]
    assert Agent.objects.get(pk=impostor.pk).capabilities == ["payments.read"]


def test_the_command_line_given_an_id_acts_on_that_agent():
    victim, impostor = victim_and_impostor("payments.read", "refunds.create")
    call_command("revoke_capability", victim.pk, "refunds.create", stdout=StringIO())
    call_command("agents", "grant", victim.pk, "payments.capture", stdout=StringIO())
    assert Agent.objects.get(pk=victim.pk).capabilities == ["payments.read", "payments.capture"]
    assert Agent.objects.get(pk=impostor.pk).capabilities == ["payments.read", "refunds.create"]
    out = StringIO()
    call_command("agents", "issue-key", victim.pk, stdout=out)
    assert victim.keys.count() == 1 and impostor.keys.count() == 0


@pytest.mark.parametrize("name", ["ag_0123456789abcdef01234567", "AG_0123456789abcdef01234567", " ag_x"])
def test_an_agent_name_shaped_like_an_id_is_refused_with_a_clear_error(name):
    with pytest.raises(agents.AgentAccessError, match="cannot start with 'ag_'"):
        agents.create_agent(name=name, capabilities=["payments.read"], actor="cli:test")
    assert not Agent.objects.exists()
    with pytest.raises(IntegrityError):
        Agent.objects.create(name=name.strip())


def test_an_agent_name_is_unique_within_its_merchant_and_a_duplicate_is_refused_by_name():
    agents.create_agent(name="support-bot", capabilities=["payments.read"], actor="cli:test")
    with pytest.raises(agents.AgentAccessError, match="'support-bot' already exists"):
        agents.create_agent(name="support-bot", capabilities=["payments.read"], actor="cli:test")
    assert Agent.objects.filter(name="support-bot").count() == 1


def test_the_migration_renames_an_existing_agent_whose_name_is_shaped_like_an_id():
    from importlib import import_module

    from django.apps import apps
    from django.db import connection

    with connection.cursor() as cursor:
        cursor.execute("ALTER TABLE refundops_agent DROP CONSTRAINT IF EXISTS agent_name_not_an_id")
    shaped = Agent.objects.create(name="ag_0123456789abcdef01234567")
    taken = Agent.objects.create(name="renamed ag_0123456789abcdef01234567")
    import_module("refundops.migrations.0018_agent_name_not_an_id").rename_id_shaped_agents(apps, None)
    renamed = Agent.objects.get(pk=shaped.pk).name
    assert not renamed.lower().startswith("ag_") and renamed != taken.name and "ag_0123456789abcdef01234567" in renamed
