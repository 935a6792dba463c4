"""The five staff roles as groups with their permissions (roles.definitions)."""

from django.contrib.auth.management import create_permissions
from django.db import migrations


def install_roles(apps, schema_editor):
    from roles.definitions import sync_roles

    # Permissions are normally created after migrate; the roles need them now.
    for app_config in apps.get_app_configs():
        app_config.models_module = True
        create_permissions(app_config, apps=apps, verbosity=0)
        app_config.models_module = None
    sync_roles(apps)


class Migration(migrations.Migration):
    dependencies = [
        ("auth", "0012_alter_user_first_name_max_length"),
        ("contenttypes", "0002_remove_content_type_name"),
        ("refundops", "0007_hold_rules_v1"),
        ("approvals", "0001_initial"),
        ("audit", "0001_initial"),
        ("processors", "0002_inbound_events"),
        ("proposals", "0001_initial"),
    ]
    operations = [migrations.RunPython(install_roles, migrations.RunPython.noop)]
