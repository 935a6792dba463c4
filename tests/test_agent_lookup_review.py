"""Review of issue 28, finding 2: names that look like ids to a person (Unicode look-alikes, an
invisible first character) are names to the code, and never take another agent's place."""

from __future__ import annotations

import pytest

from refundops.models import Agent
from refundops.services import agents

pytestmark = pytest.mark.django_db


@pytest.mark.parametrize("disguise", ["\u0430g_", "\u200bag_", "\u00a0ag_", "\uff41g_"],
                         ids=["cyrillic a", "zero-width space", "no-break space", "fullwidth a"])
def test_a_look_alike_of_an_id_is_a_name_and_never_takes_the_agent_the_id_names(disguise: str):
    victim, _ = agents.create_agent(name="victim", capabilities=["payments.read", "refunds.create"], actor="cli:t")
    name = disguise + victim.pk.removeprefix("ag_")
    if disguise == "\u00a0ag_":  # a space Python strips: refused like "ag_"
        with pytest.raises(agents.AgentAccessError, match="cannot start with 'ag_'"):
            agents.create_agent(name=name, capabilities=["payments.read"], actor="cli:t")
        return
    impostor, _ = agents.create_agent(name=name, capabilities=["payments.read"], actor="cli:t")
    assert agents.find_agent(victim.pk).pk == victim.pk
    assert agents.find_agent(name).pk == impostor.pk
    agents.revoke_capability(agent_id=victim.pk, capability="refunds.create", actor="cli:t")
    assert Agent.objects.get(pk=victim.pk).capabilities == ["payments.read"]
    assert Agent.objects.get(pk=impostor.pk).capabilities == ["payments.read"]
