"""The gateways' books against ours. Every difference is raised to a person and stays open until
they resolve it; a payment with an open difference takes no agent refund unheld.

Per payment, the gateway's book (what it captured, each refund with its amount, state and our
refund id from the metadata we sent) is read first, without a lock; then, under the payment's row
lock, it is compared with our refunds. What the ledger can take as the webhook path would (a refund
made on the gateway directly that still fits) is recorded; every other difference is raised.
Refunds still on their way (approved and being submitted, submitted and waiting for the gateway's
final word, or touched within ``RECONCILE_GRACE_SECONDS`` of reading the book) are the worker's
and the sync's business, not a difference. A difference the books agree on again stays open: a
person closes it with a note (``resolve_discrepancy``), since money may have moved twice between.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

from django.conf import settings
from django.db import transaction
from django.db.models import Exists, OuterRef, Q, QuerySet
from django.utils import timezone

from audit.services import record_audit
from processors.base import (
    GatewayRefund,
    PaymentBook,
    PaymentRef,
    ProcessorDeclined,
    ProcessorUnavailable,
    WebhookEvent,
)
from processors.registry import UnknownProcessor, get_processor
from refundops.errors import ApiError
from refundops.locks import lock_payment
from refundops.models import (
    GatewayAttempt,
    LedgerDiscrepancy,
    Payment,
    PaymentOperation,
    Reason,
    Refund,
    RefundState,
)
from refundops.services import attempts

log = logging.getLogger(__name__)
ACTOR = "system:reconciler"
Kind = LedgerDiscrepancy.Kind
# How each gateway says "no such payment": our record names something the gateway never had.
PAYMENT_MISSING_CODES = frozenset({"resource_missing", "INVALID_RESOURCE_ID", "RESOURCE_NOT_FOUND",
                                   "no_such_charge"})
# Gateway refund states in which the money left (or is leaving) the merchant.
MONEY_MOVED = ("pending", "succeeded")


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


@transaction.atomic
def resolve_discrepancy(*, discrepancy_id: str, user, note: str) -> LedgerDiscrepancy:
    """A person with the right (``refundops.resolve_discrepancy``: finance approvers) closes one
    difference with a note saying what was done about it. Audited; the payment's hold
    (``LEDGER_MISMATCH``) lifts once none of its differences is open."""
    if not user.has_perm("refundops.resolve_discrepancy"):
        raise ApiError("RESOLUTION_NOT_AUTHORIZED", "Resolving a ledger discrepancy needs the finance approver "
                                                    "role (permission refundops.resolve_discrepancy).")
    note = (note or "").strip()
    if not note:
        raise ApiError("VALIDATION_ERROR", "Say what was done about the difference (refunded by hand, corrected "
                                           "at the gateway, …): a resolution needs a note.", field="note")
    discrepancy = LedgerDiscrepancy.objects.select_for_update().filter(pk=discrepancy_id).first()
    if discrepancy is None:
        raise ApiError("DISCREPANCY_NOT_FOUND", f"No ledger discrepancy {discrepancy_id!r}.")
    if discrepancy.status != LedgerDiscrepancy.Status.OPEN:
        raise ApiError("DISCREPANCY_NOT_OPEN", f"{discrepancy.pk} was already resolved by {discrepancy.resolved_by} "
                                               f"at {discrepancy.resolved_at:%Y-%m-%d %H:%M}: nothing to do.")
    discrepancy.status = LedgerDiscrepancy.Status.RESOLVED
    discrepancy.resolved_at, discrepancy.resolved_by, discrepancy.resolution_note = timezone.now(), user, note
    discrepancy.save(update_fields=["status", "resolved_at", "resolved_by", "resolution_note"])
    still_open = LedgerDiscrepancy.objects.filter(payment_id=discrepancy.payment_id,
                                                  status=LedgerDiscrepancy.Status.OPEN).count()
    record_audit(actor=f"user:{user.get_username()}", action="ledger.discrepancy_resolved",
                 subject_type="payment", subject_id=discrepancy.payment_id,
                 data={"discrepancy_id": discrepancy.pk, "kind": discrepancy.kind, "note": note,
                       "still_open_on_payment": still_open})
    return discrepancy


def open_discrepancy_on(payment_field: str = "pk") -> Exists:
    """For an annotation: the payment (``OuterRef(payment_field)``) has a difference still open."""
    return Exists(LedgerDiscrepancy.objects.filter(payment_id=OuterRef(payment_field),
                                                   status=LedgerDiscrepancy.Status.OPEN))


# -- comparing the books ---------------------------------------------------------------------------
@dataclass
class PaymentCheck:
    """One payment's comparison: ``agree``, ``disagree`` (differences raised), ``unverifiable``
    (no difference found, but the gateway's book cannot list every refund: ``why`` says what could
    not be checked) or ``unreachable`` (its gateway could not be read: nothing was decided)."""

    payment_id: str
    gateway: str
    outcome: Literal["agree", "disagree", "unverifiable", "unreachable"] = "agree"
    discrepancies: list[LedgerDiscrepancy] = field(default_factory=list)
    recorded: list[str] = field(default_factory=list)  # refunds made on the gateway directly, now ours
    error: str = ""
    why: str = ""  # for an unverifiable check: what the book could not show


@dataclass
class ReconcileRun:
    """What a run found: counts of every payment compared, and the checks that found something
    (a difference, a refund recorded, a book that could not be read or could not list every
    refund). Agreeing checks are counted, not kept: a run over a million payments holds only its
    findings (every check is heard by ``progress``)."""

    started_at: datetime
    checks: list[PaymentCheck] = field(default_factory=list)  # those that did not simply agree
    checked: int = 0  # payments compared (not unreachable)
    agreed: int = 0

    def add(self, check: PaymentCheck) -> None:
        self.checked += check.outcome != "unreachable"
        if check.outcome == "agree" and not check.recorded:
            self.agreed += 1
        else:
            self.checks.append(check)

    @property
    def unreachable(self) -> list[PaymentCheck]:
        return [c for c in self.checks if c.outcome == "unreachable"]

    @property
    def unverifiable(self) -> list[PaymentCheck]:
        return [c for c in self.checks if c.outcome == "unverifiable"]


CHUNK = 200  # payments read, and their gateway books fetched, at a time


def reconcile(*, gateway: str | None = None, since: datetime | None = None,
              progress: Callable[[PaymentCheck], None] | None = None, chunk_size: int = CHUNK) -> ReconcileRun:
    """Compare every payment (of one gateway, and with activity since a moment, if asked) with its
    gateway's books, ``chunk_size`` payments at a time: the chunk's refund ids known to us in one
    query, its books in one read where the gateway can (``fetch_payment_books``); a payment whose
    book plainly agrees is done, any other is read again and compared under its lock as before. A gateway that cannot be read for one payment is counted, never the
    end of the run."""
    run = ReconcileRun(started_at=timezone.now())
    for chunk in _chunks_to_check(gateway=gateway, since=since, size=chunk_size):
        read = _read_books(chunk)
        plain = _agreeing_plainly(chunk, read)
        for payment in chunk:
            # What goes the locked way may change our ledger (record a refund made on the gateway,
            # cancel ours to make room, record a final word): it reads its book again just before
            # its lock, as one payment at a time did. The chunk's read may be a chunk's comparisons
            # old (for a gateway without a bulk read, a call per payment before the first) and is
            # good only for concluding "agrees", or "unreachable" (a gateway down is not asked twice).
            pre_read = read[payment.pk]
            try:
                check = (PaymentCheck(payment.pk, payment.processor) if payment.pk in plain
                         else reconcile_payment(payment, read=None if isinstance(pre_read[0], PaymentBook)
                                                else pre_read))
            except Exception as exc:  # one payment's surprise must not hide every other payment's books
                log.exception("reconcile: %s could not be compared", payment.pk)
                check = PaymentCheck(payment.pk, payment.processor, "unreachable",
                                     error=f"{type(exc).__name__}: {exc}")
            run.add(check)
            if progress is not None:
                progress(check)
    return run


def _chunks_to_check(*, gateway: str | None, since: datetime | None, size: int) -> Iterator[list[Payment]]:
    """The payments to compare in (created_at, id) order, by keyset: one bounded query a chunk."""
    payments: QuerySet[Payment] = Payment.objects.order_by("created_at", "pk")
    if gateway:
        payments = payments.filter(processor=gateway)
    if since is not None:
        # A refund still submitted is still in play however long ago it last moved: it may be overdue.
        touched = Refund.objects.filter(Q(updated_at__gte=since) | Q(status=RefundState.SUBMITTED),
                                        payment_id=OuterRef("pk"))
        payments = payments.filter(Q(created_at__gte=since) | Q(captured_at__gte=since) | Exists(touched))
    chunk = list(payments[:size])
    while chunk:
        yield chunk
        if len(chunk) < size:
            return
        last = chunk[-1]
        # created_at >= t is what PostgreSQL takes as the index's lower bound; the OR alone is only a
        # filter, and each chunk would walk the index from the first payment (quadratic).
        chunk = list(payments.filter(created_at__gte=last.created_at).filter(
            Q(created_at__gt=last.created_at) | Q(created_at=last.created_at, pk__gt=last.pk))[:size])


Read = tuple[PaymentBook | Exception | None, datetime]  # the book (None: no such payment) or why not, and when


def _read_books(chunk: list[Payment]) -> dict[str, Read]:
    """Each payment's book, read before any lock: per gateway account, in one call where the
    gateway reads books in bulk, else one by one."""
    known: dict[str, list[str]] = {}
    for payment_id, refund_id in (Refund.objects.filter(payment_id__in=[p.pk for p in chunk])
                                  .exclude(processor_refund_id="").values_list("payment_id", "processor_refund_id")):
        known.setdefault(payment_id, []).append(refund_id)
    accounts: dict[tuple[str, str], list[Payment]] = {}
    for payment in chunk:
        accounts.setdefault((payment.processor, payment.processor_account), []).append(payment)
    read: dict[str, Read] = {}
    for (processor, account), payments in accounts.items():
        refs = {p.pk: PaymentRef(processor=p.processor, account=p.processor_account, reference=p.processor_reference,
                                 authorization_reference=p.authorization_reference) for p in payments}
        read_at = timezone.now()
        try:
            gateway = get_processor(processor, account)
            if bulk := getattr(gateway, "fetch_payment_books", None):
                books = bulk(list(refs.values()), known_refund_ids={
                    p.processor_reference: known.get(p.pk, []) for p in payments})
                read.update({p.pk: (books[p.processor_reference], read_at) for p in payments})
                continue
        except Exception as exc:  # each payment of the account is unreachable, as one by one it would be
            read.update({p.pk: (exc, read_at) for p in payments})
            continue
        for payment in payments:
            read_at = timezone.now()
            try:
                book = gateway.fetch_payment_book(refs[payment.pk], known_refund_ids=known.get(payment.pk, []))
            except Exception as exc:  # told apart by reconcile_payment
                book = exc
            read[payment.pk] = (book, read_at)
    return read


def _agreeing_plainly(chunk: list[Payment], read: dict[str, Read]) -> set[str]:
    """The payments of the chunk whose book plainly agrees with our ledger, read after the book
    (two queries a chunk): the same capture, every gateway refund one of ours by its gateway id
    with the same amount, settled on both sides or not paid on either, none of ours submitted,
    approved or settled but unlisted, no capture in flight, a complete book. ``_compare`` would
    find nothing and do nothing for them, so they take no lock; anything else, however harmless,
    goes the locked way."""
    ours: dict[str, list[tuple[str, int, str, str]]] = {p.pk: [] for p in chunk}
    for payment_id, *refund in Refund.objects.filter(payment_id__in=ours).values_list(
            "payment_id", "processor_refund_id", "amount_minor", "currency", "status"):
        ours[payment_id].append(tuple(refund))
    in_flight = set(PaymentOperation.objects.filter(
        payment_id__in=ours, status__in=(PaymentOperation.Status.PENDING, PaymentOperation.Status.UNKNOWN))
        .values_list("payment_id", flat=True))
    plain = set()
    for payment in chunk:
        book = read[payment.pk][0]
        if (not isinstance(book, PaymentBook) or not book.complete or payment.pk in in_flight
                or (book.captured.amount_minor, book.captured.currency) != (payment.amount_captured_minor,
                                                                              payment.currency)):
            continue
        by_gateway_id = {refund[0]: refund for refund in ours[payment.pk] if refund[0]}
        listed = {theirs.processor_refund_id for theirs in book.refunds}
        if all(_plainly_the_same(by_gateway_id.get(theirs.processor_refund_id), theirs) for theirs in book.refunds) \
                and not any(status in (RefundState.APPROVED, RefundState.SUBMITTED)
                            or (status == RefundState.SETTLED and gateway_id not in listed)
                            for gateway_id, _, _, status in ours[payment.pk]):
            plain.add(payment.pk)
    return plain


def _plainly_the_same(mine: tuple[str, int, str, str] | None, theirs: GatewayRefund) -> bool:
    if mine is None:
        return False
    _, amount, currency, status = mine
    if (amount, currency) != (theirs.amount.amount_minor, theirs.amount.currency):
        return False
    if status == RefundState.SETTLED:
        return theirs.status not in ("failed", "canceled")
    return status not in (RefundState.APPROVED, RefundState.SUBMITTED) and theirs.status not in MONEY_MOVED


def reconcile_payment(payment: Payment, *, read: Read | None = None) -> PaymentCheck:
    """Read the gateway's book of one payment (unless ``read`` brings it), then compare it with
    ours under the payment lock."""
    book, read_at = read if read is not None else _read_books([payment])[payment.pk]
    if isinstance(book, Exception) and not isinstance(book, ProcessorUnavailable | UnknownProcessor
                                                          | ProcessorDeclined):
        raise book  # a surprise: the run counts the payment unreachable and goes on
    if isinstance(book, ProcessorUnavailable | UnknownProcessor):
        return PaymentCheck(payment.pk, payment.processor, "unreachable", error=str(book))
    if isinstance(book, ProcessorDeclined):
        if book.code not in PAYMENT_MISSING_CODES:
            return PaymentCheck(payment.pk, payment.processor, "unreachable", error=f"{book.code}: {book.message}")
        book = None  # the gateway has no such payment
    with transaction.atomic():
        locked = lock_payment(payment.pk)
        assert locked is not None
        return _compare(locked, book, read_at=read_at)


def _compare(payment: Payment, book: PaymentBook | None, *, read_at: datetime) -> PaymentCheck:
    check = PaymentCheck(payment.pk, payment.processor)
    settled_before = read_at - timedelta(seconds=settings.RECONCILE_GRACE_SECONDS)

    def raise_(kind: str, reference: str, *, refund: Refund | None = None, ours: dict[str, Any],
               theirs: dict[str, Any], detail: str) -> None:
        check.discrepancies.append(raise_discrepancy(
            payment=payment, kind=kind, actor=ACTOR, refund=refund, gateway_reference=reference,
            ours=ours, theirs=theirs, detail=detail))

    ours_captured = {"captured_minor": payment.amount_captured_minor, "currency": payment.currency,
                     "status": payment.status}
    if book is None:
        raise_(Kind.CAPTURE_MISMATCH, payment.processor_reference, ours=ours_captured, theirs={"payment": None},
               detail=f"{payment.processor} has no payment {payment.processor_reference}.")
        check.outcome = "disagree"
        return check
    capture_in_flight = payment.operations.filter(  # resolved by look-up (resolve_stalled_operations)
        status__in=(PaymentOperation.Status.PENDING, PaymentOperation.Status.UNKNOWN)).exists()
    if not capture_in_flight and (book.captured.amount_minor, book.captured.currency) != (
            payment.amount_captured_minor, payment.currency):
        raise_(Kind.CAPTURE_MISMATCH, book.reference, ours=ours_captured,
               theirs={"captured_minor": book.captured.amount_minor, "currency": book.captured.currency},
               detail=f"{payment.processor} captured {book.captured}; our ledger says {payment.captured}"
                      f"{' (a capture we never recorded)' if payment.amount_captured_minor == 0 else ''}.")

    refunds = list(payment.refunds.order_by("created_at", "pk"))
    by_gateway_id = {r.processor_refund_id: r for r in refunds if r.processor_refund_id}
    by_id = {r.pk: r for r in refunds}
    listed = {g.processor_refund_id for g in book.refunds}

    def settled_long_enough(refund: Refund) -> bool:
        return refund.updated_at < settled_before

    for theirs in book.refunds:
        gateway_side = _theirs(theirs)
        mine = by_gateway_id.get(theirs.processor_refund_id)
        if mine is None and theirs.our_refund_id in by_id:
            mine = by_id[theirs.our_refund_id]  # ours by the metadata we sent with it
            if mine.processor_refund_id:  # another attempt of a refund recorded as this one
                if theirs.status in MONEY_MOVED:
                    raise_(Kind.PAID_NOT_SETTLED, theirs.processor_refund_id, refund=mine, ours=_ours(mine),
                           theirs=gateway_side,
                           detail=f"{payment.processor} paid {theirs.amount} for {mine.pk} a second time "
                                  f"(our ledger records {mine.processor_refund_id} for it).")
                continue
        if mine is None:
            if theirs.status not in MONEY_MOVED:
                continue  # failed or canceled at the gateway: no money moved
            if theirs.our_refund_id:
                raise_(Kind.UNKNOWN_REFUND, theirs.processor_refund_id, ours={"refund": None}, theirs=gateway_side,
                       detail=f"{payment.processor} refund {theirs.processor_refund_id} names our refund "
                              f"{theirs.our_refund_id}, which this payment does not have.")
            else:  # made on the gateway directly: recorded as its webhook would, or raised where it cannot fit
                recorded, raised = _record_external(payment, theirs)
                if recorded is not None:
                    refunds.append(recorded)
                    check.recorded.append(recorded.pk)
                if raised is not None:
                    check.discrepancies.append(raised)
            continue
        ours_side = _ours(mine)
        if (mine.amount_minor, mine.currency) != (theirs.amount.amount_minor, theirs.amount.currency):
            raise_(Kind.AMOUNT_MISMATCH, theirs.processor_refund_id, refund=mine, ours=ours_side, theirs=gateway_side,
                   detail=f"{payment.processor} refunded {theirs.amount} for {mine.pk}; our ledger says {mine.money}.")
            continue
        if mine.status == RefundState.SUBMITTED and theirs.status != "pending" and settled_long_enough(mine):
            # The gateway's final word, which its webhook and the sync have not brought: recorded
            # as they would have (the sync comes round to every refund, but this one is in hand).
            from refundops.services.payouts import record_gateway_result  # imports this module

            record_gateway_result(refund_id=mine.pk, result=theirs.result, payment_id=payment.pk)
            mine.refresh_from_db(fields=["status", "updated_at"])
            continue
        if mine.status in (RefundState.APPROVED, RefundState.SUBMITTED):
            in_flight = mine.status == RefundState.SUBMITTED or not settled_long_enough(mine)
            if in_flight or theirs.status not in MONEY_MOVED:
                continue  # the worker or the sync records the gateway's answer
            raise_(Kind.PAID_NOT_SETTLED, theirs.processor_refund_id, refund=mine, ours=ours_side, theirs=gateway_side,
                   detail=f"{payment.processor} paid {theirs.amount} for {mine.pk}, which is still approved here "
                          f"and no longer being submitted.")
        elif mine.status == RefundState.SETTLED:
            if theirs.status in ("failed", "canceled"):
                raise_(Kind.SETTLED_NOT_PAID, theirs.processor_refund_id, refund=mine, ours=ours_side,
                       theirs=gateway_side,
                       detail=f"{mine.pk} is settled here but {theirs.status} at {payment.processor}: the "
                              f"customer did not get {mine.money}.")
        elif theirs.status in MONEY_MOVED and settled_long_enough(mine):
            # failed, canceled, denied, … here: counted as not paid. Not one that moved since just
            # before the book was read (a chunk's books are read before its first comparison): its
            # webhook may have brought a later word than the book's, as a refund pending there failing.
            raise_(Kind.PAID_NOT_SETTLED, theirs.processor_refund_id, refund=mine, ours=ours_side, theirs=gateway_side,
                   detail=f"{payment.processor} {'paid' if theirs.status == 'succeeded' else 'is paying'} "
                          f"{theirs.amount} for {mine.pk}, which is {mine.status} here: our ledger counts "
                          f"that money as still refundable.")

    overdue_before = read_at - timedelta(seconds=settings.REFUND_SETTLEMENT_SECONDS.get(payment.processor, 86400))
    statuses = {g.processor_refund_id: g.status for g in book.refunds}
    for mine in refunds:
        at_gateway = mine.status in (RefundState.SUBMITTED, RefundState.SETTLED) and mine.processor_refund_id
        if at_gateway and mine.processor_refund_id not in listed and settled_long_enough(mine):
            raise_(Kind.SETTLED_NOT_PAID, mine.processor_refund_id, refund=mine, ours=_ours(mine),
                   theirs={"refund": None},
                   detail=f"{mine.pk} is {mine.status} here as {payment.processor} refund "
                          f"{mine.processor_refund_id}, which {payment.processor} does not have.")
        elif mine.status == RefundState.SUBMITTED and mine.submitted_at and mine.submitted_at < overdue_before:
            raise_(Kind.SUBMITTED_OVERDUE, mine.processor_refund_id, refund=mine, ours=_ours(mine),
                   theirs={"processor_refund_id": mine.processor_refund_id,
                           "status": statuses.get(mine.processor_refund_id)},
                   detail=f"{mine.pk} was submitted to {payment.processor} on {mine.submitted_at:%Y-%m-%d %H:%M} "
                          f"UTC and is still {statuses.get(mine.processor_refund_id, 'unseen')} there, past "
                          f"the time {payment.processor} takes to settle a refund: ask {payment.processor} "
                          f"why, and whether the customer got {mine.money}.")
    if not book.complete:
        for mine in _maybe_at_gateway_unseen(payment, listed, started_before=settled_before):
            key = attempts.idempotency_key(mine)
            raise_(Kind.UNVERIFIABLE, key, refund=mine, ours={**_ours(mine), "idempotency_key": key},
                   theirs={"book": "incomplete", "listed": sorted(listed)},
                   detail=f"{mine.pk} ({mine.money}, {mine.status} here) may have been paid by {payment.processor}: "
                          f"a call's answer is unknown, and {payment.processor} cannot list the refunds of "
                          f"{payment.processor_reference} to show it. Look it up on the gateway's dashboard "
                          f"(request id {key}).")
    if check.discrepancies:
        check.outcome = "disagree"
    elif not book.complete:
        check.outcome = "unverifiable"
        check.why = (f"{payment.processor} cannot list the refunds of {payment.processor_reference} (a capture "
                     f"without an order): only refunds we know of were looked up by id, so a refund made "
                     f"elsewhere would not show.")
    return check


def _maybe_at_gateway_unseen(payment: Payment, listed: set[str], *, started_before: datetime) -> list[Refund]:
    """Our refunds of the payment with a gateway call whose answer is unknown (since before
    ``started_before``: younger ones are the worker's to look up), whose gateway refund is not in
    the book: a book that cannot list every refund cannot say whether it paid them."""
    unknown = GatewayAttempt.objects.filter(
        refund_id=OuterRef("pk"), started_at__lt=started_before,
        outcome__in=(GatewayAttempt.Outcome.LIVE, GatewayAttempt.Outcome.UNKNOWN))
    return [r for r in payment.refunds.filter(Exists(unknown)).order_by("created_at", "pk")
            if not r.processor_refund_id or r.processor_refund_id not in listed]


def _theirs(refund: GatewayRefund) -> dict[str, Any]:
    return {"processor_refund_id": refund.processor_refund_id, "amount_minor": refund.amount.amount_minor,
            "currency": refund.amount.currency, "status": refund.status, "our_refund_id": refund.our_refund_id}


def _ours(refund: Refund) -> dict[str, Any]:
    return {"refund_id": refund.pk, "amount_minor": refund.amount_minor, "currency": refund.currency,
            "status": refund.status, "processor_refund_id": refund.processor_refund_id}


def _record_external(payment: Payment, theirs: GatewayRefund) -> tuple[Refund | None, LedgerDiscrepancy | None]:
    """As the webhook path records it (its event was lost, or is still to come): the refund, or
    where it does not fit beside ours, the discrepancy ``record_external_refund`` raised instead."""
    from refundops.services.gateway_events import STRIPE_REASONS, record_external_refund  # imports payouts

    event = WebhookEvent(processor=payment.processor, event_id=f"reconcile:{theirs.processor_refund_id}",
                         type="reconcile", object_id=theirs.processor_refund_id)
    record_external_refund(payment_id=payment.pk, result=theirs.result, event=event, made_at=theirs.created_at,
                           reason=STRIPE_REASONS.get(theirs.reason, Reason.CUSTOMER_REQUEST))
    recorded = Refund.objects.filter(payment=payment, processor_refund_id=theirs.processor_refund_id).first()
    raised = None if recorded is not None else LedgerDiscrepancy.objects.filter(
        payment=payment, gateway_reference=theirs.processor_refund_id, status=LedgerDiscrepancy.Status.OPEN).first()
    return recorded, raised


def discrepancy_json(discrepancy: LedgerDiscrepancy, *, seen_since: datetime | None = None) -> dict[str, Any]:
    return {"id": discrepancy.pk, "payment_id": discrepancy.payment_id, "refund_id": discrepancy.refund_id,
            "kind": discrepancy.kind, "gateway": discrepancy.gateway, "account": discrepancy.account,
            "gateway_reference": discrepancy.gateway_reference, "ours": discrepancy.ours,
            "theirs": discrepancy.theirs, "detail": discrepancy.detail, "status": discrepancy.status,
            "detected_at": discrepancy.detected_at.isoformat(), "last_seen_at": discrepancy.last_seen_at.isoformat(),
            **({"seen_in_this_run": discrepancy.last_seen_at >= seen_since} if seen_since else {})}


def open_discrepancies(*, gateway: str | None = None) -> QuerySet[LedgerDiscrepancy]:
    found = LedgerDiscrepancy.objects.filter(status=LedgerDiscrepancy.Status.OPEN).order_by("detected_at", "pk")
    return found.filter(gateway=gateway) if gateway else found
