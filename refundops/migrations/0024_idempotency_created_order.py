# The idempotency records' admin list at size (issue 31): a record a refund request, never purged, read
# newest first along an index instead of sorting every record on each page.

from django.db import migrations, models

from audit.db_operations import AddIndexConcurrentlyOnPostgres


class Migration(migrations.Migration):

    atomic = False  # CREATE INDEX CONCURRENTLY cannot run inside a transaction

    dependencies = [
        ('refundops', '0023_backtest_run_heartbeat'),
    ]

    operations = [
        AddIndexConcurrentlyOnPostgres(
            model_name='idempotencyrecord',
            index=models.Index(fields=['created_at', 'id'], name='idempotency_created_order'),
        ),
    ]
