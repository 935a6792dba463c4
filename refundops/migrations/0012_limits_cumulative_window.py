"""Splitting a refund no longer beats the approval threshold: it applies to what agents refunded
to the same customer within a window finance sets (default 24 hours)."""

from django.db import migrations, models


class Migration(migrations.Migration):
    dependencies = [("refundops", "0011_payment_operation_unknown")]
    operations = [
        migrations.AddField(
            model_name="refundlimits", name="cumulative_window_hours",
            field=models.PositiveIntegerField(
                default=24, help_text="The approval threshold also applies to what agents refunded to the same "
                                      "customer within this many hours (and on the same payment, ever), plus the "
                                      "new amount")),
    ]
