"""Agents, keys and the switches: the services and the operator commands, each audited and each
in force from the very next call."""

from __future__ import annotations

import json
from datetime import timedelta
from io import StringIO

import pytest
from django.contrib.auth import get_user_model
from django.core.management import CommandError, call_command
from django.utils import timezone
from rest_framework.test import APIClient

from audit.models import AuditEntry
from refundops.access import KEY_PREFIX_LENGTH, hash_key
from refundops.models import Agent, AgentKey, Capability, PlatformState
from refundops.services import agents
from tests.conftest import make_payment, post

pytestmark = pytest.mark.django_db


def client_for(raw: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    return client


def lookup(raw: str, payment) -> int:
    return client_for(raw).get(f"/api/v1/payments/{payment.pk}").status_code


def run(*args: str) -> str:
    out = StringIO()
    call_command(*args, stdout=out)
    return out.getvalue()


def test_create_agent_stores_only_the_hash_and_the_key_works_once_shown():
    staff = get_user_model().objects.create_user("ops", is_staff=True)
    agent, raw = agents.create_agent(name="support-bot", owner="support", actor=staff,
                                     capabilities=["refunds.create", "payments.read", "payments.read"])
    assert agent.capabilities == ["payments.read", "refunds.create"]  # contract order, each once
    key = AgentKey.objects.get(agent=agent)
    assert raw.startswith("rk_") and key.prefix == raw[:KEY_PREFIX_LENGTH]
    assert key.key_hash == hash_key(raw) and raw not in key.key_hash
    assert lookup(raw, make_payment()) == 200
    assert agent.history.first().history_user == staff  # simple_history names the acting user
    actions = list(AuditEntry.objects.order_by("id").values_list("action", "actor"))
    assert actions == [("agent.created", "user:ops"), ("key.issued", "user:ops")]


@pytest.mark.parametrize("capability", ["payouts.manage", "keys.create", "webhooks.configure"])
def test_payout_key_and_webhook_powers_are_withheld_with_a_clear_refusal(capability):
    with pytest.raises(agents.AgentAccessError, match="stay with administrators"):
        agents.create_agent(name="greedy", capabilities=["payments.read", capability], actor="cli:test")
    with pytest.raises(agents.AgentAccessError, match="stay with administrators"):
        agents.grant_capability(agent_name_or_id="nobody", capability=capability, actor="cli:test")
    assert not Agent.objects.exists()


def test_unknown_capability_and_duplicate_name_are_refused():
    with pytest.raises(agents.AgentAccessError, match="not a capability"):
        agents.create_agent(name="a", capabilities=["refunds.everything"], actor="cli:test")
    agents.create_agent(name="a", capabilities=["payments.read"], actor="cli:test")
    with pytest.raises(agents.AgentAccessError, match="already exists"):
        agents.create_agent(name="a", capabilities=["payments.read"], actor="cli:test")
    assert Agent.objects.count() == 1 and AgentKey.objects.count() == 1


def test_create_agent_command_prints_the_key_once_and_as_json():
    text = run("create_agent", "bot-one", "--capability", "payments.read", "refunds.create",
               "--capability", "disputes.draft", "--owner", "support")
    raw = text.strip().splitlines()[-1]
    agent = Agent.objects.get(name="bot-one")
    assert agent.capabilities == ["payments.read", "disputes.draft", "refunds.create"]
    assert lookup(raw, make_payment()) == 200
    data = json.loads(run("create_agent", "bot-two", "--capability", "payments.read", "--json",
                          "--expires-in-days", "30"))
    assert data["name"] == "bot-two" and data["key"].startswith(data["key_prefix"])
    key = AgentKey.objects.get(prefix=data["key_prefix"])
    assert timedelta(days=29) < key.expires_at - timezone.now() <= timedelta(days=30)
    with pytest.raises(CommandError, match="not a capability"):
        run("create_agent", "bot-three", "--capability", "refunds.all")


def test_revoke_key_by_service_and_by_command_holds_from_the_next_call():
    payment = make_payment()
    agent, first = agents.create_agent(name="bot", capabilities=["payments.read"], actor="cli:test")
    second = agents.issue_key(agent=agent, actor="cli:test")
    assert lookup(first, payment) == lookup(second, payment) == 200
    agents.revoke_key(prefix=first[:KEY_PREFIX_LENGTH], actor="cli:test")
    assert lookup(first, payment) == 401 and lookup(second, payment) == 200
    assert "is revoked" in run("revoke_key", second[:KEY_PREFIX_LENGTH])
    response = client_for(second).get(f"/api/v1/payments/{payment.pk}")
    assert response.status_code == 401 and response.json()["error"]["code"] == "UNAUTHENTICATED"
    assert AuditEntry.objects.filter(action="key.revoked").count() == 2
    run("revoke_key", second)  # a pasted whole key names its key too; twice is a no-op
    assert AuditEntry.objects.filter(action="key.revoked").count() == 2
    with pytest.raises(CommandError, match="No key"):
        run("revoke_key", "rk_nothere0")


def test_revoke_and_grant_capability_hold_from_the_next_call():
    payment = make_payment()
    agent, raw = agents.create_agent(name="bot", capabilities=["payments.read", "refunds.create"],
                                     actor="cli:test")
    run("revoke_capability", "bot", "payments.read")
    response = client_for(raw).get(f"/api/v1/payments/{payment.pk}")
    assert response.status_code == 403 and response.json()["error"]["code"] == "CAPABILITY_NOT_GRANTED"
    assert "can: payments.read, refunds.create" in run("agents", "grant", agent.pk, "payments.read")
    assert lookup(raw, payment) == 200
    agents.revoke_capability(agent_name_or_id=agent.pk, capability="payments.read", actor="cli:test")
    assert lookup(raw, payment) == 403
    entry = AuditEntry.objects.filter(action="capability.revoked").first()
    assert entry.data["capability"] == "payments.read" and entry.actor == "cli:test"
    with pytest.raises(CommandError, match="No agent"):
        run("revoke_capability", "ghost", "payments.read")


def test_agents_off_refuses_every_key_until_on():
    payment = make_payment()
    _, raw = agents.create_agent(name="bot", capabilities=["payments.read"], actor="cli:test")
    assert "OFF for every agent" in run("agents", "off")
    assert lookup(raw, payment) == 401
    assert PlatformState.current().changed_by.startswith("cli:")
    run("agents", "on")
    assert lookup(raw, payment) == 200
    assert list(AuditEntry.objects.filter(action__startswith="agents.").order_by("id")
                .values_list("action", flat=True)) == ["agents.disabled", "agents.enabled"]


def test_killswitch_pauses_agent_refunds_from_the_next_call(policy):
    payment = make_payment()
    _, raw = agents.create_agent(name="bot", capabilities=["refunds.create"], actor="cli:test")
    assert "ON" in run("killswitch", "on")
    assert "ON" in run("killswitch", "status")
    response = post(client_for(raw), "/api/v1/refunds", {"transaction_id": payment.pk, "reason": "duplicate"})
    assert response.status_code == 503 and response.json()["error"]["code"] == "CIRCUIT_OPEN"
    assert "off" in run("killswitch", "off")
    response = post(client_for(raw), "/api/v1/refunds", {"transaction_id": payment.pk, "reason": "duplicate"})
    assert response.status_code == 201
    assert [h.refunds_paused for h in PlatformState.current().history.order_by("history_id")][-2:] == [True, False]


def test_issue_key_command_and_status_listing():
    agents.create_agent(name="bot", capabilities=["payments.read"], actor="cli:test")
    text = run("agents", "issue-key", "bot", "--expires-in-days", "7")
    raw = text.strip().splitlines()[-1]
    assert lookup(raw, make_payment()) == 200
    status = run("agents", "status")
    assert "bot (ag_" in status and f"{raw[:KEY_PREFIX_LENGTH]}… live" in status
    with pytest.raises(agents.AgentAccessError, match="future"):
        agents.issue_key(agent=Agent.objects.get(name="bot"), actor="cli:test",
                         expires_at=timezone.now() - timedelta(seconds=1))


def test_every_agent_capability_can_be_granted_at_once():
    agent, _ = agents.create_agent(name="all", capabilities=Capability.values, actor="cli:test")
    assert agent.capabilities == list(Capability.values)
