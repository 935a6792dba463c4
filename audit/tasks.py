"""Sealing the audit chain: Celery beat runs this every AUDIT_SEAL_INTERVAL_SECONDS.

Periodic only, with no per-request nudge: a nudge would add an on-commit callback (and a broker
call) to every audited transaction, for a second or two less wait before an entry is sealed;
an entry not yet sealed is already covered by its MAC, and ``audit_head`` seals before it prints.
Each round first covers the verdicts written since the last (audit.chain.chain_verdicts)."""

from __future__ import annotations

from celery import shared_task

from audit.chain import seal


@shared_task(ignore_result=True)
def seal_audit_log() -> int:
    return seal()


@shared_task(ignore_result=True)
def run_revocation_drill() -> bool:
    """Beat runs it every REVOCATION_DRILL_INTERVAL_HOURS when set (off by default); the result is an
    audit entry, read by the evidence pack."""
    from refundops.services.revocation_drill import run_drill  # the drill drives the API: above audit
    return run_drill().passed
