from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [("audit", "0003_verdict_policy_input_shadow")]

    operations = [
        # Nullable, no default: PostgreSQL adds it without rewriting the table.
        migrations.AddField(model_name="verdict", name="chained_by",
                            field=models.UUIDField(blank=True, editable=False, null=True)),
        migrations.AddIndex(model_name="verdict",
                            index=models.Index(condition=models.Q(("chained_by__isnull", True)), fields=["id"],
                                               name="audit_verdict_unchained")),
    ]
