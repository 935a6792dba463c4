# The finance dashboard's decisions by person (issue 31): people's entries of the last days, read
# through a small partial index instead of the whole log.

from django.db import migrations, models

from audit.db_operations import AddIndexConcurrentlyOnPostgres


class Migration(migrations.Migration):

    atomic = False  # CREATE INDEX CONCURRENTLY cannot run inside a transaction

    dependencies = [
        ('audit', '0005_admin_search_indexes'),
    ]

    operations = [
        AddIndexConcurrentlyOnPostgres(
            model_name='auditentry',
            index=models.Index(condition=models.Q(('actor__startswith', 'user:')), fields=['created_at'],
                               name='audit_entry_people'),
        ),
    ]
