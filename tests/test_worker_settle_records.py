"""What the worker writes when one answer moves a refund twice (issue 31 saves both moves at once):
each move's history row carries that move's state, in order, as simple-history would write it; one
webhook per move; and the audit entry vouches for the rows as stored (verify_audit)."""

from __future__ import annotations

import pytest

from audit.chain import seal, verify_chain
from audit.models import AuditEntry, Verdict
from processors.base import RefundResult
from processors.money import Money
from refundops.models import MerchantEndpoint, Refund, RefundState, WebhookDelivery
from refundops.services import payouts
from refundops.services.refunds import sync_payment_amounts
from tests.conftest import make_payment

S = RefundState


@pytest.mark.django_db
@pytest.mark.parametrize("before", [S.FAILED, S.CANCELED, S.APPROVED])
def test_a_success_moving_a_refund_twice_writes_each_move_its_history_webhook_and_a_verifying_entry(before, policy):
    payment = make_payment(amount=5_000)
    verdict = Verdict.objects.create(operation="refund.create", outcome="approved",
                                     request={"zé": 1.0, "b": {"y": [1, 2.5], "a": None}})
    refund = Refund.objects.create(payment=payment, amount_minor=1_000, currency="USD", reason="duplicate",
                                   status=before, verdict=verdict, hold_reasons=["ünïcode", {"k": 2.0}],
                                   failure_code="gw_x" if before != S.APPROVED else "",
                                   failure_message="déclinée\r\n" if before != S.APPROVED else "")
    sync_payment_amounts(payment)
    MerchantEndpoint.objects.create(url="https://merchant.example/hooks")
    result = RefundResult(processor_refund_id="sbre_twice", status="succeeded", amount=Money(1_000, "USD"))

    refund = payouts.record_gateway_result(refund_id=refund.pk, result=result)

    assert refund.status == S.SETTLED
    first, second = list(refund.history.order_by("history_date", "history_id"))[-2:]
    assert (first.status, first.processor_refund_id, first.settled_at, first.failure_code) == (
        S.SUBMITTED, "sbre_twice", None, "")
    assert first.submitted_at == refund.submitted_at and first.history_type == second.history_type == "~"
    assert (second.status, second.settled_at) == (S.SETTLED, refund.settled_at)
    assert first.history_user is None and second.history_user is None
    assert first.history_date <= second.history_date
    # every tracked field of the last row is the refund as stored
    stored = Refund.objects.get(pk=refund.pk)
    for field in Refund._meta.concrete_fields:
        assert getattr(second, field.attname) == getattr(stored, field.attname), field.attname
    events = list(WebhookDelivery.objects.filter(payload__data__object__id=refund.pk).order_by("created_at")
                  .values_list("event_type", "payload__data__previous_status"))
    assert events == [("refund.submitted", before), ("refund.settled", "submitted")]
    entry = AuditEntry.objects.get(subject_id=refund.pk, action__in=("refund.reinstated", "refund.settled"))
    assert {r["pk"] for r in entry.records if r["model"] == "refundops.historicalrefund"} == {second.pk}
    seal()
    assert list(verify_chain())[-1][2] == "ok"
