"""Folding the day's totals (refundops/models/totals.py): each bucket's rows replaced by their sum."""

from __future__ import annotations

from django.db import connection

from refundops.models import RefundTotalDelta

KEEP_DAYS = 3  # a day's totals start at most a day ago (selectors.start_of_day): older buckets are never read

_FOLD_SQL = """
WITH gone AS (
    DELETE FROM {deltas}
     WHERE bucket < now() - make_interval(days => %(keep_days)s)
        OR (currency, agent_id, bucket) IN (SELECT currency, agent_id, bucket FROM {deltas}
                                             WHERE bucket >= now() - make_interval(days => %(keep_days)s)
                                             GROUP BY 1, 2, 3 HAVING count(*) > 1)
    RETURNING currency, agent_id, bucket, amount_minor),
put AS (
    INSERT INTO {deltas} (currency, agent_id, bucket, amount_minor)
    SELECT currency, agent_id, bucket, SUM(amount_minor) FROM gone
     WHERE bucket >= now() - make_interval(days => %(keep_days)s)
     GROUP BY 1, 2, 3
    RETURNING 1)
SELECT (SELECT count(*) FROM gone) - (SELECT count(*) FROM put)
""".format(deltas=RefundTotalDelta._meta.db_table)


def fold_totals() -> int:
    """Each bucket's rows replaced by one, their sum, and the buckets no day reads any more
    dropped, in one statement: a reader sees the rows or their sum, never both, never neither.
    Rows not yet committed are left for the next fold; two folds at once each fold what the other
    did not take. Returns how many rows fewer there are."""
    if connection.vendor != "postgresql":
        return 0  # the embedded SQLite mode keeps no totals: it sums the refunds
    with connection.cursor() as cursor:
        cursor.execute(_FOLD_SQL, {"keep_days": KEEP_DAYS})
        return cursor.fetchone()[0]
