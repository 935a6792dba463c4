# The admin's lists and the finance dashboard at size (issue 31): the payment list's order, the refund
# list sorted by amount, and the dashboard's payments paid twice or disputed, read along indexes
# instead of sorting or counting a million rows on each page.

from django.db import migrations, models

from audit.db_operations import AddIndexConcurrentlyOnPostgres


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
            model_name='payment',
            index=models.Index(condition=models.Q(('paid_twice', True)), fields=['created_at'],
                               name='payment_paid_twice'),
        ),
        AddIndexConcurrentlyOnPostgres(
            model_name='payment',
            index=models.Index(condition=models.Q(('dispute_status', 'open')), fields=['id'],
                               name='payment_dispute_open'),
        ),
        AddIndexConcurrentlyOnPostgres(
            model_name='refund',
            index=models.Index(fields=['amount_minor', 'id'], name='refund_amount_order'),
        ),
    ]
