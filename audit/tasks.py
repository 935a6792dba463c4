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
