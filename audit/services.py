"""Writing the audit log. Callers pass ids and plain data; nothing here knows the models above."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from django.db import models
from django.utils import timezone

from audit.chain import entry_mac, record_of
from audit.models import AuditEntry, Verdict


def record_audit(*, actor: str, action: str, subject_type: str, subject_id: str,
                 data: dict[str, Any] | None = None, records: Iterable[models.Model] = ()) -> AuditEntry:
    """Append one entry in the caller's transaction (so it commits or rolls back with the act).

    ``records`` are the rows the entry vouches for (a verdict, the history row the act wrote):
    their digests go under the entry's MAC, so a later edit of one fails ``verify_audit``. A
    ``verdict_id`` in ``data`` brings that verdict in unless it is passed. One INSERT and no lock:
    the sealer (Celery beat, ``audit.tasks``) chains the entry within seconds of the commit."""
    entry = new_audit_entry(actor=actor, action=action, subject_type=subject_type, subject_id=subject_id,
                            data=data, records=records)
    entry.save()
    return entry


def new_audit_entry(*, actor: str, action: str, subject_type: str, subject_id: str,
                    data: dict[str, Any] | None = None, records: Iterable[models.Model] = ()) -> AuditEntry:
    """The entry ``record_audit`` appends, MAC and all, not yet saved: for a caller that writes it
    itself (the refund service, with its other writes in one round trip), in the same transaction."""
    rows = list(records)
    verdict_id = (data or {}).get("verdict_id")
    if verdict_id and not any(isinstance(row, Verdict) and row.pk == verdict_id for row in rows):
        rows.extend(Verdict.objects.filter(pk=verdict_id))
    entry = AuditEntry(created_at=timezone.now(), actor=actor, action=action, subject_type=subject_type,
                       subject_id=subject_id, data=data or {}, records=[record_of(row) for row in rows])
    entry.mac = entry_mac(entry)
    return entry
