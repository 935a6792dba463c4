from django.db import migrations, models


class Migration(migrations.Migration):

    dependencies = [
        ('audit', '0007_evidence_pack'),
    ]

    operations = [
        migrations.AddField(
            model_name='evidencepack',
            name='builder',
            field=models.CharField(blank=True, max_length=40),
        ),
        migrations.AddField(
            model_name='evidencepack',
            name='heartbeat_at',
            field=models.DateTimeField(blank=True, null=True),
        ),
    ]
