"""The audit chain: keyed entries, sealed in order off the request's lock path, verified against a
head kept outside the database.

A request appends an entry with ``mac`` = HMAC-SHA256(AUDIT_KEY, its content and the digests of
the verdicts and history rows it records) and takes no lock. The sealer, one at a time under an
advisory lock, gives each committed entry the next ``seq`` and links it to the entry before:
``hash`` = HMAC(AUDIT_KEY, seq, prev_hash, id, mac). It seals in id order, round by round, so an
entry always comes after every entry its transaction could have seen (ids are drawn at insert;
only unrelated, concurrent transactions may land in another order than they committed).

Without the key no one can forge an entry, re-hash an edit forward or re-link a reordered chain;
``audit_head`` exported outside the database catches a deleted tail or an emptied table. An entry
not yet sealed is covered by its MAC; only deleting it before the sealer runs (seconds) goes
unseen, and PostgreSQL refuses that DELETE to anyone short of the table's owner.

Every verdict is covered too, also those no act's entry records (a dry run, a refusal before any
refund row, a replay): the sealer first writes one ``verdicts.chained`` entry recording each
committed verdict not yet covered (its digest under the entry's MAC) and marks those verdicts with
the entry's uid. Nothing is added to a decision's own statements. ``verify_audit`` then fails on a
covered verdict edited or deleted (the entry's digest), on marks that disagree with the entries'
counts (a verdict marked covered that no entry records), and on verdicts left uncovered past the
grace; deleting a verdict in the seconds before the sealer runs is the one act left unseen, as
for an entry.

Our own code, not a library's: no maintained package keys and seals an append-only Django table
(django-pghistory records changes; it neither keys nor chains them).
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import re
from collections.abc import Iterator, Sequence
from datetime import datetime, timedelta
from typing import Any

from django.apps import apps
from django.conf import settings
from django.db import connection, models, transaction
from django.db.models import Count
from django.db.models.expressions import RawSQL
from django.utils import timezone

from audit import walk
from audit.models import AuditEntry, Verdict
from audit.walk import GENESIS, Head

log = logging.getLogger("refundops.audit")

VERDICTS_CHAINED = "verdicts.chained"
_CHAIN_LOCK_ID = 0x52454655  # "REFU": held by the sealer only, never by a request


def canonical(value: Any) -> bytes:
    return walk.canonical(value)


def _hmac(message: bytes) -> str:
    return walk.keyed_hmac(settings.AUDIT_KEY, message)


def _mac(value: Any) -> str:
    return _hmac(canonical(value))


def sealed_fields(model: type[models.Model]) -> list[str]:
    """The columns of ``model`` a record's digest covers, in the model's order."""
    skip = set(getattr(model, "UNSEALED_FIELDS", ()))
    return [f.attname for f in model._meta.concrete_fields if f.name not in skip]


def row_digest(row: models.Model) -> str:
    """SHA-256 of a recorded row (a verdict, a history row) as stored; the entry's MAC covers it."""
    names = sealed_fields(type(row))
    return values_digest(row._meta.label_lower, names, [getattr(row, name) for name in names])


def values_digest(label: str, names: Sequence[str], values: Sequence[Any]) -> str:
    """``row_digest`` of a row read as values (``values_list(*sealed_fields(model))``), no instance built."""
    return walk.values_digest(label, names, values)


def record_of(row: models.Model) -> dict[str, Any]:
    if row.pk is None:
        raise ValueError(f"an audit entry records saved rows only; this {row._meta.label} has no pk")
    return {"model": row._meta.label_lower, "pk": row.pk, "digest": row_digest(row)}


def entry_mac(entry: AuditEntry) -> str:
    return _entry_mac(entry.uid, entry.created_at, entry.actor, entry.action, entry.subject_type, entry.subject_id,
                      entry.data, entry.records)


def _entry_mac(uid, created_at, actor, action, subject_type, subject_id, data, records) -> str:
    return walk.entry_mac_of(settings.AUDIT_KEY, uid, created_at, actor, action, subject_type, subject_id, data,
                             records)


def link_hash(entry: AuditEntry) -> str:
    return _link_hash(entry.seq, entry.prev_hash, entry.pk, entry.mac)


def _link_hash(seq: int, prev_hash: str, pk: int, mac: str) -> str:
    return _mac({"seq": seq, "prev_hash": prev_hash, "id": pk, "mac": mac})


def chain_head() -> Head:
    last = AuditEntry.objects.filter(seq__isnull=False).order_by("-seq").values_list("seq", "hash").first()
    return Head(*last) if last else Head(0, GENESIS)


def _chain_lock() -> None:
    if connection.vendor == "postgresql":  # SQLite's IMMEDIATE transactions serialise sealers already
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [_CHAIN_LOCK_ID])


def chain_verdicts(*, batch_size: int = 500) -> int:
    """Record every committed verdict not yet covered in a ``verdicts.chained`` entry (one per
    ``batch_size``) and mark each with that entry's uid; return how many were covered. The entries
    are sealed like any other by ``seal_pending``, which runs next."""
    covered = 0
    while True:
        with transaction.atomic():
            _chain_lock()
            batch = list(Verdict.objects.filter(chained_by__isnull=True).order_by("pk")[:batch_size])
            if not batch:
                return covered
            entry = AuditEntry(created_at=timezone.now(), actor="system:sealer", action=VERDICTS_CHAINED,
                               subject_type="verdicts", subject_id=f"{batch[0].pk}..{batch[-1].pk}"[:60],
                               data={"count": len(batch)}, records=[record_of(v) for v in batch])
            entry.mac = entry_mac(entry)
            entry.save()
            Verdict.objects.filter(pk__in=[v.pk for v in batch]).update(chained_by=entry.uid)
        covered += len(batch)
        if len(batch) < batch_size:
            return covered


def seal(*, batch_size: int = 500) -> int:
    """What the sealer does each round: cover the new verdicts, then seal every pending entry."""
    chain_verdicts(batch_size=batch_size)
    return seal_pending(batch_size=batch_size)


def seal_pending(*, batch_size: int = 500) -> int:
    """Chain every committed entry not yet sealed; return how many were sealed. An entry whose MAC
    does not verify (edited, or inserted without the key) is left out and logged; verify names it."""
    sealed, after = 0, 0
    while True:
        with transaction.atomic():
            _chain_lock()
            head = chain_head()
            batch = list(AuditEntry.objects.filter(seq__isnull=True, pk__gt=after).order_by("pk")[:batch_size])
            seq, prev, now, links = head.seq, head.hash, timezone.now(), []
            for entry in batch:
                if not hmac.compare_digest(entry.mac, entry_mac(entry)):
                    log.error("audit entry id %s does not verify; left unsealed (altered or forged)", entry.pk)
                    continue
                seq += 1
                entry.seq, entry.prev_hash, entry.sealed_at = seq, prev, now
                entry.hash = prev = link_hash(entry)
                links.append(entry)
            if links:  # one statement: Django's bulk_update spends ~1 ms a row building CASE expressions
                rows = ", ".join(["(%s, %s, %s, %s)"] * len(links))
                with connection.cursor() as cursor:
                    cursor.execute(
                        f"WITH v (id, seq, prev_hash, hash) AS (VALUES {rows}) "
                        f"UPDATE {AuditEntry._meta.db_table} SET seq = v.seq, prev_hash = v.prev_hash, "
                        f"hash = v.hash, sealed_at = %s FROM v WHERE {AuditEntry._meta.db_table}.id = v.id",
                        [*(x for e in links for x in (e.pk, e.seq, e.prev_hash, e.hash)), now])
        sealed += len(links)
        if len(batch) < batch_size:
            return sealed
        after = batch[-1].pk


def overdue(*, now: datetime | None = None) -> list[AuditEntry]:
    """Entries still unsealed AUDIT_SEAL_GRACE_SECONDS after they were written, oldest first."""
    cutoff = (now or timezone.now()) - timedelta(seconds=settings.AUDIT_SEAL_GRACE_SECONDS)
    return list(AuditEntry.objects.filter(seq__isnull=True, created_at__lt=cutoff).order_by("pk"))


def _verbose_name(label: str) -> str | None:
    try:
        return apps.get_model(label)._meta.verbose_name
    except LookupError:
        return None


def _records_fault(chunk: Sequence[tuple]) -> tuple[int, str] | None:
    """The first entry of ``chunk`` (rows of ``_ENTRY_COLUMNS``) whose recorded rows are gone or
    differ: its index and why. The rows are read as values, a query per model and RECORDS_BATCH rows."""
    digests: dict[tuple[str, Any], str] = {}
    for label, pks in walk.wanted_records(chunk).items():
        try:
            model = apps.get_model(label)
        except LookupError:
            continue  # reported per entry below
        names = sealed_fields(model)
        for batch in walk.batches(pks):
            for pk, *values in model._base_manager.filter(pk__in=batch).values_list("pk", *names):
                digests[label, pk] = values_digest(model._meta.label_lower, names, values)
    return walk.first_records_fault(chunk, digests, _verbose_name)


# An entry as verify_chain reads it: values, not a model instance (building one costs more than its MAC).
_ENTRY_COLUMNS = walk.ENTRY_COLUMNS


class _Progress:
    """verify_chain's progress items: one each ``every`` entries (at the end of the chunk that
    reaches it), or one a chunk without ``every``."""

    def __init__(self, every: int | None):
        self.every, self.reported = every, 0

    def at(self, checked: int) -> Iterator[tuple[int, None, str]]:
        if self.every is None:
            yield checked, None, ""
            return
        while self.reported + self.every <= checked:
            self.reported += self.every
            yield self.reported, None, ""


def _walk(*, batch_size: int, progress: _Progress, head: Head | None, prev_hash: str = GENESIS, checked: int = 0,
          after: int | None = None) -> Iterator[tuple[int, AuditEntry | None, str]]:
    """Check the sealed entries after seq ``after`` (all of them without), in this process, the
    ``checked`` entries before them verified and the last one's hash ``prev_hash``. Yields progress,
    then the failure if there is one; returns how many entries verified in all, or None on a failure."""
    sealed = AuditEntry.objects.filter(seq__isnull=False).order_by("seq").values_list(*_ENTRY_COLUMNS)
    if after is not None:
        sealed = sealed.filter(seq__gt=after)
    chunk: list[tuple] = []
    while True:
        start = chunk[-1][1] if chunk else after
        end = RawSQL(_chunk_end_sql(start is not None), [*([] if start is None else [start]), batch_size,
                                                         walk.RECORDS_BATCH])
        chunk = list((sealed.filter(seq__gt=start) if chunk else sealed).filter(seq__lt=end)[:batch_size])
        if not chunk:
            break
        verified, why = walk.first_broken_link(chunk, key=settings.AUDIT_KEY, prev_hash=prev_hash,
                                               expected=checked + 1, head=head)
        if fault := _records_fault(chunk[:verified]):  # an earlier entry's recorded row is the first fault
            index, why = fault
            yield checked + index, _entry(chunk[index]), why
            return None
        if why:
            yield checked + verified, _entry(chunk[verified]), why
            return None
        checked, prev_hash = checked + len(chunk), chunk[-1][-1]
        yield from progress.at(checked)
        if walk.chunk_is_last(chunk, batch_size, walk.RECORDS_BATCH):
            break
    return checked


def _chunk_end_sql(after: bool) -> str:
    """walk.chunk_end_sql for this database: a bound on the next chunk's seq, so its rows recorded are too."""
    quote, fields = connection.ops.quote_name, {f.name: f.column for f in AuditEntry._meta.concrete_fields}
    return walk.chunk_end_sql(connection.vendor, table=quote(AuditEntry._meta.db_table), seq=quote(fields["seq"]),
                              records=quote(fields["records"]), after="%s" if after else None, limit="%s",
                              most="%s")


def verify_chain(*, batch_size: int = 5000, progress_every: int | None = None, head: Head | None = None,
                 now: datetime | None = None, processes: int = 1,
                 snapshot: str | None = None) -> Iterator[tuple[int, AuditEntry | None, str]]:
    """Yield (sealed entries checked so far, first bad entry or None, why): progress items carry an
    empty why, one for each ``progress_every`` entries (at the end of the chunk that reaches it;
    without it, one a chunk); the last item says "ok" or what is wrong. With ``head`` (exported
    earlier), a chain that stops short of it, or differs at it, fails.

    The chain is read ``batch_size`` entries at a time by keyset on ``seq`` (one bounded query a
    chunk, on its unique index), with the rows the chunk's entries record (one query per model):
    memory is bounded by the chunk, whatever the chain's length or the progress asked for.

    With ``processes`` > 1 (PostgreSQL, a chain of at least ``parallel.MIN_ENTRIES``, outside a
    transaction: the other processes read what is committed), the chain is split into that many
    ranges of seq, each checked by its own process (``audit.verify_worker``, the same checks of
    ``audit.walk``); the results are put together in chain order, so the failure named is the one
    a single process names (``audit.parallel``).

    With ``snapshot`` (an id of ``pg_export_snapshot``, its exporter's transaction still open), every
    read, in this process and in the others, is of that snapshot: the evidence pack's walk judges the
    very rows its CSV lists, not the table a moment later."""
    from audit import parallel

    in_parallel = parallel.usable(processes)  # before the snapshot's transaction, which other processes share
    if snapshot is None:
        return (yield from _verify(batch_size=batch_size, progress=_Progress(progress_every), head=head, now=now,
                                   processes=processes if in_parallel else 1, snapshot=None))
    with read_only_snapshot(snapshot):
        yield from _verify(batch_size=batch_size, progress=_Progress(progress_every), head=head, now=now,
                           processes=processes if in_parallel else 1, snapshot=snapshot)


@contextlib.contextmanager
def read_only_snapshot(snapshot: str | None = None) -> Iterator[None]:
    """A read-only REPEATABLE READ transaction on this connection (PostgreSQL): every read in it sees one
    moment; with ``snapshot`` (a ``pg_export_snapshot`` id) the moment another transaction exported."""
    with transaction.atomic(), connection.cursor() as cursor:
        cursor.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
        if snapshot is not None:
            cursor.execute(f"SET TRANSACTION SNAPSHOT '{check_snapshot_id(snapshot)}'")
        yield


def check_snapshot_id(snapshot: str) -> str:
    """A snapshot id as pg_export_snapshot spells it (it is spelled into SET TRANSACTION SNAPSHOT)."""
    if not re.fullmatch(r"[0-9A-F-]+", snapshot):
        raise ValueError(f"unexpected snapshot id {snapshot!r}")
    return snapshot


def _verify(*, batch_size: int, progress: _Progress, head: Head | None, now: datetime | None, processes: int,
            snapshot: str | None) -> Iterator[tuple[int, AuditEntry | None, str]]:
    from audit import parallel

    if processes > 1:
        checked = yield from parallel.walk(processes=processes, batch_size=batch_size, progress=progress, head=head,
                                           snapshot=snapshot)
    else:
        checked = yield from _walk(batch_size=batch_size, progress=progress, head=head)
    if checked is None:
        return
    if head is not None and checked < head.seq:
        missing = f"entry #{head.seq} is" if checked + 1 == head.seq else f"entries #{checked + 1} to #{head.seq} are"
        yield checked, None, (f"the chain ends at #{checked} but the head kept outside the database is "
                              f"#{head.seq}: {missing} missing")
        return
    for entry in AuditEntry.objects.filter(seq__isnull=True).order_by("pk").iterator(chunk_size=batch_size):
        if not hmac.compare_digest(entry.mac, entry_mac(entry)):
            yield checked, entry, "it was altered or forged before it was sealed"
            return
    if late := overdue(now=now):
        yield checked, late[0], (f"{len(late)} {'entry' if len(late) == 1 else 'entries'} not sealed within "
                                 f"{settings.AUDIT_SEAL_GRACE_SECONDS} s of being written; is the sealer "
                                 f"(Celery beat, audit.tasks.seal_audit_log) running?")
        return
    if why := _verdicts_fault(now=now):
        yield checked, None, why
        return
    yield checked, None, "ok"


def _entry(row: tuple) -> AuditEntry:
    """The entry a failure names, as a model (one query, only when something is wrong)."""
    return AuditEntry.objects.get(pk=row[0])


def _chained_counts() -> dict:
    """Each verdicts.chained entry's uid and the count under its MAC."""
    return dict(AuditEntry.objects.filter(action=VERDICTS_CHAINED).values_list("uid", "data__count"))


def _verdicts_fault(*, now: datetime | None = None) -> str:
    """What is wrong with the verdicts' cover, or "": each entry's count (under its MAC) against
    the verdicts marked with its uid, and verdicts left uncovered past the grace. (The digests of
    the verdicts each entry records are checked with the chain.) The entries and the marks are read
    in one snapshot: the sealer writes an entry and its marks in one transaction, and one committed
    between two reads made a good chain fail."""
    if connection.in_atomic_block or connection.vendor != "postgresql":  # a snapshot already, or SQLite's lock
        return _cover_fault(now=now)
    with read_only_snapshot():
        return _cover_fault(now=now)


def _cover_fault(*, now: datetime | None) -> str:
    recorded = _chained_counts()
    marked = dict(Verdict.objects.filter(chained_by__isnull=False).order_by().values("chained_by")
                  .annotate(n=Count("pk")).values_list("chained_by", "n"))
    for uid, count in recorded.items():
        if marked.get(uid, 0) != count:
            entry = AuditEntry.objects.get(uid=uid)
            where = f"#{entry.seq}" if entry.seq is not None else f"id {entry.pk} (unsealed)"
            n = marked.get(uid, 0)
            return (f"{n} {'verdict says it is' if n == 1 else 'verdicts say they are'} covered by audit entry "
                    f"{where}, which records {count}: a verdict was marked or unmarked by hand")
    if orphans := sum(n for uid, n in marked.items() if uid not in recorded):
        return (f"{orphans} {'verdict says it is' if orphans == 1 else 'verdicts say they are'} covered by an "
                f"audit entry that does not exist")
    cutoff = (now or timezone.now()) - timedelta(seconds=settings.AUDIT_SEAL_GRACE_SECONDS)
    if late := Verdict.objects.filter(chained_by__isnull=True, created_at__lt=cutoff).count():
        return (f"{late} {'verdict' if late == 1 else 'verdicts'} not covered by the chain within "
                f"{settings.AUDIT_SEAL_GRACE_SECONDS} s of being written; is the sealer (Celery beat, "
                f"audit.tasks.seal_audit_log) running?")
    return ""
