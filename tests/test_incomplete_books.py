"""A gateway book that cannot list every refund never proves a refund absent (issue 27, finding 1).

PayPal lists a capture's refunds only with its order; a capture made without one is read with the
refunds we already know by id (``PaymentBook.complete`` false). A refund whose call's answer was
lost has no id of ours yet, so that book cannot show it, paid or not. Through the official PayPal
SDK against the fake PayPal, its signed dispute events and the worker's own services.
"""

from __future__ import annotations

import io
import json
from decimal import Decimal

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
from django.urls import include, path
from django.utils import timezone

from audit.models import AuditEntry
from processors.base import ProcessorUnavailable
from refundops.models import (
    GatewayAttempt,
    LedgerDiscrepancy,
    MerchantEndpoint,
    Payment,
    Refund,
    RefundState,
    WebhookDelivery,
)
from refundops.services import payouts
from tests.conftest import make_customer, post
from tests.fakes.fixtures import PAYPAL_WEBHOOK_ID
from tests.fakes.paypal_server import FakePayPal

urlpatterns = [path("", include("refundops.urls")), path("webhooks/", include("refundops.webhook_urls"))]
pytestmark = [pytest.mark.urls(__name__), pytest.mark.django_db]
S = RefundState


def orderless_paypal_payment(fake: FakePayPal, value: str) -> Payment:
    """A PayPal capture made before the Orders API: PayPal cannot list its refunds."""
    capture = fake.add_capture(value, "USD", with_order=False)
    minor = int(Decimal(value) * 100)
    return Payment.objects.create(
        customer=make_customer(), processor="paypal", processor_reference=capture, currency="USD",
        amount_authorized_minor=minor, amount_captured_minor=minor, status=Payment.Status.CAPTURED,
        method_type="paypal", captured_at=timezone.now())


def send_dispute_event(fake: FakePayPal, event_type: str, dispute_id: str) -> None:
    event = fake.dispute_event(event_type, dispute_id)
    headers = {f"HTTP_{k.upper().replace('-', '_')}": v
               for k, v in fake.sign_webhook(event, webhook_id=PAYPAL_WEBHOOK_ID).items()}
    answer = Client().post("/webhooks/paypal/", data=json.dumps(event), content_type="application/json", **headers)
    assert answer.status_code == 200, answer.content


def reconcile_paypal() -> tuple[int, dict]:
    out = io.StringIO()
    try:
        call_command("reconcile", "--gateway", "paypal", "--json", stdout=out)
        code = 0
    except CommandError as failed:
        code = failed.returncode
    return code, json.loads(out.getvalue())


def test_a_refund_paid_on_an_orderless_paypal_capture_whose_answer_was_lost_is_never_taken_for_absent(
        api, policy, gateways, paypal_fake: FakePayPal):
    endpoint = MerchantEndpoint.objects.create(url="https://merchant.example/hooks")
    payment = orderless_paypal_payment(paypal_fake, "50.00")
    answer = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 3_000,
                                           "reason": "customer_request"})
    assert answer.status_code == 201 and answer.json()["refund"]["status"] == S.APPROVED
    refund_id = answer.json()["refund"]["id"]
    paypal_fake.set_mode("drop_after", requests=1, path="/refund")  # PayPal pays; the answer is lost
    with pytest.raises(ProcessorUnavailable):
        payouts.submit_refund(refund_id=refund_id)
    assert GatewayAttempt.objects.get(refund_id=refund_id).outcome == GatewayAttempt.Outcome.UNKNOWN
    dispute_id = paypal_fake.add_dispute(payment.processor_reference)
    send_dispute_event(paypal_fake, "CUSTOMER.DISPUTE.CREATED", dispute_id)

    try:  # the retry: it looks PayPal up, and the book it gets cannot list the refund
        payouts.submit_refund(refund_id=refund_id)
    except ProcessorUnavailable:
        pass  # "not now" is an acceptable answer; a cancel is not
    paypal_fake.resolve_dispute(dispute_id, "RESOLVED_BUYER_FAVOUR")
    send_dispute_event(paypal_fake, "CUSTOMER.DISPUTE.RESOLVED", dispute_id)
    code, report = reconcile_paypal()

    [at_paypal] = paypal_fake.refunds.values()
    assert at_paypal["amount"] == {"currency_code": "USD", "value": "30.00"}  # the customer got 30.00
    refund = Refund.objects.get(pk=refund_id)
    assert refund.status != S.CANCELED
    assert S.CANCELED not in set(refund.history.values_list("status", flat=True))
    assert not GatewayAttempt.objects.filter(refund_id=refund_id, outcome=GatewayAttempt.Outcome.ABSENT).exists()
    assert GatewayAttempt.objects.filter(refund_id=refund_id, outcome=GatewayAttempt.Outcome.UNKNOWN).exists()
    assert not WebhookDelivery.objects.filter(endpoint=endpoint, event_type="refund.canceled").exists()
    assert not AuditEntry.objects.filter(action__in=("refund.canceled", "refund.attempt_absent"),
                                         subject_id=refund_id).exists()
    payment.refresh_from_db()
    assert payment.refundable_minor == 2_000  # the 30.00 stays reserved: it may be paid
    assert payment.paid_twice is True  # refunded (maybe) and the dispute lost: a person must look
    assert code == 1
    unverifiable = [d for d in report["discrepancies"] if d["kind"] == LedgerDiscrepancy.Kind.UNVERIFIABLE]
    assert [d["refund_id"] for d in unverifiable] == [refund_id]
    assert [c["payment_id"] for c in report["unverifiable"]] == [payment.pk]


def test_reconcile_says_an_orderless_paypal_capture_could_not_be_checked_rather_than_agree(
        gateways, paypal_fake: FakePayPal):
    payment = orderless_paypal_payment(paypal_fake, "50.00")

    code, report = reconcile_paypal()

    assert code == 0  # nothing of ours may be at PayPal unseen: no discrepancy, but no "agree" either
    assert [(c["payment_id"], c["gateway"]) for c in report["unverifiable"]] == [(payment.pk, "paypal")]
    assert "order" in report["unverifiable"][0]["why"]


def test_a_lost_answer_on_an_orderless_capture_is_sent_again_with_the_same_key_when_nothing_forbids_paying(
        api, policy, gateways, paypal_fake: FakePayPal):
    payment = orderless_paypal_payment(paypal_fake, "50.00")
    refund_id = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 3_000,
                                              "reason": "customer_request"}).json()["refund"]["id"]
    paypal_fake.set_mode("drop_after", requests=1, path="/refund")
    with pytest.raises(ProcessorUnavailable):
        payouts.submit_refund(refund_id=refund_id)

    refund = payouts.submit_refund(refund_id=refund_id)  # same PayPal-Request-Id: PayPal answers its refund

    assert refund.status in (S.SUBMITTED, S.SETTLED) and paypal_fake.refund_count == 1
    outcomes = set(GatewayAttempt.objects.filter(refund_id=refund_id).values_list("outcome", flat=True))
    assert outcomes == {GatewayAttempt.Outcome.SUCCEEDED}


def test_a_call_whose_worker_died_on_a_disputed_orderless_capture_marks_the_payment_paid_twice(
        api, policy, gateways, paypal_fake: FakePayPal):
    """The hostile review of c7fb027: a worker killed mid-call never reaches record_unknown_answer. Its
    live attempt, read later in a book that cannot list every refund, is marked unverifiable, and the
    payment is marked paid twice at that look-up ("answer unverifiable"). On cd99a16 it was marked
    one step later, when the call sent again with the same key (a person's refund) was answered
    "paid"; an automatic refund is not sent again and gets a discrepancy instead."""
    import time_machine
    from datetime import timedelta

    from approvals.models import ApprovalAuthority
    from approvals.services import approve_refund
    from django.conf import settings
    from django.contrib.auth.models import Permission, User
    from processors.base import RefundRequest
    from processors.registry import get_processor

    payment = orderless_paypal_payment(paypal_fake, "50.00")
    dispute_id = paypal_fake.add_dispute(payment.processor_reference)
    send_dispute_event(paypal_fake, "CUSTOMER.DISPUTE.CREATED", dispute_id)
    answer = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 3_000,
                                           "reason": "customer_request"})
    assert answer.status_code == 202
    refund_id = answer.json()["refund"]["id"]
    person = User.objects.create_user("approver-died", is_staff=True)
    person.user_permissions.add(Permission.objects.get(codename="approve_refund"))
    ApprovalAuthority.objects.create(user=person, currency="USD", max_amount_minor=100_000)
    approve_refund(refund_id=refund_id, approver=User.objects.get(pk=person.pk), note="knowingly")

    attempt, refund = payouts._open_attempt(refund_id, payment_id=payment.pk)  # the worker's first half
    get_processor("paypal", payment.processor_account).refund(RefundRequest(  # PayPal pays; the worker dies
        payment=payouts.payment_ref(refund.payment), amount=refund.money, reason=refund.reason,
        idempotency_key=attempt.idempotency_key, refund_id=refund.pk, verdict_id=refund.verdict_id or ""))
    assert len(paypal_fake.refunds) == 1
    later = timezone.now() + timedelta(seconds=3 * settings.GATEWAY_ATTEMPT_LEASE_SECONDS)
    with time_machine.travel(later, tick=False):
        try:
            payouts.submit_refund(refund_id=refund_id)  # the next worker looks it up in vain
        except ProcessorUnavailable:
            pass

    assert len(paypal_fake.refunds) == 1  # sent again with the same key: the same refund, paid once
    payment.refresh_from_db()
    assert payment.paid_twice is True
    assert AuditEntry.objects.get(action="payment.paid_twice", subject_id=payment.pk).data["why"] == \
        "answer unverifiable"
