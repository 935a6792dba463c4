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

import functools
import hashlib
import hmac
import json
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, time, timedelta
from decimal import Decimal
from typing import Any
from uuid import UUID

from django.apps import apps
from django.conf import settings
from django.db import connection, models, transaction
from django.db.models import Count
from django.utils import timezone

from audit.models import AuditEntry, Verdict

log = logging.getLogger("refundops.audit")

GENESIS = "0" * 64
VERDICTS_CHAINED = "verdicts.chained"
_CHAIN_LOCK_ID = 0x52454655  # "REFU": held by the sealer only, never by a request


_AS_IS = frozenset({str, int, bool})


def _plain(value: Any) -> Any:
    """One spelling per value, whether it comes from memory or back from the database (jsonb
    gives 1e2 back as 100, a datetime comes back in UTC, a Decimal with its field's places)."""
    if value is None or type(value) in _AS_IS:  # most values: spelled as they are (not a subclass)
        return value
    if isinstance(value, dict):  # a plain value inside is kept without a call (most of a verdict's)
        return {k if type(k) is str else str(k): v if v is None or type(v) in _AS_IS else _plain(v)
                for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [v if v is None or type(v) in _AS_IS else _plain(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat()
    if isinstance(value, Decimal):
        return format(value.normalize(), "f")
    if isinstance(value, date | time):
        return value.isoformat()
    if isinstance(value, UUID):
        return str(value)
    if isinstance(value, bytes | memoryview):
        return bytes(value).hex()
    return value


# What json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False) builds on each
# call, built once: verify_audit spells millions of values.
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def canonical(value: Any) -> bytes:
    return _CANONICAL.encode(_plain(value)).encode()


@functools.lru_cache(maxsize=4)
def _keyed(key: str) -> hmac.HMAC:
    """HMAC-SHA256 with the key already absorbed; ``.copy()`` it per message (a third of the cost)."""
    return hmac.new(key.encode(), digestmod=hashlib.sha256)


def _hmac(message: bytes) -> str:
    keyed = _keyed(settings.AUDIT_KEY).copy()
    keyed.update(message)
    return keyed.hexdigest()


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
    return hashlib.sha256(canonical({"model": label, "fields": dict(zip(names, values, strict=True))})).hexdigest()


def record_of(row: models.Model) -> dict[str, Any]:
    if row.pk is None:
        raise ValueError(f"an audit entry records saved rows only; this {row._meta.label} has no pk")
    return {"model": row._meta.label_lower, "pk": row.pk, "digest": row_digest(row)}


def entry_mac(entry: AuditEntry) -> str:
    return _entry_mac(entry.uid, entry.created_at, entry.actor, entry.action, entry.subject_type, entry.subject_id,
                      entry.data, entry.records)


def _entry_mac(uid, created_at, actor, action, subject_type, subject_id, data, records) -> str:
    return _mac({"uid": uid, "created_at": created_at, "actor": actor, "action": action,
                 "subject_type": subject_type, "subject_id": subject_id, "data": data, "records": records})


def link_hash(entry: AuditEntry) -> str:
    return _link_hash(entry.seq, entry.prev_hash, entry.pk, entry.mac)


def _link_hash(seq: int, prev_hash: str, pk: int, mac: str) -> str:
    return _mac({"seq": seq, "prev_hash": prev_hash, "id": pk, "mac": mac})


@dataclass(frozen=True)
class Head:
    """The last sealed entry, ``SEQ:HASH``: what an operator keeps outside the database."""

    seq: int
    hash: str

    @classmethod
    def parse(cls, text: str) -> Head:
        seq, _, digest = text.strip().partition(":")
        if not seq.isdigit() or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError(f"expected SEQ:HASH as printed by `manage.py audit_head`, got {text.strip()!r}")
        return cls(int(seq), digest)

    def __str__(self) -> str:
        return f"{self.seq}:{self.hash}"


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


def _records_fault(chunk: Sequence[tuple]) -> tuple[int, str] | None:
    """The first entry of ``chunk`` (rows of ``_ENTRY_COLUMNS``) whose recorded rows are gone or
    differ: its index and why. The rows are read as values, one query per model, per chunk."""
    wanted: dict[str, set[Any]] = {}
    for row in chunk:
        for record in row[_RECORDS]:
            wanted.setdefault(record["model"], set()).add(record["pk"])
    digests: dict[tuple[str, Any], str] = {}
    for label, pks in wanted.items():
        try:
            model = apps.get_model(label)
        except LookupError:
            continue  # reported per entry below
        names = sealed_fields(model)
        for pk, *values in model._base_manager.filter(pk__in=pks).values_list("pk", *names):
            digests[label, pk] = values_digest(model._meta.label_lower, names, values)
    for index, row in enumerate(chunk):
        for record in row[_RECORDS]:
            try:
                name = apps.get_model(record["model"])._meta.verbose_name
            except LookupError:
                return index, f"it records a row of {record['model']}, a model this install does not have"
            digest = digests.get((record["model"], record["pk"]))
            if digest is None:
                return index, f"the {name} {record['pk']} it records is missing"
            if not hmac.compare_digest(digest, record["digest"]):
                return index, f"the {name} {record['pk']} it records was altered"
    return None


# An entry as verify_chain reads it: values, not a model instance (building one costs more than its MAC).
_ENTRY_COLUMNS = ("pk", "seq", "uid", "created_at", "actor", "action", "subject_type", "subject_id", "data",
                  "records", "mac", "prev_hash", "hash")
_RECORDS = _ENTRY_COLUMNS.index("records")


def _first_broken_link(chunk: Sequence[tuple], *, prev_hash: str, expected: int,
                       head: Head | None) -> tuple[int, str]:
    """How many entries of ``chunk`` verify, in order, and why the next one does not ("" if all do)."""
    for index, (pk, seq, uid, created_at, actor, action, subject_type, subject_id, data, records, mac, prev,
                digest) in enumerate(chunk):
        if seq != expected + index:
            return index, f"entry #{seq} follows #{expected + index - 1}: an entry is missing"
        if not hmac.compare_digest(mac, _entry_mac(uid, created_at, actor, action, subject_type, subject_id,
                                                   data, records)):
            return index, f"entry #{seq} was altered after it was written"
        # mac matched a hex digest and prev is the hash verified before it (or GENESIS): both hex, so
        # this is canonical()'s spelling of _link_hash's dict, without its walk over the values.
        if prev != prev_hash or not hmac.compare_digest(digest, _hmac(
                f'{{"id":{pk:d},"mac":"{mac}","prev_hash":"{prev}","seq":{seq:d}}}'.encode())):
            return index, f"entry #{seq} does not link to the entry before it"
        if head is not None and seq == head.seq and digest != head.hash:
            return index, f"entry #{seq} does not match the head kept outside the database ({head})"
        prev_hash = digest
    return len(chunk), ""


def verify_chain(*, batch_size: int = 5000, progress_every: int | None = None, head: Head | None = None,
                 now: datetime | None = None) -> Iterator[tuple[int, AuditEntry | None, str]]:
    """Yield (sealed entries checked so far, first bad entry or None, why): progress items carry an
    empty why, one for each ``progress_every`` entries (at the end of the chunk that reaches it;
    without it, one a chunk); the last item says "ok" or what is wrong. With ``head`` (exported
    earlier), a chain that stops short of it, or differs at it, fails.

    The chain is read ``batch_size`` entries at a time by keyset on ``seq`` (one bounded query a
    chunk, on its unique index), with the rows the chunk's entries record (one query per model):
    memory is bounded by the chunk, whatever the chain's length or the progress asked for."""
    prev_hash, checked, reported = GENESIS, 0, 0
    sealed = AuditEntry.objects.filter(seq__isnull=False).order_by("seq").values_list(*_ENTRY_COLUMNS)
    chunk: list[tuple] = []
    while True:
        chunk = list(sealed.filter(seq__gt=chunk[-1][1])[:batch_size] if chunk else sealed[:batch_size])
        if not chunk:
            break
        verified, why = _first_broken_link(chunk, prev_hash=prev_hash, expected=checked + 1, head=head)
        if fault := _records_fault(chunk[:verified]):  # an earlier entry's recorded row is the first fault
            index, why = fault
            yield checked + index, _entry(chunk[index]), why
            return
        if why:
            yield checked + verified, _entry(chunk[verified]), why
            return
        checked, prev_hash = checked + len(chunk), chunk[-1][-1]
        if progress_every is None:
            yield checked, None, ""
        else:
            while reported + progress_every <= checked:
                reported += progress_every
                yield reported, None, ""
        if len(chunk) < batch_size:
            break
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


def _verdicts_fault(*, now: datetime | None = None) -> str:
    """What is wrong with the verdicts' cover, or "": each entry's count (under its MAC) against
    the verdicts marked with its uid, and verdicts left uncovered past the grace. (The digests of
    the verdicts each entry records are checked with the chain.)"""
    recorded = dict(AuditEntry.objects.filter(action=VERDICTS_CHAINED).values_list("uid", "data__count"))
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
