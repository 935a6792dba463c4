"""No agent name may start with "ag_", as agent ids do (issue 28): a name shaped like another agent's
id could be taken for it by a lookup of "id or name". Names are already unique (0001). An agent
whose name starts so is renamed first to "renamed <name>" (with a number when that is taken too):
its id, keys and capabilities stay as they are, and its history row records the rename."""

from django.db import migrations, models
from django.utils import timezone


def rename_id_shaped_agents(apps, schema_editor):
    Agent = apps.get_model("refundops", "Agent")
    HistoricalAgent = apps.get_model("refundops", "HistoricalAgent")
    for agent in Agent.objects.filter(name__istartswith="ag_").order_by("created_at"):
        base = f"renamed {agent.name}"[:100]
        name, n = base, 1
        while Agent.objects.filter(name=name).exists():
            n += 1
            name = f"{base[:100 - len(str(n)) - 1]} {n}"
        agent.name = name
        agent.save(update_fields=["name"])
        HistoricalAgent.objects.create(
            id=agent.pk, name=agent.name, merchant_id=agent.merchant_id, owner=agent.owner,
            capabilities=agent.capabilities, is_active=agent.is_active, created_at=agent.created_at,
            history_date=timezone.now(), history_type="~",
            history_change_reason="renamed: a name may not start with 'ag_' (migration 0018)")


class Migration(migrations.Migration):
    dependencies = [("refundops", "0017_drop_pattern_ops_twins")]

    operations = [
        migrations.RunPython(rename_id_shaped_agents, migrations.RunPython.noop),
        migrations.AddConstraint(
            model_name="agent",
            constraint=models.CheckConstraint(condition=~models.Q(name__istartswith="ag_"),
                                              name="agent_name_not_an_id",
                                              violation_error_message="An agent name cannot start with 'ag_': "
                                                                      "agent ids do."),
        ),
    ]
