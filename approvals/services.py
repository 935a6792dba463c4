"""Approving, rejecting and expiring held refunds. Stands on refundops' services."""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.utils import timezone

from approvals.models import ApprovalAuthority
from audit.services import record_audit
from processors.money import format_minor
from refundops.callers import Caller
from refundops.errors import ApiError
from refundops import outbound
from refundops.locks import lock_payment, lock_refund
from refundops.models import Refund, RefundState
from refundops.services.refunds import decide_resubmission, sync_payment_amounts
from refundops.tasks import enqueue_submission


class ApprovalError(ApiError):
    pass


def ensure_approval_authority(*, approver, refund: Refund) -> None:
    if not approver.has_perm("refundops.approve_refund"):
        raise ApprovalError("APPROVAL_NOT_AUTHORIZED", f"{approver.get_username()} may not decide held refunds.")
    if refund.agent_id is None and refund.requested_by_id == approver.pk:
        raise ApprovalError("APPROVAL_NOT_AUTHORIZED", "A person cannot decide a refund they asked for.")
    authority = ApprovalAuthority.objects.filter(user=approver, currency=refund.currency, is_active=True).first()
    if authority is None:
        raise ApprovalError("APPROVAL_NOT_AUTHORIZED",
                            f"{approver.get_username()} has no refund authority in {refund.currency}.")
    if refund.amount_minor > authority.max_amount_minor:
        raise ApprovalError("APPROVAL_NOT_AUTHORIZED",
                            f"{format_minor(refund.amount_minor, refund.currency)} is above "
                            f"{approver.get_username()}'s authority of "
                            f"{format_minor(authority.max_amount_minor, refund.currency)}.")


def _locked(refund_id: str) -> Refund:
    payment_id = Refund.objects.filter(pk=refund_id).values_list("payment_id", flat=True).first()
    if payment_id is None:
        raise ApprovalError("REFUND_NOT_FOUND", f"No refund {refund_id!r}. Check the refund id (it starts "
                                                f"with 'rf_').")
    lock_payment(payment_id)
    return lock_refund(refund_id)


def _require_held(refund: Refund) -> None:
    if refund.status != RefundState.HELD:
        raise ApprovalError("REFUND_NOT_HELD", f"Refund {refund.pk} is {refund.status}, not held.")


@transaction.atomic
def approve_refund(*, refund_id: str, approver, note: str = "") -> Refund:
    refund = _locked(refund_id)
    _require_held(refund)
    ensure_approval_authority(approver=approver, refund=refund)
    refund.approve()
    refund._change_reason = f"approved by {approver.get_username()}" + (f": {note}" if note else "")
    refund.save()
    outbound.announce_refund(refund, previous=RefundState.HELD)
    record_audit(actor=Caller.for_user(approver).label, action="refund.approved", subject_type="refund",
                 subject_id=refund.pk, data={"note": note, "hold_reasons": refund.hold_reasons,
                                             "amount_minor": refund.amount_minor, "currency": refund.currency},
                 records=[refund.history.latest()])
    enqueue_submission(refund.pk, processor=refund.payment.processor)
    return refund


@transaction.atomic
def reject_refund(*, refund_id: str, approver, note: str = "") -> Refund:
    refund = _locked(refund_id)
    _require_held(refund)
    ensure_approval_authority(approver=approver, refund=refund)  # saying no is a decision too
    refund.reject(message=note)
    refund._change_reason = f"rejected by {approver.get_username()}" + (f": {note}" if note else "")
    refund.save()
    outbound.announce_refund(refund, previous=RefundState.HELD)
    sync_payment_amounts(refund.payment)
    record_audit(actor=Caller.for_user(approver).label, action="refund.rejected", subject_type="refund",
                 subject_id=refund.pk, data={"note": note}, records=[refund.history.latest()])
    return refund


def resubmit_refund(*, refund_id: str, approver, note: str = "") -> Refund:
    """A person sends a refund the gateway failed to it again, as a new attempt (a new gateway
    idempotency key). It is a new ask today: decided by the policy again under the same locks as a
    new refund (payment, then platform), and counted in today's totals. Refused: it stays failed
    and the refusal's code is raised (its verdict kept); held: it waits for a person's decision."""
    caller = Caller.for_user(approver)
    with transaction.atomic():
        refund = _locked(refund_id)
        if refund.status != RefundState.FAILED:
            raise ApprovalError("REFUND_NOT_FAILED", f"Refund {refund.pk} is {refund.status}; only a failed refund "
                                                     f"can be sent again.")
        ensure_approval_authority(approver=approver, refund=refund)
        now = timezone.now()
        decision, verdict = decide_resubmission(refund=refund, caller=caller, note=note, now=now)
        if decision.outcome == "denied":
            record_audit(actor=caller.label, action="refund.resubmit_refused", subject_type="refund",
                         subject_id=refund.pk, data={"note": note, "code": decision.code, "verdict_id": verdict.pk},
                         records=[verdict])
        else:
            if decision.outcome == "held":
                refund.resubmit_for_decision(at=now, reasons=decision.hold_reasons)
            else:
                refund.resubmit(at=now)
            refund._change_reason = (f"resubmitted by {approver.get_username()}" + (f": {note}" if note else "")
                                     + f" (verdict {verdict.pk}: {decision.outcome})")
            refund.save()
            outbound.announce_refund(refund, previous=RefundState.FAILED)
            sync_payment_amounts(refund.payment)
            record_audit(actor=caller.label, action="refund.resubmitted", subject_type="refund",
                         subject_id=refund.pk, data={"note": note, "attempt": refund.submit_attempts,
                                                     "verdict_id": verdict.pk, "outcome": refund.status,
                                                     "hold_reasons": refund.hold_reasons},
                         records=[verdict, refund.history.latest()])
            if refund.status == RefundState.APPROVED:
                enqueue_submission(refund.pk, processor=refund.payment.processor)
    if decision.outcome == "denied":  # raised once the verdict and its audit entry are committed
        raise ApprovalError(decision.code, decision.message)
    return refund


def expire_held_refunds(*, now=None) -> int:
    """Held refunds nobody decided within HELD_REFUND_EXPIRY_HOURS of being asked for (or resubmitted:
    counted_at) give their amount back."""
    now = now or timezone.now()
    cutoff = now - timedelta(hours=settings.HELD_REFUND_EXPIRY_HOURS)
    expired = 0
    for refund_id in Refund.objects.filter(status=RefundState.HELD, counted_at__lte=cutoff).values_list("pk", flat=True):
        with transaction.atomic():
            refund = _locked(refund_id)
            if refund.status != RefundState.HELD:
                continue
            refund.expire()
            refund._change_reason = f"no decision within {settings.HELD_REFUND_EXPIRY_HOURS}h"
            refund.save()
            outbound.announce_refund(refund, previous=RefundState.HELD)
            sync_payment_amounts(refund.payment)
            record_audit(actor="system:expiry", action="refund.expired", subject_type="refund", subject_id=refund.pk,
                         records=[refund.history.latest()])
            expired += 1
    return expired
