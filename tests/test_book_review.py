"""Hostile review of the incomplete-book fixes (issue 27, findings 1, 3, 4): the paths around a
call whose answer was lost on a PayPal capture PayPal cannot list the refunds of. Through the
official PayPal SDK against the fake PayPal and the worker's own services."""

from __future__ import annotations

import json
import threading
from datetime import timedelta

import pytest
from django.db import connection, transaction
from django.test import Client
from django.urls import include, path

from processors.base import ProcessorUnavailable
from refundops.models import GatewayAttempt, Payment, LedgerDiscrepancy, Refund, RefundState
from refundops.services import attempts, payouts
from tests.conftest import make_customer, post
from tests.fakes.fixtures import PAYPAL_WEBHOOK_ID
from tests.fakes.paypal_server import FakePayPal
from tests.test_incomplete_books import orderless_paypal_payment, send_dispute_event

urlpatterns = [path("", include("refundops.urls")), path("webhooks/", include("refundops.webhook_urls"))]
pytestmark = [pytest.mark.urls(__name__), pytest.mark.django_db]
S = RefundState


def test_a_lost_answer_is_not_sent_again_once_paypal_no_longer_keeps_its_request_id(
        api, policy, gateways, paypal_fake: FakePayPal):
    """PayPal pays, the answer is lost, a dispute forbids sending again; the dispute is won after
    PayPal's 45 days of request ids. Sending the same PayPal-Request-Id then is a new refund."""
    payment = orderless_paypal_payment(paypal_fake, "50.00")
    refund_id = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 2_000,
                                              "reason": "customer_request"}).json()["refund"]["id"]
    paypal_fake.set_mode("drop_after", requests=1, path="/refund")  # PayPal pays; the answer is lost
    with pytest.raises(ProcessorUnavailable):
        payouts.submit_refund(refund_id=refund_id)
    dispute_id = paypal_fake.add_dispute(payment.processor_reference)
    send_dispute_event(paypal_fake, "CUSTOMER.DISPUTE.CREATED", dispute_id)
    try:
        payouts.submit_refund(refund_id=refund_id)  # looked up in vain; the dispute forbids a resend
    except ProcessorUnavailable:
        pass
    assert paypal_fake.refund_count == 1

    # Two months on: the dispute is won, and PayPal has long forgotten the request id.
    GatewayAttempt.objects.filter(refund_id=refund_id).update(
        started_at=payouts.timezone.now() - timedelta(days=60))
    paypal_fake.forget_request_ids()
    paypal_fake.resolve_dispute(dispute_id, "RESOLVED_SELLER_FAVOUR")
    send_dispute_event(paypal_fake, "CUSTOMER.DISPUTE.RESOLVED", dispute_id)
    try:  # the stalled sweep's retry
        payouts.submit_refund(refund_id=refund_id)
    except ProcessorUnavailable:
        pass

    assert paypal_fake.refund_count == 1  # the customer is refunded once
    refund = Refund.objects.get(pk=refund_id)
    assert refund.status == S.APPROVED  # may be paid: stays reserved, for a person
    assert LedgerDiscrepancy.objects.filter(refund_id=refund_id, kind=LedgerDiscrepancy.Kind.UNVERIFIABLE,
                                            status=LedgerDiscrepancy.Status.OPEN).exists()


def paypal_refund_event(fake: FakePayPal, processor_refund_id: str, event_id: str) -> dict:
    resource = {**fake.refunds[processor_refund_id]}
    resource.pop("refunded", None)
    resource.pop("capture_id", None)
    return {"id": event_id, "event_version": "1.0", "resource_type": "refund",
            "event_type": "PAYMENT.CAPTURE.REFUNDED", "summary": "A capture payment was refunded",
            "create_time": payouts.timezone.now().isoformat(), "resource": resource}


def test_a_late_and_a_repeated_refund_webhook_settle_a_book_incomplete_refund_once(
        api, policy, gateways, paypal_fake: FakePayPal):
    payment = orderless_paypal_payment(paypal_fake, "50.00")
    refund_id = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 2_000,
                                              "reason": "customer_request"}).json()["refund"]["id"]
    paypal_fake.set_mode("drop_after", requests=1, path="/refund")
    with pytest.raises(ProcessorUnavailable):
        payouts.submit_refund(refund_id=refund_id)
    dispute_id = paypal_fake.add_dispute(payment.processor_reference)
    send_dispute_event(paypal_fake, "CUSTOMER.DISPUTE.CREATED", dispute_id)
    try:
        payouts.submit_refund(refund_id=refund_id)
    except ProcessorUnavailable:
        pass
    assert GatewayAttempt.objects.get(refund_id=refund_id).error_code == "book_incomplete"
    [processor_refund_id] = paypal_fake.refunds

    for event_id in ("WH-LATE-1", "WH-LATE-1", "WH-LATE-2"):  # late, its redelivery, and a second copy
        event = paypal_refund_event(paypal_fake, processor_refund_id, event_id)
        headers = {f"HTTP_{k.upper().replace('-', '_')}": v
                   for k, v in paypal_fake.sign_webhook(event, webhook_id=PAYPAL_WEBHOOK_ID).items()}
        answer = Client().post("/webhooks/paypal/", data=json.dumps(event), content_type="application/json", **headers)
        assert answer.status_code == 200, answer.content
    payouts.submit_refund(refund_id=refund_id)  # the stalled sweep, after

    refund = Refund.objects.get(pk=refund_id)
    assert (refund.status, refund.processor_refund_id) == (S.SETTLED, processor_refund_id)
    assert set(GatewayAttempt.objects.filter(refund_id=refund_id).values_list("outcome", flat=True)) == {
        GatewayAttempt.Outcome.SUCCEEDED}
    payment.refresh_from_db()
    assert (payment.amount_refunded_minor, payment.amount_reserved_minor) == (2_000, 0)
    assert paypal_fake.refund_count == 1 and Refund.objects.filter(payment=payment).count() == 1


def test_a_worker_killed_mid_call_is_retried_after_the_extra_lease_and_pays_once(
        api, policy, gateways, paypal_fake: FakePayPal, settings):
    capture = paypal_fake.add_capture("50.00", "USD")  # with an order: a complete book
    payment = Payment.objects.create(
        customer=make_customer(), processor="paypal", processor_reference=capture, currency="USD",
        amount_authorized_minor=5_000, amount_captured_minor=5_000, status="captured",
        method_type="paypal", captured_at=payouts.timezone.now())
    refund_id = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 2_000,
                                              "reason": "customer_request"}).json()["refund"]["id"]
    refund = Refund.objects.get(pk=refund_id)
    with transaction.atomic():  # worker A opens its attempt, then is killed before calling PayPal
        attempt = attempts.open_attempt(Refund.objects.select_for_update().get(pk=refund_id))
    lease = timedelta(seconds=settings.GATEWAY_ATTEMPT_LEASE_SECONDS)

    GatewayAttempt.objects.filter(pk=attempt.pk).update(lease_until=payouts.timezone.now() - timedelta(seconds=1))
    with pytest.raises(attempts.RetryLater):  # within the extra lease: not proof, nothing sent
        payouts.submit_refund(refund_id=refund_id)
    assert paypal_fake.refund_count == 0

    GatewayAttempt.objects.filter(pk=attempt.pk).update(
        started_at=payouts.timezone.now() - 2 * lease - timedelta(seconds=31),
        lease_until=payouts.timezone.now() - lease - timedelta(seconds=1))
    refund = payouts.submit_refund(refund_id=refund_id)
    payouts.submit_refund(refund_id=refund_id)  # a duplicate task

    assert refund.status in (S.SUBMITTED, S.SETTLED) and paypal_fake.refund_count == 1
    assert GatewayAttempt.objects.get(pk=attempt.pk).outcome == GatewayAttempt.Outcome.ABSENT


@pytest.mark.django_db(transaction=True)
def test_two_sync_sweeps_at_once_take_different_refunds():
    """Sweep A holds the rows it took (not yet committed) while sweep B runs: B takes the next ones
    rather than waiting for A or taking A's."""
    from tests.test_forgotten_submitted import submitted_on_the_sandbox

    refunds = submitted_on_the_sandbox(6, ago=timedelta(days=1))
    taken: dict[str, list[str]] = {}
    a_holds, b_done = threading.Event(), threading.Event()

    def sweep_a() -> None:
        try:
            with transaction.atomic():
                taken["a"] = payouts.take_submitted_refunds_to_sync(older_than_seconds=60, limit=3)
                a_holds.set()
                b_done.wait(30)
        finally:
            connection.close()

    def sweep_b() -> None:
        try:
            a_holds.wait(30)
            taken["b"] = payouts.take_submitted_refunds_to_sync(older_than_seconds=60, limit=3)
        finally:
            b_done.set()
            connection.close()

    threads = [threading.Thread(target=sweep_a), threading.Thread(target=sweep_b)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    assert len(taken["a"]) == len(taken["b"]) == 3
    assert set(taken["a"]) | set(taken["b"]) == {r.pk for r in refunds}
    assert Refund.objects.filter(synced_at__isnull=True).count() == 0
    # the next sweep takes those asked least recently: A's (asked first), never a new ordering of B's
    assert set(payouts.take_submitted_refunds_to_sync(older_than_seconds=60, limit=3)) == set(taken["a"])


def test_reconcile_since_a_date_still_reports_a_submitted_refund_untouched_since_and_overdue(settings):
    """``reconcile --since`` compares payments with activity since then; a refund still submitted,
    which nothing has touched for days, is exactly the one to look at."""
    from refundops.services import reconciliation
    from tests.test_forgotten_submitted import submitted_on_the_sandbox

    settings.REFUND_SETTLEMENT_SECONDS = {**settings.REFUND_SETTLEMENT_SECONDS, "sandbox": 3600}
    [overdue] = submitted_on_the_sandbox(1, ago=timedelta(hours=3))
    Refund.objects.filter(pk=overdue.pk).update(updated_at=payouts.timezone.now() - timedelta(hours=3),
                                                created_at=payouts.timezone.now() - timedelta(hours=3))
    Payment.objects.filter(pk=overdue.payment_id).update(created_at=payouts.timezone.now() - timedelta(hours=4))

    reconciliation.reconcile(gateway="sandbox", since=payouts.timezone.now() - timedelta(hours=1))

    assert LedgerDiscrepancy.objects.filter(kind=LedgerDiscrepancy.Kind.SUBMITTED_OVERDUE,
                                            refund_id=overdue.pk).exists()
