# The admin's lists at size (issue 31): the payment list's order and the refund list sorted by amount
# read along an index instead of sorting a million rows on each page.

from django.contrib.postgres.operations import AddIndexConcurrently
from django.db import migrations, models


class AddIndexConcurrentlyOnPostgres(AddIndexConcurrently):
    """``CREATE INDEX CONCURRENTLY`` on PostgreSQL, so a production table takes writes while the
    index builds; a plain index elsewhere (SQLite, the embedded mode)."""

    def database_forwards(self, app_label, schema_editor, from_state, to_state):
        if schema_editor.connection.vendor == "postgresql":
            return super().database_forwards(app_label, schema_editor, from_state, to_state)
        return migrations.AddIndex.database_forwards(self, app_label, schema_editor, from_state, to_state)

    def database_backwards(self, app_label, schema_editor, from_state, to_state):
        if schema_editor.connection.vendor == "postgresql":
            return super().database_backwards(app_label, schema_editor, from_state, to_state)
        return migrations.AddIndex.database_backwards(self, app_label, schema_editor, from_state, to_state)


class Migration(migrations.Migration):

    atomic = False  # CREATE INDEX CONCURRENTLY cannot run inside a transaction

    dependencies = [
        ('refundops', '0020_admin_search_indexes'),
    ]

    operations = [
        AddIndexConcurrentlyOnPostgres(
            model_name='payment',
            index=models.Index(fields=['created_at', 'id'], name='payment_created_order'),
        ),
        AddIndexConcurrentlyOnPostgres(
            model_name='refund',
            index=models.Index(fields=['amount_minor', 'id'], name='refund_amount_order'),
        ),
    ]
