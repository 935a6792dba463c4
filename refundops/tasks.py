"""Thin Celery tasks: load by id, call a service. The worker pays; it never decides."""

from __future__ import annotations

import logging
import random
from datetime import datetime
from typing import Any

from celery import shared_task
from django.conf import settings
from django.utils import timezone

from processors.base import ProcessorDeclined, ProcessorUnavailable
from refundops import breaker, outbound, outbox
from refundops.errors import ApiError
from refundops.models import Refund, RefundState
from refundops.services import attempts, link_expiry, payouts

log = logging.getLogger(__name__)


PAYMENT_TASKS = ("refundops.tasks.submit_refund", "refundops.tasks.sync_refund")


def payment_queue(processor: str | None) -> str:
    """One queue per gateway (``payments.stripe``, …), so a slow gateway does not starve the others."""
    return f"payments.{processor or 'sandbox'}"


def route_payment_task(name, args, kwargs, options, task=None, **kw):
    """The gateway's queue for a payment task sent without one (retries, syncs, sweeps): one query."""
    if name not in PAYMENT_TASKS or options.get("queue"):
        return None
    processor = (Refund.objects.filter(pk=(kwargs or {}).get("refund_id"))
                 .values_list("payment__processor", flat=True).first())
    return {"queue": payment_queue(processor)}


def enqueue_submission(refund_id: str, *, processor: str | None = None) -> None:
    """Hand an approved refund to the worker once the approving transaction commits, through the
    outbox: a broker that is down then delays the submission, never loses it or fails the caller.
    A caller that knows the payment's ``processor`` names it, which spares the router its query."""
    outbox.send_after_commit(submit_refund.name, {"refund_id": refund_id},
                             queue=payment_queue(processor) if processor else "")  # "": the router decides


def backoff_seconds(attempt: int, *, retry_after: float | None = None) -> float:
    """Exponential backoff with full jitter, never sooner than the gateway's Retry-After, and
    always below the broker's visibility timeout: a task held past it would be handed out again."""
    ceiling = min(settings.REFUND_SUBMIT_BACKOFF_MAX_SECONDS,
                  settings.REFUND_SUBMIT_BACKOFF_BASE_SECONDS * 2 ** attempt)
    return min(max(retry_after or 0.0, random.uniform(ceiling / 2, ceiling)), longest_countdown())


def longest_countdown() -> float:
    return 0.8 * settings.CELERY_VISIBILITY_TIMEOUT_SECONDS


@shared_task(bind=True, max_retries=None, acks_late=True)
def submit_refund(self, *, refund_id: str) -> str:
    try:
        status = payouts.submit_refund(refund_id=refund_id).status
    except ProcessorUnavailable as down:
        if self.request.retries >= settings.REFUND_SUBMIT_MAX_RETRIES:
            # Still approved: the sweep of stalled refunds picks it up when the gateway is back.
            log.error("refund %s: gateway still unavailable after %s tries", refund_id, self.request.retries)
            return RefundState.APPROVED
        countdown = backoff_seconds(self.request.retries, retry_after=down.retry_after)
        log.warning("refund %s: not paid yet (%s); retry in %.0fs", refund_id, down.message, countdown)
        raise self.retry(countdown=countdown, exc=down) from None
    log.info("refund %s: %s after the gateway call", refund_id, status)
    if status == RefundState.SUBMITTED:  # look again soon; the periodic sync is the safety net
        sync_refund.apply_async(kwargs={"refund_id": refund_id}, countdown=settings.REFUND_FIRST_SYNC_SECONDS)
    return status


@shared_task(bind=True, max_retries=12)
def sync_refund(self, *, refund_id: str) -> str:
    """Look at a submitted refund again, sooner at first and then less often, until the gateway
    says how it ended. Webhooks usually get there first; the periodic sync is the safety net."""
    try:
        status = payouts.sync_refund(refund_id=refund_id).status
    except ProcessorUnavailable:
        status = RefundState.SUBMITTED
    if status == RefundState.SUBMITTED and self.request.retries < self.max_retries:
        raise self.retry(countdown=min(settings.REFUND_FIRST_SYNC_SECONDS * 2 ** (self.request.retries + 1),
                                        3600, longest_countdown()))
    return status


@shared_task
def poll_refund(*, refund_id: str) -> str:
    """One look at one refund, no follow-ups: the periodic sweep comes round again by itself."""
    try:
        return payouts.sync_refund(refund_id=refund_id).status
    except ProcessorUnavailable as down:
        log.warning("refund %s: could not poll the gateway (%s)", refund_id, down.message)
    except ProcessorDeclined as refused:  # e.g. the gateway does not know the refund: for a person
        log.error("refund %s: the gateway refused to say where it stands (%s)", refund_id, refused.message)
    return RefundState.SUBMITTED


@shared_task
def sync_submitted_refunds(*, older_than_seconds: int | None = None, limit: int = 500) -> int:
    """Poll the gateway for refunds submitted longer than ``REFUND_SYNC_AFTER_SECONDS`` ago:
    their webhook may have been lost. Younger ones still have their own follow-up syncs. Each
    sweep takes those asked least recently, so every submitted refund is reached in turn."""
    if older_than_seconds is None:
        older_than_seconds = settings.REFUND_SYNC_AFTER_SECONDS
    ids = payouts.take_submitted_refunds_to_sync(older_than_seconds=older_than_seconds, limit=limit)
    for refund_id in ids:
        poll_refund.delay(refund_id=refund_id)
    return len(ids)


@shared_task
def resubmit_stalled_refunds(*, older_than_seconds: int | None = None, limit: int = 500) -> int:
    """Approved refunds nothing is working on (their task was lost to a broker restart, or gave up
    after its retries): submit again. Safe: a refund with a live lease is skipped, and one whose
    last answer is unknown is looked up at the gateway before it is called again."""
    if older_than_seconds is None:
        older_than_seconds = settings.REFUND_STALLED_AFTER_SECONDS
    ids = attempts.stalled_refund_ids(older_than_seconds=older_than_seconds, limit=limit)
    for refund_id in ids:
        submit_refund.delay(refund_id=refund_id)
    return len(ids)


@shared_task(bind=True, max_retries=None, acks_late=True)
def deliver_webhook(self, *, delivery_id: str, turn: str | None = None) -> str:
    """One attempt to POST one event to a merchant; retried with backoff until it lands or
    ``WEBHOOK_MAX_ATTEMPTS`` is reached (then it stays in the log for a manual redeliver). A copy
    whose turn it is not ends here: the copy that had the turn schedules the next one."""
    delivery = outbound.attempt_delivery(delivery_id=delivery_id,
                                         turn=datetime.fromisoformat(turn) if turn else None)
    if delivery is None:
        return "not this copy's turn"
    if delivery.status == delivery.Status.PENDING and delivery.next_attempt_at is not None:
        countdown = max(0.0, (delivery.next_attempt_at - timezone.now()).total_seconds())
        raise self.retry(countdown=countdown)
    return delivery.status


@shared_task
def deliver_overdue_webhooks() -> int:
    """Send again the merchant webhook deliveries whose task was lost (still pending well past
    their next attempt, ``WEBHOOK_OVERDUE_SECONDS``)."""
    return outbound.deliver_overdue()


@shared_task
def fold_refund_totals() -> int:
    """Keep the day's totals a few rows a bucket (refundops/services/totals.py)."""
    from refundops.services.totals import fold_totals

    return fold_totals()


@shared_task
def drop_old_refund_totals() -> int:
    """Delete the day's totals' buckets that no total reads any more (refundops/services/totals.py)."""
    from refundops.services.totals import drop_old_totals

    return drop_old_totals()


@shared_task
def relay_outbox() -> int:
    """Send what the outbox still holds ``OUTBOX_GRACE_SECONDS`` after it was written: effects
    whose send failed at commit (the broker was down) or whose process died before sending; and
    forget rows sent more than ``OUTBOX_KEEP_SENT_DAYS`` ago."""
    sent = outbox.relay_unsent()
    outbox.forget_sent()
    return sent


@shared_task(bind=True, max_retries=10)
def count_agent_refund(self, *, amount_minor: int, currency: str, at: str, refund_id: str = "") -> None:
    """The breaker's count of one approved agent refund, in the minute it was approved: the
    relay's and an eager run's. The outbox's sender counts the rows it sends itself
    (:func:`count_in_sender`). ``refund_id`` (rows written before it was sent have none): a count
    delivered again is no second probe of a half-open breaker."""
    try:
        breaker.record_refund(amount_minor, currency, datetime.fromisoformat(at), refund_id=refund_id)
    except ApiError:  # its Redis is away: count it when it is back, still in its own minute
        raise self.retry(countdown=5) from None


def count_in_sender(rows: list[tuple[dict[str, Any], str | None]]) -> None:
    """The breaker's counts of a batch of the outbox's sender, run in its own thread instead of a
    message each for a worker (one pipeline of Redis scripts for the batch, against a Celery message
    built, sent, received and run for each). ``rows``: each row's kwargs and the id of the request
    that approved it. The rows are still the outbox's: marked sent once counted; with Redis away
    (ApiError, none counted) the relay's, which sends ``count_agent_refund`` to a worker."""
    breaker.record_refunds([(kwargs["amount_minor"], kwargs["currency"], datetime.fromisoformat(kwargs["at"]))
                            for kwargs, _ in rows], request_ids=[request_id for _, request_id in rows],
                           refund_ids=[kwargs.get("refund_id", "") for kwargs, _ in rows])


outbox.run_in_sender("refundops.tasks.count_agent_refund", count_in_sender)


@shared_task
def mail_operators(*, subject: str, message: str) -> None:
    """Mail the operators (the breaker's trip): by a worker, never in a request's thread."""
    breaker.mail_operators(subject, message)


@shared_task
def resolve_stalled_operations() -> int:
    """Voids and captures whose answer is unknown, or pending past their lease: looked up at the gateway."""
    from refundops.services.payments import resolve_stalled_operations as resolve

    return resolve()


@shared_task
def expire_payment_links() -> int:
    """Deactivate unpaid payment links past ``PAYMENT_LINK_EXPIRY_HOURS`` at their gateway."""
    return link_expiry.expire_payment_links()


@shared_task
def reconcile_ledgers() -> dict[str, int]:
    """The periodic ``reconcile``: every gateway's books against ours; differences go to a person."""
    from refundops.services import reconciliation

    run = reconciliation.reconcile()
    found = sum(len(check.discrepancies) for check in run.checks)
    if found or run.unreachable:
        log.warning("reconcile: %s payments compared, %s differences, %s unreachable",
                    run.checked, found, len(run.unreachable))
    return {"checked": run.checked, "discrepancies": found, "unreachable": len(run.unreachable),
            "unverifiable": len(run.unverifiable)}


@shared_task
def run_backtest(*, run_id: str) -> str:
    """A backtest asked for in the admin (``refundops.services.backtest.start_backtest``)."""
    from refundops.services.backtest import complete_backtest_run

    run = complete_backtest_run(run_id=run_id)
    return run.status if run else "gone"


@shared_task(ignore_result=True, acks_late=True)  # a worker that dies mid-build: the task comes back
def build_evidence_pack(pack_id: str) -> None:
    """An auditor's evidence pack, asked for in the admin (refundops.services.evidence_packs)."""
    from refundops.services import evidence_packs

    evidence_packs.build_requested_pack(pack_id=pack_id)
