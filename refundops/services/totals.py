"""Keeping the day's totals (refundops/models/totals.py) small and right: the fold (each bucket's rows
replaced by their sum), the rebuild after a load the trigger did not see, and loaded dumps."""

from __future__ import annotations

import math
from datetime import datetime, timedelta

from django.db import connection, transaction
from django.db.models.signals import post_save, pre_save
from django.dispatch import receiver
from django.utils import timezone

from refundops.locks import advisory_key
from refundops.models import COUNTING_STATES, Refund, RefundTotalDelta

FOLD_LOCK_KEY = advisory_key("fold-refund-totals")
KEEP_DAYS = 3  # a day's totals start at most a local day (25 h on a daylight-saving night) ago: older buckets are never read

# The buckets written to since they were last folded (found through the index of unfolded rows: the
# cost follows the refunds since the last fold, not the rows kept), each replaced by one row, its sum.
_FOLD_SQL = """
WITH todo AS (
    SELECT DISTINCT currency, agent_id, bucket FROM {deltas} WHERE NOT folded),
gone AS (
    DELETE FROM {deltas} d USING todo
     WHERE (d.currency, d.agent_id, d.bucket) = (todo.currency, todo.agent_id, todo.bucket)
    RETURNING d.currency, d.agent_id, d.bucket, d.amount_minor),
put AS (
    INSERT INTO {deltas} (currency, agent_id, bucket, amount_minor, folded)
    SELECT currency, agent_id, bucket, SUM(amount_minor), true FROM gone GROUP BY 1, 2, 3
    RETURNING 1)
SELECT (SELECT count(*) FROM gone) - (SELECT count(*) FROM put)
""".format(deltas=RefundTotalDelta._meta.db_table)

_DROP_OLD_SQL = """
DELETE FROM {deltas} WHERE bucket < %(since)s
""".format(deltas=RefundTotalDelta._meta.db_table)


# Every counting refund of the days a day's totals can read, summed per bucket: the rows the trigger
# would have appended, folded (migration 0016 runs the same when it starts keeping them).
_REBUILD_SQL = """
INSERT INTO {deltas} (currency, agent_id, bucket, amount_minor, folded)
SELECT currency, scope, refundops_total_bucket(counted_at), SUM(amount_minor), true
  FROM {refund}, unnest(ARRAY['', agent_id]) AS scope
 WHERE status = ANY(%(states)s) AND scope IS NOT NULL AND counted_at >= %(since)s
 GROUP BY 1, 2, 3
""".format(deltas=RefundTotalDelta._meta.db_table, refund=Refund._meta.db_table)


def _kept_since() -> datetime:
    """The oldest instant a kept bucket is read for, by the clock the decisions' windows are read by
    (selectors.limit_windows: the application's, not the database's ``now()``), with room to spare."""
    return timezone.now() - timedelta(days=KEEP_DAYS)


def fold_totals() -> int:
    """The rows of each bucket written to since the last fold replaced by one, their sum, in one
    statement: a reader sees the rows or their sum, never both, never neither.
    Rows not yet committed are left for the next fold. One fold at a time: a second one finds the
    lock taken and leaves the work to the next (two could lock the same rows in another order and
    deadlock). Returns how many rows fewer there are."""
    if connection.vendor != "postgresql":
        return 0  # the embedded SQLite mode keeps no totals: it sums the refunds
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SELECT pg_try_advisory_xact_lock(%s)", [FOLD_LOCK_KEY])
        if not cursor.fetchone()[0]:
            return 0
        cursor.execute(_FOLD_SQL)
        return cursor.fetchone()[0]


def drop_old_totals() -> int:
    """The buckets older than ``KEEP_DAYS`` deleted, folded or not (beat, hourly): no total reads
    them. Apart from the fold, which then reads only what was written since the last one. Returns
    how many rows it deleted."""
    if connection.vendor != "postgresql":
        return 0
    with connection.cursor() as cursor:
        cursor.execute(_DROP_OLD_SQL, {"since": _kept_since()})
        return cursor.rowcount


def rebuild_totals(*, lock_timeout_ms: float = 5_000) -> int:
    """The kept totals made again from the refunds, for a load that bypassed the trigger (a restore
    with triggers disabled, ``session_replication_role = replica``). Refund writers wait until it
    commits (the lock), readers do not; a fold under way is waited for and none starts until it
    commits (the fold's lock). It waits at most ``lock_timeout_ms`` for each lock, then raises
    (``LockNotAvailable``) having changed nothing: a long transaction writing refunds would otherwise
    hold every new refund behind this one's queued lock. Returns how many rows it wrote."""
    if connection.vendor != "postgresql":
        return 0
    with transaction.atomic(), connection.cursor() as cursor:
        # At least 1 ms: PostgreSQL reads a lock_timeout of 0 as none (wait for ever), the opposite of
        # "--lock-timeout 0" (or under a millisecond, made 0 ms).
        cursor.execute("SELECT set_config('lock_timeout', %s, true)", [f"{max(1, math.ceil(lock_timeout_ms))}ms"])
        # The fold's lock, waited for: a fold (or another rebuild) under way deletes rows and inserts
        # their sum; this DELETE would skip the rows it deleted and never see the sum (not in its
        # snapshot), which would stay next to the rows rebuilt here: each refund counted twice.
        # Taken first, while this holds nothing (a fold never waits for the refunds' lock).
        cursor.execute("SELECT pg_advisory_xact_lock(%s)", [FOLD_LOCK_KEY])
        cursor.execute(f"LOCK TABLE {Refund._meta.db_table} IN SHARE MODE")
        cursor.execute(f"DELETE FROM {RefundTotalDelta._meta.db_table}")
        cursor.execute(_REBUILD_SQL, {"states": [str(s) for s in COUNTING_STATES], "since": _kept_since()})
        return cursor.rowcount


# ``loaddata`` (raw) of a dump that carries the kept totals: the trigger has appended the loaded
# refunds' rows already, so the dumped ones would count every refund twice. Each is written as a new
# row (its dumped id may be a live row's here) and deleted at once.
@receiver(pre_save, sender=RefundTotalDelta, dispatch_uid="a_loaded_delta_is_a_new_row")
def _load_a_delta_as_a_new_row(sender, instance: RefundTotalDelta, raw: bool, **kwargs) -> None:
    if raw:
        instance.pk = None


@receiver(post_save, sender=RefundTotalDelta, dispatch_uid="a_loaded_delta_is_dropped")
def _drop_a_loaded_delta(sender, instance: RefundTotalDelta, raw: bool, using: str, **kwargs) -> None:
    if raw:  # in the database it was loaded into (``loaddata --database``), not the default one
        RefundTotalDelta.objects.using(using).filter(pk=instance.pk).delete()
