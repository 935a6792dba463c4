"""The gateways' books against ours. Every difference is raised to a person and stays open until
they resolve it; a payment with an open difference takes no agent refund unheld."""

from __future__ import annotations

import logging
from typing import Any

from django.db import transaction

from audit.services import record_audit
from refundops.models import LedgerDiscrepancy, Payment, Refund

log = logging.getLogger(__name__)


@transaction.atomic
def raise_discrepancy(*, payment: Payment, kind: str, actor: str, refund: Refund | None = None,
                      gateway_reference: str = "", ours: dict[str, Any] | None = None,
                      theirs: dict[str, Any] | None = None, detail: str = "") -> LedgerDiscrepancy:
    """Record one difference (once while it is open: found again, it is the same row), audit it and
    alert. Callers hold whatever lock their own writes need; this takes none of its own."""
    existing = LedgerDiscrepancy.objects.filter(payment=payment, kind=kind, gateway_reference=gateway_reference,
                                                status=LedgerDiscrepancy.Status.OPEN).first()
    if existing is not None:
        existing.theirs, existing.ours = theirs or existing.theirs, ours or existing.ours
        existing.save(update_fields=["theirs", "ours", "last_seen_at"])
        return existing
    discrepancy = LedgerDiscrepancy.objects.create(
        payment=payment, refund=refund, kind=kind, gateway=payment.processor, account=payment.processor_account,
        gateway_reference=gateway_reference, ours=ours or {}, theirs=theirs or {}, detail=detail)
    record_audit(actor=actor, action="ledger.discrepancy", subject_type="payment", subject_id=payment.pk,
                 data={"discrepancy_id": discrepancy.pk, "kind": kind, "refund_id": refund.pk if refund else None,
                       "gateway_reference": gateway_reference, "ours": ours or {}, "theirs": theirs or {}})
    log.error("ledger discrepancy %s on %s: %s (%s)", discrepancy.pk, payment.pk, kind, detail)
    return discrepancy
