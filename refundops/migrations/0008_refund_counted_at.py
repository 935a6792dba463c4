"""Refund.counted_at: when the running totals count a refund (asked for, or resubmitted today).
Existing refunds are counted from when they were made, as before."""

import django.utils.timezone
from django.db import migrations, models
from django.db.models import F


def count_from_creation(apps, schema_editor):
    for name in ("Refund", "HistoricalRefund"):
        apps.get_model("refundops", name).objects.update(counted_at=F("created_at"))


class Migration(migrations.Migration):

    dependencies = [
        ('refundops', '0007_hold_rules_v1'),
    ]

    operations = [
        migrations.AddField(
            model_name='historicalrefund',
            name='counted_at',
            field=models.DateTimeField(db_index=True, default=django.utils.timezone.now),
        ),
        migrations.AddField(
            model_name='refund',
            name='counted_at',
            field=models.DateTimeField(db_index=True, default=django.utils.timezone.now),
        ),
        migrations.RunPython(count_from_creation, migrations.RunPython.noop),
    ]
