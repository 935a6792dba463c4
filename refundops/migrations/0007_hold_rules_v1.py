"""Fail closed: a fresh database holds refunds on disputed and flagged payments, recent contact
changes and fast repeat refunds from the start. Fraud changes the rules by proposal."""

from django.db import migrations


def seed_hold_rules(apps, schema_editor):
    HoldRules = apps.get_model("refundops", "HoldRules")
    if not HoldRules.objects.exists():
        HoldRules.objects.create(
            version=1, hold_disputed=True, hold_flagged=True, hold_recent_contact_change=True,
            contact_change_days=7, hold_customer_velocity=True, velocity_max_refunds=3, velocity_window_hours=24,
            note="Seeded at install: every hold on", created_by="migration")


class Migration(migrations.Migration):
    dependencies = [("refundops", "0006_dispute_evidence_submission")]
    operations = [migrations.RunPython(seed_hold_rules, migrations.RunPython.noop)]
