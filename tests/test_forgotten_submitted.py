"""Every submitted refund is looked at again on a schedule that reaches it (issue 27, finding 3).

A sweep's worth of refunds submitted days ago are still pending at the gateway (the issue's 500 with
the sweep's 500; here 10 with a sweep of 10, the same proof); a newer one failed there and its
webhook was lost. The periodic sync must come round to it, and reconcile must not skip submitted
refunds: one past its gateway's expected settlement time is a difference a person sees.
"""

from __future__ import annotations

import secrets
from datetime import timedelta

import pytest
from django.utils import timezone

from processors.models import SandboxCharge, SandboxRefund
from refundops import tasks
from refundops.models import LedgerDiscrepancy, MerchantEndpoint, Payment, Refund, RefundState, WebhookDelivery
from refundops.services import reconciliation
from tests.conftest import make_customer

pytestmark = pytest.mark.django_db
S = RefundState


def submitted_on_the_sandbox(count: int, *, ago: timedelta, status: str = "pending") -> list[Refund]:
    """``count`` refunds of 20.00 on payments of 50.00, submitted ``ago`` and ``status`` at the sandbox."""
    customer, now = make_customer(), timezone.now()
    charges = SandboxCharge.objects.bulk_create(
        SandboxCharge(reference=f"sbch_{secrets.token_hex(8)}", currency="USD", authorized_minor=5_000,
                      captured_minor=5_000, refunded_minor=2_000) for _ in range(count))
    payments = Payment.objects.bulk_create(
        Payment(customer=customer, processor="sandbox", processor_reference=charge.reference, currency="USD",
                amount_authorized_minor=5_000, amount_captured_minor=5_000, amount_reserved_minor=2_000,
                status=Payment.Status.CAPTURED, method_type="card", captured_at=now - ago - timedelta(hours=1))
        for charge in charges)
    gateway_refunds = SandboxRefund.objects.bulk_create(
        SandboxRefund(reference=f"sbre_{secrets.token_hex(8)}", charge=charge, amount_minor=2_000, currency="USD",
                      idempotency_key=f"seed:{secrets.token_hex(8)}", status=status,
                      settles_at=now + timedelta(days=30)) for charge in charges)
    return Refund.objects.bulk_create(
        Refund(payment=payment, amount_minor=2_000, currency="USD", reason="customer_request", status=S.SUBMITTED,
               processor_refund_id=gateway_refund.reference, submitted_at=now - ago)
        for payment, gateway_refund in zip(payments, gateway_refunds))


def test_a_newer_refund_failed_at_the_gateway_behind_a_sweeps_worth_of_old_pending_ones_is_reached():
    endpoint = MerchantEndpoint.objects.create(url="https://merchant.example/hooks")
    sweep = 10
    submitted_on_the_sandbox(sweep, ago=timedelta(days=3))
    [newer] = submitted_on_the_sandbox(1, ago=timedelta(hours=1), status="failed")  # its webhook was lost

    for _ in range(3):  # the three sweeps; the newer one's turn comes in the second
        tasks.sync_submitted_refunds(limit=sweep)
        newer.refresh_from_db()
        if newer.status != S.SUBMITTED:
            break

    newer.refresh_from_db()
    assert newer.status == S.FAILED
    payment = Payment.objects.get(pk=newer.payment_id)
    assert (payment.amount_reserved_minor, payment.refundable_minor) == (0, 5_000)
    assert WebhookDelivery.objects.filter(endpoint=endpoint, event_type="refund.failed",
                                          payload__data__object__id=newer.pk).count() == 1


def test_reconcile_reports_a_submitted_refund_past_its_gateways_settlement_time(settings):
    settings.REFUND_SETTLEMENT_SECONDS = {**settings.REFUND_SETTLEMENT_SECONDS, "sandbox": 3600}
    [overdue] = submitted_on_the_sandbox(1, ago=timedelta(hours=2))
    [fresh] = submitted_on_the_sandbox(1, ago=timedelta(minutes=30))

    outcomes: dict[str, str] = {}
    reconciliation.reconcile(gateway="sandbox", progress=lambda check: outcomes.update({check.payment_id: check.outcome}))

    found = LedgerDiscrepancy.objects.get(kind=LedgerDiscrepancy.Kind.SUBMITTED_OVERDUE)
    assert (found.refund_id, found.payment_id, found.status) == (overdue.pk, overdue.payment_id, "open")
    assert "pending" in found.detail
    assert (outcomes[overdue.payment_id], outcomes[fresh.payment_id]) == ("disagree", "agree")


def test_reconcile_records_the_gateways_final_word_on_a_refund_still_submitted_here():
    endpoint = MerchantEndpoint.objects.create(url="https://merchant.example/hooks")
    [failed] = submitted_on_the_sandbox(1, ago=timedelta(hours=1), status="failed")
    Refund.objects.filter(pk=failed.pk).update(updated_at=timezone.now() - timedelta(hours=1))

    reconciliation.reconcile(gateway="sandbox")

    failed.refresh_from_db()
    assert failed.status == S.FAILED
    assert Payment.objects.get(pk=failed.payment_id).refundable_minor == 5_000
    assert WebhookDelivery.objects.filter(endpoint=endpoint, event_type="refund.failed").count() == 1
