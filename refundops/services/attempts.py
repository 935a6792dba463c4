"""One live gateway call per refund, held by a lease, and nothing decided over an unknown answer.

A worker opens an attempt (a committed row with a lease) before it calls the gateway, and closes
it with the gateway's answer. While the lease runs no other worker calls for that refund; once it
has run out without an answer (the worker died, or the call timed out), the attempt's answer is
unknown and the gateway is asked (its list of the payment's refunds, which carry our refund id in
their metadata) before anything else is decided or the gateway is called again.

The lease outlasts the gateway client's own timeout, so a call whose lease has run out is over.
"""

from __future__ import annotations

import functools
import os
import socket
from datetime import timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Min, Q
from django.utils import timezone

from processors.base import ProcessorUnavailable
from refundops import batching
from refundops.models import GatewayAttempt, Refund, RefundState
from refundops.rows import Columns, db, save_new

Outcome = GatewayAttempt.Outcome
# The error code of an unknown attempt that was looked up in a gateway book that cannot list every
# refund (``PaymentBook.complete`` false): the look-up proved nothing, so it stays unknown.
UNVERIFIABLE = "book_incomplete"
WORKER_NAME = f"{socket.gethostname()}:{os.getpid()}"


class RetryLater(ProcessorUnavailable):
    """Not now: another worker holds the refund's lease, or an earlier answer is still unknown."""

    def __init__(self, message: str, *, retry_after: float) -> None:
        super().__init__(message, code="attempt_in_flight", retry_after=max(retry_after, 0.0))


class AnswerUnknown(RetryLater):
    """An earlier call's answer is unknown (or its lease ran out without one): look it up at the
    gateway before calling it again."""


def idempotency_key(refund: Refund) -> str:
    """The gateway key of the refund's current submission. The same for every call of it, so a
    retry, or a call after an unknown answer, is the same request to the gateway. A person's
    resubmission of a failed refund moves ``submit_attempts``: a new request on purpose."""
    return f"refundops:{refund.pk}:{refund.submit_attempts}"


def unresolved(refund: Refund, *, now=None) -> list[GatewayAttempt]:
    """Attempts whose answer is not known: unknown ones, and live ones whose lease has run out."""
    now = now or timezone.now()
    return list(refund.attempts.filter(Q(outcome=Outcome.UNKNOWN) | Q(outcome=Outcome.LIVE, lease_until__lte=now)))


def still_open(refund: Refund) -> list[GatewayAttempt]:
    """Attempts live or of unknown answer, the latest lease first. Every payment asks it, under the
    refund's lock: on PostgreSQL the ORM's statement by hand (refundops.rows), not compiled each time."""
    wrapper = db()
    if wrapper.vendor != "postgresql":
        return list(refund.attempts.filter(outcome__in=(Outcome.LIVE, Outcome.UNKNOWN)).order_by("-lease_until"))
    with wrapper.cursor() as cursor:
        cursor.execute(_still_open_sql(), [refund.pk, Outcome.LIVE.value, Outcome.UNKNOWN.value])
        return [_ATTEMPT.make(row) for row in cursor.fetchall()]


_ATTEMPT = Columns(GatewayAttempt, "a")


@functools.cache
def _still_open_sql() -> str:
    return (f"SELECT {_ATTEMPT.sql} FROM {GatewayAttempt._meta.db_table} a"
            f" WHERE a.refund_id = %s AND a.outcome IN (%s, %s) ORDER BY a.lease_until DESC")


def unresolved_of(open_ones: list[GatewayAttempt], *, now) -> list[GatewayAttempt]:
    """:func:`unresolved`, read from :func:`still_open`'s list rather than asked again."""
    return [a for a in open_ones if a.outcome == Outcome.UNKNOWN or a.lease_until <= now]


def _call_may_still_be_on(now) -> Q:
    """A live attempt whose lease ran out less than a lease ago: its worker never answered, and
    may still be waiting on a slow gateway that has not acted yet. A book read now that lacks its
    refund says nothing of it (the call may land after the read); after one more lease the call is
    over (the worker died, or its client gave up long since)."""
    return Q(outcome=Outcome.LIVE, lease_until__gt=now - timedelta(seconds=settings.GATEWAY_ATTEMPT_LEASE_SECONDS))


def may_be_at_gateway(refund: Refund) -> bool:
    """Whether the money of the refund's current submission may have left: a call in flight, an
    answer unknown, or an accepted one. Only the gateway's word may then end the refund."""
    return refund.attempts.filter(
        Q(outcome__in=(Outcome.LIVE, Outcome.UNKNOWN))
        | Q(outcome=Outcome.SUCCEEDED, idempotency_key=idempotency_key(refund))).exists()


def key_still_kept(refund: Refund, *, now=None) -> bool:
    """Whether the gateway still answers the refund's current idempotency key with its first
    answer: the key's first call started within ``GATEWAY_IDEMPOTENCY_KEPT_SECONDS``. Past that,
    a call with the same key is a new request, and pays again if the first one paid."""
    now = now or timezone.now()
    kept = settings.GATEWAY_IDEMPOTENCY_KEPT_SECONDS.get(refund.payment.processor, 0)
    first = refund.attempts.filter(idempotency_key=idempotency_key(refund)).aggregate(first=Min("started_at"))["first"]
    return first is None or first > now - timedelta(seconds=kept)


def open_attempt(refund: Refund, *, resend_unverifiable: bool = False,
                 open_ones: list[GatewayAttempt] | None = None) -> GatewayAttempt:
    """A new live attempt for a refund whose row lock the caller holds. Refused while another
    worker's lease runs, or while an earlier answer is unknown (look it up first).
    ``resend_unverifiable``: unknown attempts already looked up in a book that cannot list every
    refund (:data:`UNVERIFIABLE`) do not stop a new call. Only the gateway's idempotency can answer
    for them: the new call carries the same key, so it answers the refund they made, or makes it;
    only while the gateway still keeps the key (:func:`key_still_kept`). ``open_ones``: what
    :func:`still_open` gave the caller under the same lock, not asked again."""
    now = timezone.now()
    pending = list(open_ones) if open_ones is not None else still_open(refund)
    live = next((attempt for attempt in pending if attempt.outcome == Outcome.LIVE), None)
    if live is not None and live.lease_until > now:
        raise RetryLater(f"refund {refund.pk}: another worker is calling the gateway ({live.worker})",
                         retry_after=(live.lease_until - now).total_seconds())
    unverifiable = [a for a in pending if a.outcome == Outcome.UNKNOWN and a.error_code == UNVERIFIABLE
                    and a.idempotency_key == idempotency_key(refund)]
    if resend_unverifiable and unverifiable and key_still_kept(refund, now=now):  # asked only when it matters
        pending = [a for a in pending if a not in unverifiable]
    if pending:  # a live one past its lease, or an unknown one
        raise AnswerUnknown(f"refund {refund.pk}: an earlier call's answer is unknown; look it up first",
                            retry_after=0)
    attempt = GatewayAttempt(refund=refund, idempotency_key=idempotency_key(refund), worker=WORKER_NAME,
                             lease_until=now + timedelta(seconds=settings.GATEWAY_ATTEMPT_LEASE_SECONDS))
    save_new(attempt)  # no signals to send; one INSERT, its values prepared as the ORM's
    return attempt


def close_attempt(attempt: GatewayAttempt, outcome: str, *, processor_refund_id: str = "",
                  code: str = "", message: str = "") -> int:
    """Record one attempt's answer. An answer that came after the lease ran out (and someone else
    looked it up) does not overwrite what they found, unless it is a success: that is news. Answers
    whether it was recorded (0: a look-up had settled it)."""
    open_ones = (Outcome.LIVE, Outcome.UNKNOWN, Outcome.ABSENT) if outcome == Outcome.SUCCEEDED \
        else (Outcome.LIVE, Outcome.UNKNOWN)
    return GatewayAttempt.objects.filter(pk=attempt.pk, outcome__in=open_ones).update(
        outcome=outcome, finished_at=timezone.now(), processor_refund_id=processor_refund_id,
        error_code=code[:60], error_message=message)


@transaction.atomic
def settle_unresolved(refund: Refund, outcome: str, *, started_before, processor_refund_id: str = "",
                      why: str = "") -> int:
    """After a look-up at the gateway: every unresolved attempt of the refund that started before
    the gateway was asked (``started_before``) gets what was found; a later one is not covered by
    that answer. Nor is a live one whose worker may still be mid-call (:func:`_call_may_still_be_on`),
    unless the gateway found its refund. The refund's row lock is held by the caller."""
    now = timezone.now()
    covered = refund.attempts.filter(Q(outcome=Outcome.UNKNOWN) | Q(outcome=Outcome.LIVE, lease_until__lte=now),
                                     started_at__lt=started_before)
    if outcome != Outcome.SUCCEEDED:
        covered = covered.exclude(_call_may_still_be_on(now))
    return covered.update(outcome=outcome, finished_at=now, processor_refund_id=processor_refund_id,
                          error_message=why)


def mark_unverifiable(refund: Refund, *, started_before) -> int:
    """After a look-up in a book that cannot list every refund found nothing: the unresolved
    attempts stay unknown (the money may have left), marked as looked up in vain. A live one past
    its lease becomes unknown. Answers how many were newly marked. The refund's row lock is held
    by the caller."""
    now = timezone.now()
    return refund.attempts.filter(Q(outcome=Outcome.UNKNOWN) | Q(outcome=Outcome.LIVE, lease_until__lte=now),
                                  started_at__lt=started_before).exclude(_call_may_still_be_on(now)).exclude(
        outcome=Outcome.UNKNOWN, error_code=UNVERIFIABLE).update(
        outcome=Outcome.UNKNOWN, finished_at=now, error_code=UNVERIFIABLE,
        error_message="looked up: the gateway's book cannot list every refund, so it cannot show this one")


def close_with_news(attempt: GatewayAttempt, refund: Refund, processor_refund_id: str) -> None:
    """``close_attempt(attempt, SUCCEEDED, processor_refund_id=…)`` then ``resolve_by_news(refund, …)``
    in one statement: the answer of the call that made ``processor_refund_id`` is also news of the
    refund's current submission, and every payment closes its attempt with it. On PostgreSQL; the
    two calls elsewhere. The refund's row lock is held by the caller."""
    wrapper = db()
    if wrapper.vendor != "postgresql":
        close_attempt(attempt, Outcome.SUCCEEDED, processor_refund_id=processor_refund_id)
        resolve_by_news(refund, processor_refund_id)
        return
    open_ones = [Outcome.LIVE.value, Outcome.UNKNOWN.value]
    batching.defer(_close_with_news_sql(), [  # nothing reads it before the commit: with the next statement
        timezone.now(), processor_refund_id, attempt.pk, attempt.pk, NEWS,
        attempt.pk, [*open_ones, Outcome.ABSENT.value], refund.pk, idempotency_key(refund), open_ones])


NEWS = "resolved by the gateway's news of this refund"


@functools.cache
def _close_with_news_sql() -> str:
    return (f"UPDATE {GatewayAttempt._meta.db_table} SET outcome = '{Outcome.SUCCEEDED.value}', finished_at = %s,"
            f" processor_refund_id = %s, error_code = CASE WHEN id = %s THEN '' ELSE error_code END,"
            f" error_message = CASE WHEN id = %s THEN '' ELSE %s END"
            f" WHERE (id = %s AND outcome = ANY(%s)) OR (refund_id = %s AND idempotency_key = %s AND outcome = ANY(%s))")


def resolve_by_news(refund: Refund, processor_refund_id: str) -> int:
    """The gateway told us (webhook, sync, look-up) that the refund's current submission made
    ``processor_refund_id``: its calls whose answer we never recorded made it. Without this, a call
    that timed out after the gateway acted, or whose worker died, stays "unknown" (or "live" past
    its lease) forever once the refund has moved on, since only approved refunds are looked up.
    The refund's row lock is held by the caller."""
    return refund.attempts.filter(outcome__in=(Outcome.LIVE, Outcome.UNKNOWN),
                                  idempotency_key=idempotency_key(refund)).update(
        outcome=Outcome.SUCCEEDED, finished_at=timezone.now(), processor_refund_id=processor_refund_id,
        error_message=NEWS)


def stalled_refund_ids(*, older_than_seconds: int, limit: int) -> list[str]:
    """Approved refunds that nothing is working on: no live lease, and no attempt (or the refund
    itself) touched within ``older_than_seconds``. Their task was lost, or gave up."""
    now = timezone.now()
    cutoff = now - timedelta(seconds=older_than_seconds)
    busy = GatewayAttempt.objects.filter(Q(outcome=Outcome.LIVE, lease_until__gt=now) | Q(started_at__gt=cutoff)
                                         | Q(finished_at__gt=cutoff)).values("refund_id")
    return list(Refund.objects.filter(status=RefundState.APPROVED, updated_at__lte=cutoff)
                .exclude(pk__in=busy).order_by("updated_at").values_list("pk", flat=True)[:limit])
