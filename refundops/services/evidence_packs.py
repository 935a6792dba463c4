"""The auditors' evidence pack from the admin: an auditor asks for a period (and a merchant), a
Celery task builds it (audit.evidence.build_pack) and reports its progress on the request's row,
and the auditor downloads the ZIP. Each request and each download is an audit entry.

The signing key stays where ``manage.py evidence_pack`` finds it (the ``EVIDENCE_SIGNING_KEY``
path, read by the worker that signs); nothing here hands out more than its public half's
fingerprint, which the auditor compares with the public key they keep.
"""

from __future__ import annotations

import hashlib
import os
import uuid
from datetime import date, timedelta
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from audit.evidence import CONTROLS, build_pack, load_signing_key, period_of_days, public_pem
from audit.models import EvidencePack
from audit.services import record_audit
from refundops import outbox
from refundops.errors import ApiError
from refundops.models import Merchant

BUILD_TASK = "refundops.tasks.build_evidence_pack"
STEPS = len(CONTROLS) + 2  # one per control, the audit chain's segment, and summary.pdf
LONGEST_PERIOD_DAYS = 400  # a year and a bit: an audit period, not the platform's whole life


def pack_path(pack: EvidencePack) -> Path:
    return Path(settings.VAR_DIR) / "evidence-packs" / f"{pack.pk}.zip"


def signing_key_fingerprint() -> str:
    """SHA-256 of the signing key's public half (PEM), or "" when no key is configured or readable."""
    try:
        return hashlib.sha256(public_pem(load_signing_key(settings.EVIDENCE_SIGNING_KEY))).hexdigest()
    except (OSError, ValueError):
        return ""


def request_evidence_pack(*, username: str, first_day: date, last_day: date, merchant_id: str = "") -> EvidencePack:
    """Record the request (audited) and have a worker build it once the request commits."""
    if last_day < first_day:
        raise ApiError("VALIDATION_ERROR", "The last day is before the first.")
    if (last_day - first_day).days >= LONGEST_PERIOD_DAYS:
        raise ApiError("VALIDATION_ERROR", f"A pack covers at most {LONGEST_PERIOD_DAYS} days.")
    try:
        period_of_days(first_day, last_day)
    except ValueError as no_end:
        raise ApiError("VALIDATION_ERROR", f"{no_end}.") from None
    if merchant_id and not Merchant.objects.filter(pk=merchant_id).exists():
        raise ApiError("VALIDATION_ERROR", f"No merchant {merchant_id!r}.")
    if not settings.EVIDENCE_SIGNING_KEY:
        raise ApiError("VALIDATION_ERROR", "No signing key: an operator sets EVIDENCE_SIGNING_KEY.")
    with transaction.atomic():
        pack = EvidencePack.objects.create(requested_by=username, first_day=first_day, last_day=last_day,
                                           merchant_id=merchant_id, steps_total=STEPS)
        record_audit(actor=f"user:{username}", action="evidence_pack.requested", subject_type="evidence_pack",
                     subject_id=pack.pk, data={"from": str(first_day), "to": str(last_day),
                                               "merchant": merchant_id or None})
        outbox.send_after_commit(BUILD_TASK, {"pack_id": pack.pk})
    return pack


# A builder silent this long died (a step is one control's rows: 70 s for a quarter at 200,000 refunds,
# docs/PERFORMANCE.md); its pack shows failed and the task, delivered again, may take it over.
LEASE = timedelta(minutes=30)
ABANDONED = "The worker building this pack stopped before it finished; ask for the pack again."


class _LostClaim(Exception):
    """Another worker took the pack over (this one was silent past the lease): leave it to that one."""


def _stale() -> Q:
    return Q(heartbeat_at__isnull=True) | Q(heartbeat_at__lt=timezone.now() - LEASE)


def abandoned(pack: EvidencePack) -> EvidencePack:
    """``pack``, marked failed if it reads 'building' while its builder has been silent past the lease."""
    if pack.status == EvidencePack.Status.BUILDING and EvidencePack.objects.filter(
            _stale(), pk=pack.pk, status=EvidencePack.Status.BUILDING).update(
            status=EvidencePack.Status.FAILED, error=ABANDONED, finished_at=timezone.now()):
        pack.refresh_from_db()
    return pack


def build_requested_pack(*, pack_id: str) -> EvidencePack:
    """Build a requested pack, writing each step's progress on its row (the page polls it). A second
    run of the task (at-least-once delivery) finds the pack done, or claimed by a worker still alive,
    and does nothing; one whose builder died (or was marked so) it builds."""
    token = uuid.uuid4().hex
    claimable = (Q(status=EvidencePack.Status.QUEUED) | Q(_stale(), status=EvidencePack.Status.BUILDING)
                 | Q(status=EvidencePack.Status.FAILED, error=ABANDONED))
    if not EvidencePack.objects.filter(claimable, pk=pack_id).update(
            status=EvidencePack.Status.BUILDING, builder=token, heartbeat_at=timezone.now(), steps_done=0, error=""):
        return EvidencePack.objects.get(pk=pack_id)
    try:
        return _build(EvidencePack.objects.get(pk=pack_id), token)
    except _LostClaim:
        return EvidencePack.objects.get(pk=pack_id)


def _build(pack: EvidencePack, token: str) -> EvidencePack:
    mine = EvidencePack.objects.filter(pk=pack.pk, builder=token)
    done = {"steps": 0}

    def progress(step: str) -> None:
        if not mine.update(step=step[:100], steps_done=done["steps"], heartbeat_at=timezone.now()):
            raise _LostClaim(pack.pk)
        done["steps"] += 1

    out = pack_path(pack)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f"{out.name}.{token}.part")  # the download's path holds only a whole pack
    period = period_of_days(pack.first_day, pack.last_day)
    try:
        result = build_pack(start=period.start, end=period.end, out=partial,
                            signing_key=load_signing_key(settings.EVIDENCE_SIGNING_KEY),
                            merchant_id=pack.merchant_id or None, progress=progress)
        with transaction.atomic():
            # Only the claim's holder finishes: the row locked, its file moved in, then marked done.
            if not mine.select_for_update().exists():
                raise _LostClaim(pack.pk)
            os.replace(partial, out)
            mine.update(status=EvidencePack.Status.DONE, steps_done=STEPS, step="", size_bytes=out.stat().st_size,
                        manifest_sha256=result.manifest_sha256, exception_count=result.exception_count,
                        finished_at=timezone.now())
            record_audit(actor="system:evidence_pack", action="evidence_pack.built", subject_type="evidence_pack",
                         subject_id=pack.pk, data={"requested_by": pack.requested_by, "from": str(pack.first_day),
                                                   "to": str(pack.last_day), "merchant": pack.merchant_id or None,
                                                   "exceptions": result.exception_count,
                                                   "manifest_sha256": result.manifest_sha256})
    except _LostClaim:
        partial.unlink(missing_ok=True)
        raise
    except Exception as exc:  # the page says what went wrong; the worker's log has the trace
        partial.unlink(missing_ok=True)
        mine.update(status=EvidencePack.Status.FAILED, error=str(exc)[:2000], finished_at=timezone.now())
        raise
    return EvidencePack.objects.get(pk=pack.pk)


def open_for_download(*, pack_id: str, username: str):
    """The built pack's file, opened for reading; the download is audited first."""
    pack = EvidencePack.objects.filter(pk=pack_id, status=EvidencePack.Status.DONE).first()
    if pack is None or not pack_path(pack).exists():
        raise EvidencePack.DoesNotExist(pack_id)
    record_audit(actor=f"user:{username}", action="evidence_pack.downloaded", subject_type="evidence_pack",
                 subject_id=pack.pk, data={"manifest_sha256": pack.manifest_sha256})
    return pack, pack_path(pack).open("rb")
