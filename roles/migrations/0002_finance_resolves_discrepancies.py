"""Finance approvers resolve ledger discrepancies (Reconciliation): the roles re-synced with the new
permission, as 0001 installed them (roles.definitions)."""

from importlib import import_module

from django.db import migrations


def resync_roles(apps, schema_editor):
    import_module("roles.migrations.0001_roles").install_roles(apps, schema_editor)


class Migration(migrations.Migration):
    dependencies = [
        ("roles", "0001_roles"),
        ("refundops", "0015_ledger_discrepancy_resolve_permission"),
    ]
    operations = [migrations.RunPython(resync_roles, migrations.RunPython.noop)]
