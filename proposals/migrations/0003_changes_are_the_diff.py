"""A pending proposal stored before issue 28 may carry every field of its control in ``changes``
(the admin posted them all); only those in its diff are what its proposer changed. Trim each to its
diff so that what is stored says what approving it applies (the service reads the diff either way).
Decided proposals are left as they were: they are the record of what happened."""

from django.db import migrations


def trim_changes_to_the_diff(apps, schema_editor):
    Proposal = apps.get_model("proposals", "Proposal")
    for proposal in Proposal.objects.filter(status="pending").only("pk", "changes", "diff"):
        changes = {field: after for field, (_, after) in proposal.diff.items()}
        if changes != proposal.changes:
            Proposal.objects.filter(pk=proposal.pk).update(changes=changes)


class Migration(migrations.Migration):
    dependencies = [("proposals", "0002_merchant_settings_kind")]

    operations = [migrations.RunPython(trim_changes_to_the_diff, migrations.RunPython.noop)]
