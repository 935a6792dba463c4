"""Paying an approved refund through its gateway, and recording what the gateway says.

Never a row lock across a network call: decide and commit, call the gateway with an idempotency
key derived from the refund id (so a retry, or a worker that died after the call, is the same
request and cannot pay twice), then record the answer in a second short transaction.
"""

from __future__ import annotations

import logging
from dataclasses import asdict

from django.db import transaction
from django.utils import timezone

from audit.models import Verdict
from audit.services import record_audit
from processors.base import (
    PaymentRef,
    ProcessorDeclined,
    RefundRequest,
    RefundResult,
)
from processors.registry import get_processor
from refundops.locks import lock_payment, lock_refund
from refundops.models import Refund, RefundState
from refundops.services.refunds import sync_payment_amounts

log = logging.getLogger(__name__)
WORKER = "system:worker"


def gateway_idempotency_key(refund: Refund) -> str:
    # submit_attempts moves only when a person resubmits a failed refund: a new attempt on purpose.
    return f"refundops:{refund.pk}:{refund.submit_attempts}"


def payment_ref(payment) -> PaymentRef:
    return PaymentRef(processor=payment.processor, account=payment.processor_account,
                      reference=payment.processor_reference,
                      authorization_reference=payment.authorization_reference)


def submit_refund(*, refund_id: str) -> Refund:
    """Send one approved refund to its gateway. Raises ProcessorUnavailable to be retried later."""
    refund = Refund.objects.select_related("payment").get(pk=refund_id)
    if refund.status != RefundState.APPROVED:
        return refund  # already submitted, settled, failed or canceled: nothing to do
    processor = get_processor(refund.payment.processor, refund.payment.processor_account)
    request = RefundRequest(payment=payment_ref(refund.payment), amount=refund.money, reason=refund.reason,
                            idempotency_key=gateway_idempotency_key(refund), refund_id=refund.pk,
                            verdict_id=refund.verdict_id or "")
    try:
        result = processor.refund(request)
    except ProcessorDeclined as declined:
        return record_gateway_failure(refund_id=refund.pk, code=declined.code, message=declined.message)
    return record_gateway_result(refund_id=refund.pk, result=result)


@transaction.atomic
def record_gateway_result(*, refund_id: str, result: RefundResult) -> Refund:
    """Apply what the gateway says of one refund. Idempotent: the same answer twice changes nothing."""
    refund = _lock(refund_id)
    now = timezone.now()
    before = refund.status
    if refund.status == RefundState.APPROVED and result.status in ("pending", "succeeded"):
        refund.submit(processor_refund_id=result.processor_refund_id, at=now)
        _save(refund, f"gateway accepted {result.processor_refund_id}")
    if refund.status == RefundState.SUBMITTED and result.status == "succeeded":
        refund.settle(at=now)
        _save(refund, "gateway reported success")
    elif refund.status in (RefundState.APPROVED, RefundState.SUBMITTED, RefundState.SETTLED) \
            and result.status == "failed":
        refund.fail(code=result.failure_code or "gateway_failed",
                    message=result.failure_message or "The gateway failed the refund.")
        _save(refund, "gateway reported failure")
    elif refund.status in (RefundState.APPROVED, RefundState.SUBMITTED) and result.status == "canceled":
        refund.cancel(message="The gateway canceled the refund.")
        _save(refund, "gateway canceled the refund")
    if refund.status != before:
        sync_payment_amounts(refund.payment)
        Verdict.objects.filter(pk=refund.verdict_id).update(gateway_response={
            **asdict(result), "amount": asdict(result.amount)})
        record_audit(actor=WORKER, action=f"refund.{refund.status}", subject_type="refund", subject_id=refund.pk,
                     data={"from": before, "processor_refund_id": result.processor_refund_id,
                           "verdict_id": refund.verdict_id})
    return refund


@transaction.atomic
def record_gateway_failure(*, refund_id: str, code: str, message: str) -> Refund:
    refund = _lock(refund_id)
    if refund.status not in (RefundState.APPROVED, RefundState.SUBMITTED):
        return refund
    before = refund.status
    refund.fail(code=code, message=message)
    _save(refund, f"gateway declined: {code}")
    sync_payment_amounts(refund.payment)
    Verdict.objects.filter(pk=refund.verdict_id).update(gateway_response={"declined": code, "message": message})
    record_audit(actor=WORKER, action="refund.failed", subject_type="refund", subject_id=refund.pk,
                 data={"from": before, "code": code, "message": message, "verdict_id": refund.verdict_id})
    return refund


def sync_refund(*, refund_id: str) -> Refund:
    """Ask the gateway where a submitted (or settled) refund stands, and record it."""
    refund = Refund.objects.select_related("payment").get(pk=refund_id)
    if refund.status not in (RefundState.SUBMITTED, RefundState.SETTLED) or not refund.processor_refund_id:
        return refund
    processor = get_processor(refund.payment.processor, refund.payment.processor_account)
    return record_gateway_result(refund_id=refund.pk, result=processor.fetch_refund(refund.processor_refund_id))


def _lock(refund_id: str) -> Refund:
    """Payment first, then refund: the order every writer takes them in."""
    lock_payment(Refund.objects.values_list("payment_id", flat=True).get(pk=refund_id))
    return lock_refund(refund_id)


def _save(refund: Refund, reason: str) -> None:
    refund._change_reason = f"{WORKER}: {reason}"
    refund.save()
