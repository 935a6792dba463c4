"""``manage.py reconcile`` and the periodic job: each gateway's books (read through the adapters,
the official SDKs against the fake Stripe and PayPal servers, and the sandbox's own ledger) against
ours, per payment. Every kind of difference is raised once, stays open until a person resolves it,
and the command exits 1 while one is open."""

from __future__ import annotations

import io
import json
import secrets
from dataclasses import dataclass
from datetime import timedelta
from decimal import Decimal
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from audit.models import AuditEntry
from processors import sandbox
from processors.base import PaymentRef, RefundRequest
from processors.models import SandboxRefund
from processors.money import Money
from processors.sandbox import SandboxProcessor
from refundops.celery import app as celery_app
from refundops.models import LedgerDiscrepancy, Payment, Refund, RefundState
from refundops.services import reconciliation
from refundops.services.refunds import sync_payment_amounts
from tests.conftest import make_payment
from tests.fakes.fixtures import paypal_payment, stripe_payment

pytestmark = pytest.mark.django_db

Kind = LedgerDiscrepancy.Kind


@pytest.fixture(autouse=True)
def _no_grace(settings):
    """Refunds written by a test a moment ago count as long settled (the grace has its own test)."""
    settings.RECONCILE_GRACE_SECONDS = 0


# -- each gateway's side, driven as its own dashboard would -------------------------------------------
@dataclass
class Books:
    name: str
    fake: Any = None

    def payment(self, amount: int = 10_000) -> Payment:
        if self.name == "stripe":
            return stripe_payment(self.fake, amount)
        if self.name == "paypal":
            return paypal_payment(self.fake, f"{Decimal(amount) / 100:.2f}")
        return make_payment(amount=amount)

    def refund(self, payment: Payment, amount: int, *, ours: Refund | None = None, status: str = "succeeded") -> str:
        """A refund at the gateway: one of ours (our id in its metadata) or made there directly."""
        if self.name == "stripe":
            return self.fake.refund_directly(payment.processor_reference, amount, status=status,
                                             metadata={"refund_id": ours.pk, "verdict_id": "vd_1"} if ours else None)
        if self.name == "paypal":
            made = self.fake.refund_directly(payment.processor_reference, f"{Decimal(amount) / 100:.2f}",
                                             custom_id=f"{ours.pk}|vd_1|customer_request" if ours else None)
            if status != "succeeded":
                self.fail(made, status)
            return made
        sandbox.set_mode("up", settle_delay_seconds=0)
        ref = PaymentRef(processor="sandbox", account="default", reference=payment.processor_reference)
        made = SandboxProcessor().refund(RefundRequest(
            payment=ref, amount=Money(amount, payment.currency), reason="customer_request",
            idempotency_key=secrets.token_hex(8), refund_id=ours.pk if ours else "",
            verdict_id="vd_1" if ours else "")).processor_refund_id
        if status != "succeeded":
            self.fail(made, status)
        return made

    def fail(self, refund_id: str, status: str = "failed") -> None:
        if self.name == "stripe":
            self.fake.set_refund_status(refund_id, status)
        elif self.name == "paypal":
            self.fake.set_refund_status(refund_id, {"failed": "FAILED", "pending": "PENDING"}[status])
        else:
            SandboxRefund.objects.filter(reference=refund_id).update(
                status=status, settles_at=timezone.now() + timedelta(days=1))


@pytest.fixture(params=["sandbox", "stripe", "paypal"])
def books(request, gateways) -> Books:
    fake = {"stripe": "stripe_fake", "paypal": "paypal_fake"}.get(request.param)
    return Books(request.param, request.getfixturevalue(fake) if fake else None)


def our_refund(payment: Payment, amount: int, status: str, *, processor_refund_id: str = "") -> Refund:
    """Our ledger's side, as it stands after whatever went wrong (the payment's sums kept right)."""
    refund = Refund.objects.create(payment=payment, amount_minor=amount, currency=payment.currency,
                                   reason="customer_request", status=status,
                                   processor_refund_id=processor_refund_id)
    sync_payment_amounts(payment)
    payment.save(update_fields=["amount_refunded_minor", "amount_reserved_minor"])
    return refund


def settled_refund(books: Books, payment: Payment, amount: int) -> Refund:
    """A refund of ours that went right: settled here and paid at the gateway."""
    refund = our_refund(payment, amount, RefundState.APPROVED)
    gateway_id = books.refund(payment, amount, ours=refund)
    Refund.objects.filter(pk=refund.pk).update(status=RefundState.SETTLED, processor_refund_id=gateway_id,
                                               settled_at=timezone.now())
    sync_payment_amounts(payment)
    payment.save(update_fields=["amount_refunded_minor", "amount_reserved_minor"])
    refund.refresh_from_db()
    return refund


def reconcile(*args: str) -> tuple[dict[str, Any], int]:
    """``reconcile --json``: its object and its exit code."""
    out = io.StringIO()
    try:
        call_command("reconcile", "--json", *args, stdout=out)
        code = 0
    except CommandError as failed:
        code = failed.returncode
    return json.loads(out.getvalue()), code


def kinds(report: dict[str, Any]) -> list[tuple[str, str]]:
    return sorted((d["kind"], d["gateway_reference"]) for d in report["discrepancies"])


# -- each kind of difference, on each gateway -----------------------------------------------------------
def test_books_that_agree_report_nothing_and_exit_0(books: Books) -> None:
    payment = books.payment(10_000)
    settled_refund(books, payment, 2_500)
    books.refund(payment, 700, status="failed")  # failed at the gateway: no money moved, nothing to say

    report, code = reconcile()

    assert (report["checked"], report["discrepancies"], report["unreachable"], code) == (1, [], [], 0)
    assert not LedgerDiscrepancy.objects.exists()


def test_paid_at_the_gateway_but_failed_here_is_raised(books: Books) -> None:
    payment = books.payment(10_000)
    refund = our_refund(payment, 5_000, RefundState.FAILED)  # recorded failed, as in issue 8 finding 1
    paid = books.refund(payment, 5_000, ours=refund)

    report, code = reconcile()

    assert code == 1 and kinds(report) == [(Kind.PAID_NOT_SETTLED, paid)]
    found = report["discrepancies"][0]
    assert (found["payment_id"], found["refund_id"], found["status"]) == (payment.pk, refund.pk, "open")
    assert found["ours"]["status"] == "failed"
    assert (found["theirs"]["status"], found["theirs"]["amount_minor"], found["theirs"]["our_refund_id"]) == (
        "succeeded", 5_000, refund.pk)
    assert AuditEntry.objects.filter(action="ledger.discrepancy", subject_id=payment.pk).count() == 1


def test_settled_here_but_missing_or_failed_at_the_gateway_is_raised(books: Books) -> None:
    payment = books.payment(10_000)
    ghost = our_refund(payment, 1_000, RefundState.SETTLED, processor_refund_id="re_ghost_0001")
    reversed_ = settled_refund(books, payment, 2_000)
    books.fail(reversed_.processor_refund_id)

    report, code = reconcile()

    assert code == 1
    assert kinds(report) == sorted([(Kind.SETTLED_NOT_PAID, "re_ghost_0001"),
                                    (Kind.SETTLED_NOT_PAID, reversed_.processor_refund_id)])
    by_ref = {d["gateway_reference"]: d for d in report["discrepancies"]}
    assert by_ref["re_ghost_0001"]["refund_id"] == ghost.pk and by_ref["re_ghost_0001"]["theirs"] == {"refund": None}
    assert by_ref[reversed_.processor_refund_id]["theirs"]["status"] == "failed"


def test_amounts_that_differ_are_raised(books: Books) -> None:
    payment = books.payment(10_000)
    refund = our_refund(payment, 1_500, RefundState.APPROVED)
    paid = books.refund(payment, 1_000, ours=refund)
    Refund.objects.filter(pk=refund.pk).update(status=RefundState.SETTLED, processor_refund_id=paid)

    report, code = reconcile()

    assert code == 1 and kinds(report) == [(Kind.AMOUNT_MISMATCH, paid)]
    found = report["discrepancies"][0]
    assert (found["ours"]["amount_minor"], found["theirs"]["amount_minor"]) == (1_500, 1_000)


def test_a_refund_made_on_the_gateway_that_fits_is_recorded_as_the_webhook_would(books: Books) -> None:
    payment = books.payment(10_000)
    settled_refund(books, payment, 3_000)
    made = books.refund(payment, 2_000)  # on the gateway's dashboard; its event never reached us

    report, code = reconcile()

    assert (report["discrepancies"], code) == ([], 0)
    external = Refund.objects.get(payment=payment, processor_refund_id=made)
    assert report["recorded"] == [external.pk]
    assert (external.origin, external.status, external.amount_minor) == (
        Refund.Origin.EXTERNAL, RefundState.SETTLED, 2_000)
    payment.refresh_from_db()
    assert payment.amount_refunded_minor == 5_000
    assert reconcile() == ({"checked": 1, "discrepancies": [], "unreachable": [], "unverifiable": [], "recorded": []}, 0)


def test_a_refund_made_on_the_gateway_that_no_longer_fits_is_raised_not_recorded(books: Books) -> None:
    payment = books.payment(10_000)
    our_refund(payment, 8_000, RefundState.SETTLED, processor_refund_id="re_ghost_0002")
    made = books.refund(payment, 5_000)

    report, code = reconcile()

    assert code == 1
    assert kinds(report) == sorted([(Kind.UNKNOWN_REFUND, made), (Kind.SETTLED_NOT_PAID, "re_ghost_0002")])
    assert not Refund.objects.filter(processor_refund_id=made).exists()


def test_a_gateway_refund_with_no_room_beside_ours_on_its_way_is_raised_not_recorded(books: Books) -> None:
    from refundops.services import attempts

    payment = books.payment(10_000)
    on_its_way = our_refund(payment, 8_000, RefundState.APPROVED)
    attempts.open_attempt(on_its_way)  # a worker is calling the gateway for it right now
    made = books.refund(payment, 5_000)

    report, code = reconcile()

    assert code == 1 and kinds(report) == [(Kind.UNKNOWN_REFUND, made)]
    assert not Refund.objects.filter(processor_refund_id=made).exists()
    assert Refund.objects.get(pk=on_its_way.pk).status == RefundState.APPROVED


def test_a_refund_naming_a_refund_of_ours_this_payment_does_not_have_is_raised(books: Books) -> None:
    payment, other = books.payment(10_000), books.payment(4_000)
    elsewhere = our_refund(other, 1_000, RefundState.APPROVED)
    made = books.refund(payment, 1_000, ours=elsewhere)

    report, code = reconcile()

    assert code == 1 and kinds(report) == [(Kind.UNKNOWN_REFUND, made)]


def test_a_capture_we_never_recorded_is_raised(books: Books) -> None:
    payment = books.payment(6_000)
    Payment.objects.filter(pk=payment.pk).update(status=Payment.Status.AUTHORIZED, amount_captured_minor=0,
                                                 captured_at=None)

    report, code = reconcile()

    assert code == 1 and kinds(report) == [(Kind.CAPTURE_MISMATCH, payment.processor_reference)]
    found = report["discrepancies"][0]
    assert (found["ours"]["captured_minor"], found["theirs"]["captured_minor"]) == (0, 6_000)


# -- found again, agreed again, and what is left alone --------------------------------------------------
def test_a_difference_found_again_is_the_same_open_row_and_agreeing_again_does_not_close_it(
        books: Books) -> None:
    payment = books.payment(10_000)
    refund = our_refund(payment, 4_000, RefundState.FAILED)
    paid = books.refund(payment, 4_000, ours=refund)
    first, _ = reconcile()

    again, code = reconcile()

    assert code == 1 and [d["id"] for d in again["discrepancies"]] == [d["id"] for d in first["discrepancies"]]
    assert again["discrepancies"][0]["seen_in_this_run"] is True
    assert LedgerDiscrepancy.objects.count() == 1
    books.fail(paid)  # the gateway took the money back: the books agree again
    agreed, code = reconcile()
    assert code == 1, "a person closes it: money may have moved twice in between"
    assert agreed["discrepancies"][0]["seen_in_this_run"] is False
    assert LedgerDiscrepancy.objects.get().status == LedgerDiscrepancy.Status.OPEN


def test_refunds_still_on_their_way_are_not_differences(books: Books, settings) -> None:
    settings.RECONCILE_GRACE_SECONDS = 600
    payment = books.payment(10_000)
    being_sent = our_refund(payment, 1_000, RefundState.APPROVED)
    books.refund(payment, 1_000, ours=being_sent)  # paid; the worker has not recorded the answer yet
    our_refund(payment, 2_000, RefundState.SUBMITTED, processor_refund_id="re_just_sent_01")
    waiting = settled_refund(books, payment, 500)
    books.fail(waiting.processor_refund_id, "pending")

    report, code = reconcile()

    assert (report["checked"], report["discrepancies"], code) == (1, [], 0)
    Refund.objects.filter(pk=being_sent.pk).update(updated_at=timezone.now() - timedelta(hours=1))
    report, code = reconcile()
    assert code == 1 and [d["kind"] for d in report["discrepancies"]] == [Kind.PAID_NOT_SETTLED]


# -- the run as a whole ----------------------------------------------------------------------------------
def test_a_gateway_that_cannot_be_read_is_counted_unreachable_and_the_run_goes_on(
        gateways, stripe_fake) -> None:
    down = stripe_payment(stripe_fake, 5_000)
    stripe_fake.set_mode("down")
    fine = make_payment(amount=3_000)

    report, code = reconcile()

    assert (report["checked"], report["discrepancies"], code) == (1, [], 0)
    assert [(u["payment_id"], u["gateway"]) for u in report["unreachable"]] == [(down.pk, "stripe")]
    assert fine.pk not in {u["payment_id"] for u in report["unreachable"]}


def test_gateway_and_since_choose_the_payments_and_progress_is_printed_for_people(
        gateways, stripe_fake) -> None:
    old = make_payment(amount=3_000)
    Payment.objects.filter(pk=old.pk).update(created_at=timezone.now() - timedelta(days=40),
                                             captured_at=timezone.now() - timedelta(days=40))
    make_payment(amount=2_000)
    broken = stripe_payment(stripe_fake, 5_000)
    Payment.objects.filter(pk=broken.pk).update(amount_captured_minor=4_000, amount_authorized_minor=4_000)

    assert reconcile("--gateway", "sandbox")[0]["checked"] == 2
    since = (timezone.now() - timedelta(days=1)).date().isoformat()
    assert reconcile("--gateway", "sandbox", "--since", since) == (
        {"checked": 1, "discrepancies": [], "unreachable": [], "unverifiable": [], "recorded": []}, 0)
    out = io.StringIO()
    with pytest.raises(CommandError) as failed:
        call_command("reconcile", stdout=out)
    assert failed.value.returncode == 1 and "1 ledger discrepancies are open" in str(failed.value)
    printed = out.getvalue()
    assert f"{broken.pk} (stripe): disagree" in printed and f"{old.pk} (sandbox): agree" in printed
    assert "3 payments compared, 0 unreachable, 1 discrepancies open." in printed
    with pytest.raises(CommandError):
        call_command("reconcile", "--since", "last tuesday", stdout=io.StringIO())


def test_the_periodic_job_is_scheduled_and_reconciles(settings, gateways, stripe_fake) -> None:
    entry = settings.CELERY_BEAT_SCHEDULE["reconcile-ledgers"]
    assert entry["task"] in celery_app.tasks and entry["schedule"] == timedelta(seconds=3600)
    payment = stripe_payment(stripe_fake, 5_000)
    Payment.objects.filter(pk=payment.pk).update(amount_captured_minor=0, status=Payment.Status.AUTHORIZED)

    counts = celery_app.tasks[entry["task"]].delay().get()

    assert counts == {"checked": 1, "discrepancies": 1, "unreachable": 0, "unverifiable": 0}
    assert LedgerDiscrepancy.objects.get().kind == Kind.CAPTURE_MISMATCH


def test_a_run_reads_books_and_known_refunds_per_chunk_and_keeps_only_its_findings(settings) -> None:
    """Issue 31: 8-10 queries a payment and every check kept in memory (about 3 hours and all of it
    held, at 850,000 payments). The sandbox's books and our known refund ids are read once a
    chunk, the payments by keyset, and a run keeps the checks that found something."""
    agreeing = [make_payment(amount=1_000 + i) for i in range(6)]
    broken = make_payment(amount=5_000)
    Payment.objects.filter(pk=broken.pk).update(amount_captured_minor=4_000, amount_authorized_minor=4_000)
    heard: list[str] = []
    with CaptureQueriesContext(connection) as queries:
        run = reconciliation.reconcile(gateway="sandbox", chunk_size=3, progress=lambda c: heard.append(c.outcome))
    assert (run.checked, run.agreed, [c.payment_id for c in run.checks]) == (7, 6, [broken.pk])
    assert heard == ["agree"] * 6 + ["disagree"]
    sql = [q["sql"] for q in queries]
    # A chunk each, not a payment each; and the one that differs read again before its lock.
    assert sum('FROM "processors_sandboxcharge"' in q for q in sql) == 3 + 1
    assert sum('FROM "processors_sandboxrefund"' in q for q in sql) == 3 + 1
    ours = [q for q in sql if '"refundops_refund"."payment_id" IN' in q]
    assert len(ours) == 6 + 1  # a chunk's: the ids known to us before its books, our refunds after them
    chunks = [q for q in sql if q.startswith('SELECT "refundops_payment"') and q.endswith("LIMIT 3")]
    assert len(chunks) == 3 and len(agreeing) == 6
    # The payments whose books plainly agree take no lock; the one that differs is compared under it.
    assert sum("FOR UPDATE OF p" in q and "FROM refundops_payment p" in q for q in sql) == 1  # locks.lock_payment


def test_a_refund_failing_after_its_chunk_books_were_read_is_not_raised_as_paid(books: Books, settings) -> None:
    """Review of issue 31: a chunk's books are all read before the first of its payments is
    compared, so a book may be minutes old when its payment's turn comes. A refund pending at the
    gateway when the book was read, whose failure its webhook recorded before the comparison, was
    raised as paid-not-settled on the stale book's word: a false difference raised to a person."""
    settings.RECONCILE_GRACE_SECONDS = 600
    first = books.payment(10_000)
    settled_refund(books, first, 1_000)  # plainly agrees: compared (no lock) before the next one
    second = books.payment(10_000)
    Payment.objects.filter(pk=second.pk).update(created_at=first.created_at + timedelta(seconds=1))
    refund = our_refund(second, 2_000, RefundState.APPROVED)
    gateway_id = books.refund(second, 2_000, ours=refund)
    books.fail(gateway_id, "pending")
    Refund.objects.filter(pk=refund.pk).update(status=RefundState.SUBMITTED, processor_refund_id=gateway_id,
                                               updated_at=timezone.now() - timedelta(hours=1))

    def webhook_meanwhile(check: reconciliation.PaymentCheck) -> None:
        if check.payment_id == first.pk:  # the refund fails at the gateway; its webhook records it here
            books.fail(gateway_id, "failed")
            Refund.objects.filter(pk=refund.pk).update(status=RefundState.FAILED, updated_at=timezone.now())

    run = reconciliation.reconcile(chunk_size=2, progress=webhook_meanwhile)

    assert not LedgerDiscrepancy.objects.exists(), list(LedgerDiscrepancy.objects.values("kind", "detail"))
    assert (run.checked, [c.outcome for c in run.checks]) == (2, [])
    # Once the grace has passed, a refund failed here but paid there is still raised.
    Refund.objects.filter(pk=refund.pk).update(updated_at=timezone.now() - timedelta(hours=1))
    books.fail(gateway_id, "pending")
    assert [d.kind for c in reconciliation.reconcile().checks for d in c.discrepancies] == [Kind.PAID_NOT_SETTLED]


def test_a_refund_made_on_the_gateway_that_failed_after_its_chunk_books_were_read_is_not_recorded(
        books: Books) -> None:
    """Review of issue 31: a chunk's books are read before its first comparison (for Stripe and
    PayPal, one call each, 200 in a row: a minute before the first is compared). A refund made on
    the gateway directly, pending when the book was read and failed since, was recorded from the
    stale book as a refund of ours on its way: the ledger counted money the customer never got,
    and could cancel our own waiting refunds to make room. What goes the locked way (anything
    that may change our ledger) reads its book again just before the lock, as before chunks."""
    first = books.payment(10_000)
    settled_refund(books, first, 1_000)  # plainly agrees: compared (no lock) before the next one
    second = books.payment(10_000)
    Payment.objects.filter(pk=second.pk).update(created_at=first.created_at + timedelta(seconds=1))
    made_there = books.refund(second, 3_000, status="pending")

    def failed_meanwhile(check: reconciliation.PaymentCheck) -> None:
        if check.payment_id == first.pk:
            books.fail(made_there, "failed")

    run = reconciliation.reconcile(chunk_size=2, progress=failed_meanwhile)

    assert not Refund.objects.filter(payment=second).exists(), list(Refund.objects.filter(payment=second).values(
        "status", "processor_refund_id"))
    assert (run.checked, run.agreed, LedgerDiscrepancy.objects.count()) == (2, 2, 0)


def test_each_chunk_of_payments_starts_where_the_last_ended_in_the_index_not_at_its_start() -> None:
    """Review of issue 31: the keyset's ``created_at > t OR (created_at = t AND id > i)`` is no
    index bound to PostgreSQL: each chunk walked ``payment_created_order`` from the first payment
    and filtered out every one already compared (quadratic: about 1.8 billion index entries read
    over 850,000 payments in chunks of 200). The index condition must start the scan at ``t``."""
    for i in range(5):
        make_payment(amount=1_000 + i)
    with CaptureQueriesContext(connection) as queries:
        reconciliation.reconcile(chunk_size=2)
    later = [q["sql"] for q in queries if q["sql"].startswith('SELECT "refundops_payment"')
             and q["sql"].endswith("LIMIT 2") and "WHERE" in q["sql"]]
    assert len(later) == 2  # the chunks after the first
    with connection.cursor() as cursor:
        cursor.execute("SET LOCAL enable_seqscan = off")  # a plan as on a large table, not a 5-row one
        cursor.execute("EXPLAIN " + later[0])
        plan = "\n".join(row[0] for row in cursor.fetchall())
    assert "payment_created_order" in plan and "Index Cond: (created_at >=" in plan, plan
