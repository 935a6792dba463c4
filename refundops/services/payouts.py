"""Paying an approved refund through its gateway, once, and recording what the gateway says.

Never a row lock across a network call: decide and open a gateway attempt (a row with a lease) and
commit, call the gateway with an idempotency key derived from the refund (so a retry is the same
request), then record the answer in a second short transaction. A call whose answer never came is
looked up at the gateway before anything else is decided (``services/attempts.py``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime, timedelta
from typing import Any, TypeVar

from django.db import connection, transaction
from django.db.models import Count, F, Min
from django.utils import timezone

from audit.models import Verdict
from audit.services import new_audit_entry, record_audit
from processors import breaker
from processors.base import (
    PaymentRef,
    ProcessorDeclined,
    ProcessorUnavailable,
    RefundRequest,
    RefundResult,
)
from processors.registry import get_processor
from refundops import batching, metrics, outbound
from refundops.locks import lock_payment, lock_refund, read_refund
from refundops.models import GatewayAttempt, LedgerDiscrepancy, Payment, Refund, RefundState
from refundops.rows import Columns, db, save_new
from refundops.services import attempts
from refundops.services.reconciliation import raise_discrepancy
from refundops.services.refunds import sync_payment_amounts, write_history

log = logging.getLogger(__name__)
WORKER = "system:worker"
Outcome = GatewayAttempt.Outcome
gateway_idempotency_key = attempts.idempotency_key
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
    started = time.perf_counter()
    try:
        result = call()
    except ProcessorUnavailable:
        metrics.record_gateway_call(gateway, "unavailable", time.perf_counter() - started)
        breaker.record_unavailable(gateway, account)
        raise
    except ProcessorDeclined:
        metrics.record_gateway_call(gateway, "declined", time.perf_counter() - started)
        breaker.record_success(gateway, account)  # a final answer: the gateway is reachable
        raise
    metrics.record_gateway_call(gateway, "ok", time.perf_counter() - started)
    log.info("gateway %s/%s answered in %.3fs", gateway, account, time.perf_counter() - started)
    breaker.record_success(gateway, account)
    return result


def payment_ref(payment) -> PaymentRef:
    return PaymentRef(processor=payment.processor, account=payment.processor_account,
                      reference=payment.processor_reference,
                      authorization_reference=payment.authorization_reference)


def submit_refund(*, refund_id: str) -> Refund:
    """Send one approved refund to its gateway, once. Raises ProcessorUnavailable (or RetryLater)
    to be retried later; the refund then stays approved.

    An earlier call whose answer is unknown is looked up at the gateway first; then the refund is
    canceled if it may no longer be paid; then one attempt, under a lease, calls the gateway."""
    refund = read_refund(refund_id)
    if refund.status != RefundState.APPROVED:
        return refund  # already submitted, settled, failed or canceled: nothing to do
    try:
        attempt, refund = _open_attempt(refund_id, payment_id=refund.payment_id)
    except attempts.AnswerUnknown:  # rolled back: nothing was decided over the unknown answer
        refund = resolve_unknown_attempts(refund_id=refund_id)
        if refund.status != RefundState.APPROVED:
            return refund
        attempt, refund = _open_attempt(refund_id, payment_id=refund.payment_id)
    if attempt is None:  # nothing to pay, or it may be paid and a dispute forbids paying: for a person
        return refund
    processor = get_processor(refund.payment.processor, refund.payment.processor_account)
    request = RefundRequest(payment=payment_ref(refund.payment), amount=refund.money, reason=refund.reason,
                            idempotency_key=attempt.idempotency_key, refund_id=refund.pk,
                            verdict_id=refund.verdict_id or "")
    try:
        result = call_gateway(processor.name, processor.account, lambda: processor.refund(request))
    except CircuitOpen:
        attempts.close_attempt(attempt, Outcome.NOT_SENT, code="gateway_circuit_open")
        raise
    except ProcessorUnavailable as down:  # it may have reached the gateway: ask before anything else
        record_unknown_answer(attempt, payment_id=refund.payment_id, code=down.code, message=down.message)
        raise
    except ProcessorDeclined as declined:
        return record_gateway_decline(attempt=attempt, code=declined.code, message=declined.message)
    except BaseException as crash:  # a bug or a kill between call and answer: unknown, never "not paid"
        record_unknown_answer(attempt, payment_id=refund.payment_id, code="worker_error", message=repr(crash)[:500])
        raise
    return record_gateway_result(refund_id=refund.pk, result=result, attempt=attempt, payment_id=refund.payment_id)


@transaction.atomic
def _open_attempt(refund_id: str, *, payment_id: str) -> tuple[GatewayAttempt | None, Refund]:
    """The last look before paying, under the refund's lock, and the attempt that pays it. Raises
    ``AnswerUnknown`` (and writes nothing) while an earlier call's answer is unknown."""
    refund = _cancel_if_disputed(_lock(refund_id, payment_id=payment_id))
    if refund.status != RefundState.APPROVED:
        return None, refund
    open_ones = attempts.still_open(refund)  # one read serves both questions below
    unresolved = attempts.unresolved_of(open_ones, now=timezone.now())
    if unresolved and all(a.error_code == attempts.UNVERIFIABLE for a in unresolved):
        why = _why_not_sent_again(refund)
        if why:
            # Not canceled (it may be paid) and not sent again (that could pay it twice): a person
            # decides, from the discrepancy raised for it. The stalled sweep looks again, and
            # sends it once the dispute is won, if the gateway still keeps the key by then.
            raise_unverifiable(refund, why=why)
            return None, refund
        return attempts.open_attempt(refund, resend_unverifiable=True, open_ones=open_ones), refund
    return attempts.open_attempt(refund, open_ones=open_ones), refund


def _why_not_sent_again(refund: Refund) -> str:
    """Why a call whose answer no book can show may not be sent again with the same key ("": it may)."""
    gateway = refund.payment.processor
    if _dispute_forbids_paying(refund):
        return (f"{gateway} cannot list the refunds of {refund.payment.processor_reference}, and the payment's "
                f"dispute forbids sending the call again to find out")
    if not attempts.key_still_kept(refund):
        return (f"{gateway} cannot list the refunds of {refund.payment.processor_reference}, and it no longer "
                f"keeps the call's request id: sent again, it would be a second refund")
    return ""


def resolve_unknown_attempts(*, refund_id: str) -> Refund:
    """Ask the gateway what became of calls whose answer we never recorded: the payment's refunds,
    found by our refund id in their metadata. Found: the refund is recorded as the gateway has it.
    Not found: those calls never made a refund, and a new call (same key) may go."""
    refund = read_refund(refund_id)
    if not attempts.unresolved(refund):
        return refund
    processor = get_processor(refund.payment.processor, refund.payment.processor_account)
    asked_at = timezone.now()  # the book speaks only for calls that started before it was asked for
    book = call_gateway(processor.name, processor.account,
                        lambda: processor.fetch_payment_book(payment_ref(refund.payment)))
    # Gateway refunds of this refund that earlier submissions (failed, then resubmitted) made are not news.
    earlier = set(refund.attempts.exclude(idempotency_key=attempts.idempotency_key(refund))
                  .exclude(processor_refund_id="").values_list("processor_refund_id", flat=True))
    # One the gateway made for this refund carries its id and its amount; metadata alone can be
    # copied onto a refund of another amount made on the gateway's dashboard (that one is external).
    found = [r for r in book.refunds if r.our_refund_id == refund.pk and r.processor_refund_id not in earlier
             and r.amount == refund.money and r.status in ("pending", "succeeded")]
    with transaction.atomic():
        refund = _lock(refund_id)
        if not attempts.unresolved(refund):
            return refund  # another worker resolved them meanwhile
        if not found and not book.complete:
            # A book that cannot list every refund never proves one absent: the answers stay unknown.
            if attempts.mark_unverifiable(refund, started_before=asked_at):
                record_audit(actor=WORKER, action="refund.attempt_unverifiable", subject_type="refund",
                             subject_id=refund.pk, data={"looked_up": len(book.refunds),
                                                         "verdict_id": refund.verdict_id})
                # A call whose worker died mid-call (never reaching record_unknown_answer) may have paid.
                _flag_paid_twice(refund.payment_id, refund.pk, actor=WORKER, why="answer unverifiable")
            why = _why_not_sent_again(refund)
            if why:
                raise_unverifiable(refund, why=why)
            return refund
        if not found:
            # A call that started after the book was read may have paid since, and one whose worker
            # may still be waiting on the gateway may land after it: they stay unresolved, and
            # open_attempt refuses a new call until the next look-up.
            if attempts.settle_unresolved(refund, Outcome.ABSENT, started_before=asked_at,
                                          why="looked up: the gateway has no refund for it"):
                record_audit(actor=WORKER, action="refund.attempt_absent", subject_type="refund",
                             subject_id=refund.pk, data={"looked_up": len(book.refunds),
                                                         "verdict_id": refund.verdict_id})
            return refund
        first = found[0]
        attempts.settle_unresolved(refund, Outcome.SUCCEEDED, processor_refund_id=first.processor_refund_id,
                                   started_before=asked_at, why="looked up: the gateway made this refund")
        refund = record_gateway_result(refund_id=refund_id, result=first.result)
        for twin in found[1:]:  # the same refund paid twice: only a person can undo that
            record_gateway_result(refund_id=refund_id, result=twin.result)
    return refund


@transaction.atomic
def cancel_if_disputed_since_approval(*, refund_id: str) -> Refund:
    return _cancel_if_disputed(_lock(refund_id))


def _cancel_if_disputed(refund: Refund) -> Refund:
    """The last look before paying: a refund no person approved is not paid on a payment whose
    dispute is open, since losing the dispute would pay the customer twice, or lost (the chargeback
    paid them back already; we may hear of it first as lost, its "opened" news lost). The policy holds
    new refunds on disputed payments for a person; this catches a dispute that opened between
    the automatic approval and the payment. A refund a person approved is theirs to answer for.
    The caller holds the refund's lock."""
    if refund.status != RefundState.APPROVED or not refund.payment.is_disputed or approved_by_a_person(refund):
        return refund
    if attempts.may_be_at_gateway(refund):
        # An earlier call may have paid it: only the gateway knows, and asking again with the
        # same idempotency key cannot pay twice. Alert rather than guess.
        record_audit(actor=WORKER, action="refund.disputed_in_flight", subject_type="refund",
                     subject_id=refund.pk, data={"processor_dispute_id": refund.payment.dispute_reference})
        return refund
    if refund.payment.dispute_status == Payment.Dispute.LOST:
        refund.cancel(message=f"The payment's dispute ({refund.payment.dispute_reference}) was lost after this "
                              f"refund was approved automatically and before it was paid: the customer has the "
                              f"money back through the chargeback, and paying it as well would pay them twice. "
                              f"A person may still refund what the chargeback did not return.")
    else:
        refund.cancel(message=f"The payment was disputed ({refund.payment.dispute_reference}) after this refund "
                              f"was approved automatically and before it was paid; paying it as well could "
                              f"pay the customer twice. A person may refund it once the dispute is decided.")
    history = _save(refund, [_moved(refund, f"payment disputed ({refund.payment.dispute_reference}) before it "
                                           f"was paid", previous=RefundState.APPROVED)])
    sync_payment_amounts(refund.payment)
    record_audit(actor=WORKER, action="refund.canceled", subject_type="refund", subject_id=refund.pk,
                 data={"from": RefundState.APPROVED, "why": "payment disputed after automatic approval",
                       "processor_dispute_id": refund.payment.dispute_reference,
                       "verdict_id": refund.verdict_id}, records=[history])
    return refund


def _dispute_forbids_paying(refund: Refund) -> bool:
    """An approved refund no person approved, on a payment whose dispute is open or was lost: paying
    it too could pay the customer twice."""
    return refund.status == RefundState.APPROVED and refund.payment.is_disputed and not approved_by_a_person(refund)


def raise_unverifiable(refund: Refund, *, why: str) -> LedgerDiscrepancy:
    """A refund of ours that may be at the gateway, which no book can show: for a person."""
    key = attempts.idempotency_key(refund)
    return raise_discrepancy(
        payment=refund.payment, kind=LedgerDiscrepancy.Kind.UNVERIFIABLE, actor=WORKER, refund=refund,
        gateway_reference=key, ours={"refund_id": refund.pk, "status": refund.status, "amount_minor": refund.amount_minor,
                                     "currency": refund.currency, "idempotency_key": key},
        theirs={"book": "incomplete"},
        detail=f"Refund {refund.pk} ({refund.money}) may have been paid by {refund.payment.processor}: a call's "
               f"answer was lost, and {why}. Look it up on the gateway's dashboard (request id {key}).")


def approved_by_a_person(refund: Refund) -> bool:
    """Whether a person, not only the policy, decided this refund is paid: a person asked for it
    (staff, or the gateway's own dashboard), a person approved it out of ``held``, or a person
    resubmitted it after a failure. Only an agent's refund the policy approved is not."""
    if refund.origin != Refund.Origin.AGENT:
        return True
    if refund.verdict is None or refund.verdict.outcome != Verdict.Outcome.APPROVED:
        return True
    return refund.history.filter(status__in=(RefundState.HELD, RefundState.FAILED)).exists()


def record_gateway_result(*, refund_id: str, result: RefundResult, attempt: GatewayAttempt | None = None,
                          payment_id: str | None = None) -> Refund:
    """Apply what the gateway says of one refund. Idempotent: the same answer twice changes nothing.
    A gateway refund that paid money is never dropped: it settles the refund whatever we thought
    of it, or, where our ledger cannot take it, it is raised to a person. The ``attempt`` that got
    this answer is closed in the same transaction, so no worker sees it closed and the refund unpaid.
    ``payment_id``: the refund's payment, when the caller has it (it spares a query).
    In a transaction of its own (the worker's answer, a webhook's, a sync's) its statements go in
    psycopg's pipeline (``batching.batch``): the writes nothing reads before the commit (the history
    rows, the attempt closed, the audit entry) ride with the next statement. Inside a caller's
    transaction (``resolve_unknown_attempts``) as they come: a batch is the outermost block's."""
    outermost = not db().in_atomic_block
    with transaction.atomic(), (batching.batch() if outermost else contextlib.nullcontext()):
        return _record_gateway_result(refund_id=refund_id, result=result, attempt=attempt, payment_id=payment_id)


def _record_gateway_result(*, refund_id: str, result: RefundResult, attempt: GatewayAttempt | None,
                           payment_id: str | None) -> Refund:
    refund = _lock(refund_id, payment_id=payment_id)
    as_locked = dict(vars(refund))  # what _save compares with: only what changed is written

    def close(*, news: bool) -> None:
        """The attempt closed, and with ``news`` the refund's other calls resolved: one statement.
        Nothing between the lock and here reads the refund's attempts."""
        if attempt is None:
            if news:
                attempts.resolve_by_news(refund, result.processor_refund_id)
        elif news:
            attempts.close_with_news(attempt, refund, result.processor_refund_id)
        else:
            attempts.close_attempt(attempt, Outcome.SUCCEEDED, processor_refund_id=result.processor_refund_id)

    paid = result.status in ("pending", "succeeded")
    if refund.processor_refund_id and refund.processor_refund_id != result.processor_refund_id:
        close(news=False)
        if paid:  # a second gateway refund for one refund of ours: paid twice
            _raise_paid_not_settled(refund, result, why="a second gateway refund for this refund")
        else:  # news of an earlier submission that failed (then a person resubmitted): not this one's
            log.info("refund %s: ignoring %s (%s), it is now %s", refund.pk, result.processor_refund_id,
                     result.status, refund.processor_refund_id)
        return refund
    now = timezone.now()
    before = refund.status
    moves: list[Move] = []  # saved together below: one UPDATE, one INSERT of their history rows
    if refund.status in (RefundState.FAILED, RefundState.CANCELED) and paid:
        if not _fits(refund):
            close(news=False)
            _raise_paid_not_settled(refund, result, why=f"the gateway paid a refund we recorded {refund.status}, "
                                                        f"and the payment has no room left to take it back")
            return refund
        refund.reinstate(processor_refund_id=result.processor_refund_id, at=now)
        moves.append(_moved(refund, f"gateway paid {result.processor_refund_id} after we recorded it {before}",
                            previous=before))
        log.error("refund %s: the gateway paid it (%s) after we recorded it %s; reinstated",
                  refund.pk, result.processor_refund_id, before)
    if refund.status == RefundState.APPROVED and paid:
        refund.submit(processor_refund_id=result.processor_refund_id, at=now)
        moves.append(_moved(refund, f"gateway accepted {result.processor_refund_id}", previous=RefundState.APPROVED))
    leaving = refund.status
    if refund.status == RefundState.SUBMITTED and result.status == "succeeded":
        refund.settle(at=now)
        moves.append(_moved(refund, "gateway reported success", previous=leaving))
    elif refund.status in (RefundState.APPROVED, RefundState.SUBMITTED, RefundState.SETTLED) \
            and result.status == "failed":
        refund.fail(code=result.failure_code or "gateway_failed",
                    message=result.failure_message or "The gateway failed the refund.")
        moves.append(_moved(refund, "gateway reported failure", previous=leaving))
    elif refund.status in (RefundState.APPROVED, RefundState.SUBMITTED) and result.status == "canceled":
        refund.cancel(message="The gateway canceled the refund.")
        moves.append(_moved(refund, "gateway canceled the refund", previous=leaving))
    history = _save(refund, moves, as_locked=as_locked) if moves else None
    close(news=bool(result.processor_refund_id) and refund.processor_refund_id == result.processor_refund_id)
    if refund.status != before:
        sync_payment_amounts(refund.payment)
        if paid and before not in (RefundState.SUBMITTED, RefundState.SETTLED):
            mark_paid_twice_if_disputed(refund)
        gateway_response = {**asdict(result), "amount": asdict(result.amount)}
        verdict = _answer_on_verdict(refund.verdict_id, gateway_response)
        action = "refund.reinstated" if before in (RefundState.FAILED, RefundState.CANCELED) else f"refund.{refund.status}"
        save_new(new_audit_entry(  # record_audit's entry, written as the refund service writes its own
            actor=WORKER, action=action, subject_type="refund", subject_id=refund.pk,
            data={"from": before, "to": refund.status, "processor_refund_id": result.processor_refund_id,
                  "verdict_id": refund.verdict_id, "gateway": gateway_response},
            records=[history, *([verdict] if verdict else [])]))
    return refund


def mark_paid_twice_if_disputed(refund: Refund, *, actor: str = WORKER) -> None:
    """Money left for a refund of a payment whose dispute is open or lost (a person paid it knowing,
    on our side or on the gateway's dashboard, or the dispute came while the call was out): the
    customer may have it back twice, and a person sees it, as when the dispute comes after the
    refund (gateway_events._paid_twice). The caller holds the payment's lock."""
    payment = refund.payment
    if not payment.is_disputed or payment.paid_twice:
        return
    payment.paid_twice = _flag_paid_twice(
        payment.pk, refund.pk, actor=actor, why="paid", processor_dispute_id=payment.dispute_reference,
        dispute_status=payment.dispute_status, amount_refunded_minor=payment.amount_refunded_minor,
        amount_reserved_minor=payment.amount_reserved_minor)


def record_unknown_answer(attempt: GatewayAttempt, *, payment_id: str, code: str, message: str = "") -> None:
    """A call whose answer never came: it may have paid. On a payment whose dispute is open or lost
    (a person approved it) the customer may then have the money twice, so the payment is marked paid
    twice now, as a dispute that comes while an answer is unknown marks it
    (gateway_events._paid_twice), not only once a look-up finds the refund: an incomplete book may
    never find it. No lock: the UPDATE is conditional, and dispute news that races it counts the
    unknown attempt itself."""
    if attempts.close_attempt(attempt, Outcome.UNKNOWN, code=code, message=message):  # not if a look-up settled it
        _flag_paid_twice(payment_id, attempt.refund_id, actor=WORKER, why="answer unknown", attempt_id=attempt.pk)


def _flag_paid_twice(payment_id: str, refund_id: str, *, actor: str, why: str, **data: Any) -> bool:
    """``paid_twice`` set on a payment whose dispute is open or lost and that is not marked yet (one
    conditional UPDATE), audited; whether it was set now."""
    disputed = (Payment.Dispute.OPEN, Payment.Dispute.LOST)
    with transaction.atomic():  # the flag and its audit entry, both or neither
        if not Payment.objects.filter(pk=payment_id, paid_twice=False, dispute_status__in=disputed).update(
                paid_twice=True):
            return False
        record_audit(actor=actor, action="payment.paid_twice", subject_type="payment", subject_id=payment_id,
                     data={"refund_id": refund_id, "why": why, **data})
    log.error("payment %s: refund %s (%s) while the payment is disputed; it may be paid back twice", payment_id,
              refund_id, why)
    return True


def _fits(refund: Refund) -> bool:
    """Whether the payment can take this refund back into its ledger (the caller holds the lock)."""
    payment = refund.payment
    sync_payment_amounts(payment)
    room = payment.amount_captured_minor - payment.amount_refunded_minor - payment.amount_reserved_minor
    return refund.amount_minor <= room


def _raise_paid_not_settled(refund: Refund, result: RefundResult, *, why: str) -> None:
    raise_discrepancy(payment=refund.payment, kind=LedgerDiscrepancy.Kind.PAID_NOT_SETTLED, actor=WORKER,
                      refund=refund, gateway_reference=result.processor_refund_id,
                      ours={"refund_id": refund.pk, "status": refund.status,
                            "processor_refund_id": refund.processor_refund_id, "amount": refund.amount_minor},
                      theirs={"processor_refund_id": result.processor_refund_id, "status": result.status,
                              "amount": result.amount.amount_minor, "currency": result.amount.currency},
                      detail=f"Refund {refund.pk}: {why}. Money left through {result.processor_refund_id}.")


def record_gateway_decline(*, attempt: GatewayAttempt, code: str, message: str) -> Refund:
    """The gateway refused this attempt. It fails the refund only when no other call of it may
    have paid: a decline of a duplicate says nothing of the call that went first."""
    with transaction.atomic():
        refund = _lock(attempt.refund_id)
        attempts.close_attempt(attempt, Outcome.DECLINED, code=code, message=message)
        if refund.status == RefundState.APPROVED and attempts.may_be_at_gateway(refund):
            record_audit(actor=WORKER, action="refund.decline_set_aside", subject_type="refund",
                         subject_id=refund.pk, data={"code": code, "message": message, "attempt_id": attempt.pk})
            raise_later = True
        else:
            raise_later = False
    if raise_later:  # look the other call up before anything is decided
        raise attempts.RetryLater(f"refund {refund.pk}: declined ({code}) while another call may have paid it",
                                  retry_after=0)
    return record_gateway_failure(refund_id=attempt.refund_id, code=code, message=message)


@transaction.atomic
def record_gateway_failure(*, refund_id: str, code: str, message: str) -> Refund:
    """A refused submission fails an approved refund, and only that: a submitted or settled one
    is the gateway's to fail (its webhook or sync), never a worker's decline."""
    refund = _lock(refund_id)
    if refund.status != RefundState.APPROVED or attempts.may_be_at_gateway(refund):
        return refund
    refund.fail(code=code, message=message)
    history = _save(refund, [_moved(refund, f"gateway declined: {code}", previous=RefundState.APPROVED)])
    sync_payment_amounts(refund.payment)
    verdict = _answer_on_verdict(refund.verdict_id, {"declined": code, "message": message})
    record_audit(actor=WORKER, action="refund.failed", subject_type="refund", subject_id=refund.pk,
                 data={"from": RefundState.APPROVED, "code": code, "message": message, "verdict_id": refund.verdict_id},
                 records=[history, *([verdict] if verdict else [])])
    return refund


def sync_refund(*, refund_id: str) -> Refund:
    """Ask the gateway where a submitted (or settled) refund stands, and record it."""
    refund = read_refund(refund_id)
    if refund.status not in (RefundState.SUBMITTED, RefundState.SETTLED) or not refund.processor_refund_id:
        return refund
    processor = get_processor(refund.payment.processor, refund.payment.processor_account)
    result = call_gateway(processor.name, processor.account,
                          lambda: processor.fetch_refund(refund.processor_refund_id))
    if (refund.status == RefundState.SUBMITTED and result.status == "pending"
            and result.processor_refund_id == refund.processor_refund_id
            and not refund.attempts.filter(outcome__in=(Outcome.LIVE, Outcome.UNKNOWN)).exists()):
        return refund  # still on its way, and nothing to record: no locks, no writes
    return record_gateway_result(refund_id=refund.pk, result=result)


@transaction.atomic
def take_submitted_refunds_to_sync(*, older_than_seconds: float, limit: int) -> list[str]:
    """Up to ``limit`` refunds submitted more than ``older_than_seconds`` ago, those the sync asked
    least recently first (never asked: first of all), marked as asked now. Sweep after sweep the
    oldest never crowd out the rest: each one's turn comes within (submitted refunds / limit)
    sweeps. Rows another sweep is taking are skipped, not waited for."""
    now = timezone.now()
    ids = list(Refund.objects.filter(status=RefundState.SUBMITTED,
                                     submitted_at__lte=now - timedelta(seconds=older_than_seconds))
               .order_by(F("synced_at").asc(nulls_first=True), "submitted_at")
               .select_for_update(skip_locked=True).values_list("pk", flat=True)[:limit])
    Refund.objects.filter(pk__in=ids).update(synced_at=now)  # no history, no updated_at: not a change of it
    return ids


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


def _lock(refund_id: str, *, payment_id: str | None = None) -> Refund:
    """Payment first, then refund: the order every writer takes them in. A refund's payment never
    changes, so a caller that read the refund before may name it (one query fewer)."""
    if payment_id is None:
        payment_id = Refund.objects.values_list("payment_id", flat=True).get(pk=refund_id)
    refund = lock_refund(refund_id, payment=lock_payment(payment_id))
    if refund.payment_id != payment_id:  # never: a refund's payment is set once; a wrong caller
        raise ValueError(f"refund {refund_id} is of payment {refund.payment_id}, not {payment_id}")
    return refund


# A move of a refund: the refund as it stood right after the transition, the state it left, why, when.
Move = tuple[Refund, str, str, datetime]


def _moved(refund: Refund, reason: str, *, previous: str) -> Move:
    """What ``_save`` records of the transition just made on ``refund``."""
    return copy.copy(refund), previous, f"{WORKER}: {reason}", timezone.now()


def _save(refund: Refund, moves: list[Move], *, as_locked: dict[str, Any] | None = None):
    """Save the refund's ``moves`` (a payment settled at once is submitted, then settled) in its
    transaction: one UPDATE in the last state, a history row for each move in one INSERT (what
    simple_history would write on a save after each, without its post_save's per-save manager class),
    the merchant endpoints read once and each move announced. Returns the last history row.
    ``as_locked``: the refund's attributes as its lock read them (``vars``); then the UPDATE sets only
    the columns that differ (Django's ``update_fields``; the row is locked, so the rest are as read),
    and ``updated_at``, and any list or dict (changed in place, it would compare equal)."""
    fields = None if as_locked is None else _changed_fields(refund, as_locked)
    refund.skip_history_when_saving = True  # written below, every move's row at once
    try:
        refund.save(update_fields=fields)
    finally:
        del refund.skip_history_when_saving
    for state, *_ in moves:
        state.updated_at = refund.updated_at  # as each save would have stamped it, near enough
    rows = write_history(refund, [(state, "~", reason, at) for state, _previous, reason, at in moves])
    endpoints = outbound.active_endpoints(refund)
    for state, previous, *_ in moves:
        outbound.announce_refund(state, previous=previous, endpoints=endpoints)
    return rows[-1]


def _changed_fields(refund: Refund, as_locked: dict[str, Any]) -> list[str]:
    missing = object()
    return [field.name for field in _REFUND_FIELDS
            if field.name == "updated_at" or isinstance(value := getattr(refund, field.attname), (list, dict))
            or value != as_locked.get(field.attname, missing)]


_REFUND_FIELDS = tuple(f for f in Refund._meta.concrete_fields if not f.primary_key)
_VERDICT = Columns(Verdict, "v")


def _answer_on_verdict(verdict_id: str | None, gateway_response: dict[str, Any]) -> Verdict | None:
    """Keep the gateway's answer on the refund's verdict, and the verdict as stored now (for the
    audit entry that vouches for it): one UPDATE … RETURNING on PostgreSQL."""
    if not verdict_id:
        return None
    if connection.vendor != "postgresql":
        Verdict.objects.filter(pk=verdict_id).update(gateway_response=gateway_response)
        return Verdict.objects.filter(pk=verdict_id).first()
    field = Verdict._meta.get_field("gateway_response")
    with db().cursor() as cursor:
        cursor.execute(_verdict_sql(), [field.get_db_prep_save(gateway_response, db()), verdict_id])
        row = cursor.fetchone()
    return _VERDICT.make(row) if row else None


@functools.cache
def _verdict_sql() -> str:
    quote = connection.ops.quote_name
    return (f"UPDATE {quote(Verdict._meta.db_table)} AS v SET {quote(Verdict._meta.get_field('gateway_response').column)} = %s"
            f" WHERE v.id = %s RETURNING {_VERDICT.sql}")
