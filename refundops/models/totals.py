"""The day's totals kept as refunds change, so that a decision reads a few rows, not the day.

Each change to a counting refund (written, its state, amount, currency, agent or ``counted_at``
changed, deleted) appends signed rows here: one for its currency, one for its agent, in the
15-minute bucket (UTC) of its ``counted_at``. A PostgreSQL trigger on ``refundops_refund`` writes
them (migration 0016), so every writer keeps them: the services, the ORM's ``update()``, the admin,
SQL by hand. Rows are only ever inserted by writers, never updated, so writers take no lock on one
another here. ``services.totals.fold_totals`` (beat) replaces the rows of each bucket written to
since by their sum, marked folded, and ``drop_old_totals`` drops the buckets no total reads. The
running totals (refundops/selectors.py) read the buckets of the day and of the last hour (and sum
the refunds of the minutes before the first of each); PostgreSQL only (the embedded SQLite mode
sums the refunds)."""

from __future__ import annotations

from django.db import models
from django.db.models import Q

BUCKET_SECONDS = 900  # every UTC offset in use is a whole number of quarter hours


class RefundTotalDelta(models.Model):
    id = models.BigAutoField(primary_key=True)
    currency = models.CharField(max_length=3)
    agent_id = models.CharField(max_length=40, blank=True)  # "": every refund in the currency
    bucket = models.DateTimeField()  # the start of the 15 minutes its refunds were counted in
    amount_minor = models.BigIntegerField()  # signed: a refund that stops counting takes its amount back
    # A bucket's sum written by the fold (or the rebuild); the trigger's rows are not (the database's
    # default): the fold finds the buckets to fold through the index of these alone.
    folded = models.BooleanField(db_default=False)

    class Meta:
        indexes = [models.Index(fields=["currency", "agent_id", "bucket"], name="refund_total_bucket"),
                   models.Index(fields=["currency", "agent_id", "bucket"], condition=Q(folded=False),
                                name="refund_total_unfolded")]
