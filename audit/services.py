"""Writing the audit log. Callers pass ids and plain data; nothing here knows the models above."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from django.db import connection, transaction
from django.utils import timezone

from audit.models import AuditEntry

GENESIS = "0" * 64
_CHAIN_LOCK_ID = 0x52454655  # "REFU": one advisory lock serialises appends to the chain


def record_audit(*, actor: str, action: str, subject_type: str, subject_id: str,
                 data: dict[str, Any] | None = None) -> AuditEntry:
    """Append one entry in the caller's transaction (so it commits or rolls back with the act)."""
    # No savepoint of its own: an append that fails fails the act it records.
    with transaction.atomic(savepoint=False):
        if connection.vendor == "postgresql":
            with connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_xact_lock(%s)", [_CHAIN_LOCK_ID])
        last = AuditEntry.objects.order_by("-seq").only("seq", "hash").first()
        entry = AuditEntry(
            seq=(last.seq + 1) if last else 1, created_at=timezone.now(), actor=actor, action=action,
            subject_type=subject_type, subject_id=subject_id, data=data or {},
            prev_hash=last.hash if last else GENESIS)
        entry.hash = entry.compute_hash()
        entry.save()
        return entry


def verify_chain(*, batch_size: int = 2000) -> Iterator[tuple[int, AuditEntry | None, str]]:
    """Yield (entries checked so far, first bad entry or None, why). The last item is the verdict."""
    prev_hash = GENESIS
    expected_seq = 1
    checked = 0
    for entry in AuditEntry.objects.order_by("seq").iterator(chunk_size=batch_size):
        if entry.seq != expected_seq:
            yield checked, entry, f"entry #{entry.seq} follows #{expected_seq - 1}: an entry is missing"
            return
        if entry.prev_hash != prev_hash:
            yield checked, entry, f"entry #{entry.seq} does not link to the entry before it"
            return
        if entry.compute_hash() != entry.hash:
            yield checked, entry, f"entry #{entry.seq} was altered after it was written"
            return
        prev_hash = entry.hash
        expected_seq += 1
        checked += 1
        if checked % batch_size == 0:
            yield checked, None, ""
    yield checked, None, "ok"
