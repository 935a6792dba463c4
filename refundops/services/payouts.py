"""Paying an approved refund through its gateway, and recording what the gateway says.

Never a row lock across a network call: decide and commit, call the gateway with an idempotency
key derived from the refund id (so a retry, or a worker that died after the call, is the same
request and cannot pay twice), then record the answer in a second short transaction.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime
from typing import Any, TypeVar

from django.db import transaction
from django.db.models import Count, Min
from django.utils import timezone

from audit.models import Verdict
from audit.services import record_audit
from processors import breaker
from processors.base import (
    PaymentRef,
    ProcessorDeclined,
    ProcessorUnavailable,
    RefundRequest,
    RefundResult,
)
from processors.registry import get_processor
from refundops.locks import lock_payment, lock_refund
from refundops.models import Refund, RefundState
from refundops.services.refunds import sync_payment_amounts

log = logging.getLogger(__name__)
WORKER = "system:worker"
T = TypeVar("T")


class CircuitOpen(ProcessorUnavailable):
    """The gateway's breaker is open: the gateway was not called. Retry after ``retry_after``."""

    def __init__(self, gateway: str, account: str, retry_after: float) -> None:
        super().__init__(f"{gateway}/{account} is resting after repeated failures; not called",
                         code="gateway_circuit_open", retry_after=retry_after)


def call_gateway(gateway: str, account: str, call: Callable[[], T]) -> T:
    """Every gateway call from the worker goes through the gateway's breaker."""
    wait = breaker.wait_seconds(gateway, account)
    if wait > 0:
        raise CircuitOpen(gateway, account, wait)
    try:
        result = call()
    except ProcessorUnavailable:
        breaker.record_unavailable(gateway, account)
        raise
    except ProcessorDeclined:
        breaker.record_success(gateway, account)  # a final answer: the gateway is reachable
        raise
    breaker.record_success(gateway, account)
    return result


def gateway_idempotency_key(refund: Refund) -> str:
    # submit_attempts moves only when a person resubmits a failed refund: a new attempt on purpose.
    return f"refundops:{refund.pk}:{refund.submit_attempts}"


def payment_ref(payment) -> PaymentRef:
    return PaymentRef(processor=payment.processor, account=payment.processor_account,
                      reference=payment.processor_reference,
                      authorization_reference=payment.authorization_reference)


def submit_refund(*, refund_id: str) -> Refund:
    """Send one approved refund to its gateway. Raises ProcessorUnavailable to be retried later."""
    refund = cancel_if_disputed_since_approval(refund_id=refund_id)
    if refund.status != RefundState.APPROVED:
        return refund  # already submitted, settled, failed or canceled: nothing to do
    if refund.gateway_called_at is None:
        refund.gateway_called_at = timezone.now()
        Refund.objects.filter(pk=refund.pk).update(gateway_called_at=refund.gateway_called_at)
    processor = get_processor(refund.payment.processor, refund.payment.processor_account)
    request = RefundRequest(payment=payment_ref(refund.payment), amount=refund.money, reason=refund.reason,
                            idempotency_key=gateway_idempotency_key(refund), refund_id=refund.pk,
                            verdict_id=refund.verdict_id or "")
    try:
        result = call_gateway(processor.name, processor.account, lambda: processor.refund(request))
    except ProcessorDeclined as declined:
        return record_gateway_failure(refund_id=refund.pk, code=declined.code, message=declined.message)
    return record_gateway_result(refund_id=refund.pk, result=result)


@transaction.atomic
def cancel_if_disputed_since_approval(*, refund_id: str) -> Refund:
    """The last look before paying: a refund no person approved is not paid on a payment whose
    dispute is open, since losing the dispute would pay the customer twice. The policy holds
    new refunds on disputed payments for a person; this catches a dispute that opened between
    the automatic approval and the payment. A refund a person approved is theirs to answer for."""
    refund = _lock(refund_id)
    if refund.status != RefundState.APPROVED or not refund.payment.is_disputed or approved_by_a_person(refund):
        return refund
    if refund.gateway_called_at is not None:
        # An earlier attempt may have paid it (a worker that died mid-call): only the gateway knows,
        # and asking again with the same idempotency key cannot pay twice. Alert rather than guess.
        record_audit(actor=WORKER, action="refund.disputed_in_flight", subject_type="refund",
                     subject_id=refund.pk, data={"processor_dispute_id": refund.payment.dispute_reference})
        return refund
    refund.cancel(message=f"The payment was disputed ({refund.payment.dispute_reference}) after this refund "
                          f"was approved automatically and before it was paid; paying it as well could "
                          f"pay the customer twice. A person may refund it once the dispute is decided.")
    _save(refund, f"payment disputed ({refund.payment.dispute_reference}) before it was paid")
    sync_payment_amounts(refund.payment)
    record_audit(actor=WORKER, action="refund.canceled", subject_type="refund", subject_id=refund.pk,
                 data={"from": RefundState.APPROVED, "why": "payment disputed after automatic approval",
                       "processor_dispute_id": refund.payment.dispute_reference,
                       "verdict_id": refund.verdict_id}, records=[refund.history.latest()])
    return refund


def approved_by_a_person(refund: Refund) -> bool:
    """Whether a person, not only the policy, decided this refund is paid: a person asked for it
    (staff, or the gateway's own dashboard), a person approved it out of ``held``, or a person
    resubmitted it after a failure. Only an agent's refund the policy approved is not."""
    if refund.origin != Refund.Origin.AGENT:
        return True
    if refund.verdict is None or refund.verdict.outcome != Verdict.Outcome.APPROVED:
        return True
    return refund.history.filter(status__in=(RefundState.HELD, RefundState.FAILED)).exists()


@transaction.atomic
def record_gateway_result(*, refund_id: str, result: RefundResult) -> Refund:
    """Apply what the gateway says of one refund. Idempotent: the same answer twice changes nothing."""
    refund = _lock(refund_id)
    if refund.processor_refund_id and refund.processor_refund_id != result.processor_refund_id:
        # News of an earlier attempt (failed, then resubmitted by a person): not this one's.
        log.info("refund %s: ignoring %s, it is now %s", refund.pk, result.processor_refund_id,
                 refund.processor_refund_id)
        return refund
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
        gateway_response = {**asdict(result), "amount": asdict(result.amount)}
        Verdict.objects.filter(pk=refund.verdict_id).update(gateway_response=gateway_response)
        record_audit(actor=WORKER, action=f"refund.{refund.status}", subject_type="refund", subject_id=refund.pk,
                     data={"from": before, "processor_refund_id": result.processor_refund_id,
                           "verdict_id": refund.verdict_id, "gateway": gateway_response},
                     records=[refund.history.latest()])
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
                 data={"from": before, "code": code, "message": message, "verdict_id": refund.verdict_id},
                 records=[refund.history.latest()])
    return refund


def sync_refund(*, refund_id: str) -> Refund:
    """Ask the gateway where a submitted (or settled) refund stands, and record it."""
    refund = Refund.objects.select_related("payment").get(pk=refund_id)
    if refund.status not in (RefundState.SUBMITTED, RefundState.SETTLED) or not refund.processor_refund_id:
        return refund
    processor = get_processor(refund.payment.processor, refund.payment.processor_account)
    result = call_gateway(processor.name, processor.account,
                          lambda: processor.fetch_refund(refund.processor_refund_id))
    return record_gateway_result(refund_id=refund.pk, result=result)


def gateway_backlog(*, now: datetime | None = None) -> list[dict[str, Any]]:
    """Approved refunds not yet accepted by their gateway, per gateway and account: how many, how
    long the oldest has waited since it was requested, and the gateway's breaker. For operators."""
    now = now or timezone.now()
    rows = (Refund.objects.filter(status=RefundState.APPROVED)
            .values("payment__processor", "payment__processor_account")
            .annotate(count=Count("id"), oldest=Min("created_at"))
            .order_by("payment__processor", "payment__processor_account"))
    backlog = []
    for row in rows:
        gateway, account = row["payment__processor"], row["payment__processor_account"]
        circuit = breaker.describe(gateway, account)
        backlog.append({"gateway": gateway, "account": account, "count": row["count"],
                        "oldest_age_seconds": int((now - row["oldest"]).total_seconds()),
                        "breaker": circuit.phase if circuit else "unknown",
                        "breaker_retry_in_seconds": int(circuit.retry_in) if circuit else None})
    return backlog


def _lock(refund_id: str) -> Refund:
    """Payment first, then refund: the order every writer takes them in."""
    lock_payment(Refund.objects.values_list("payment_id", flat=True).get(pk=refund_id))
    return lock_refund(refund_id)


def _save(refund: Refund, reason: str) -> None:
    refund._change_reason = f"{WORKER}: {reason}"
    refund.save()
