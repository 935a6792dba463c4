"""A change reason longer than simple-history keeps (100 characters) is cut to fit, never fails the
act, also where the refund's history rows are written by hand rather than by simple-history's
post_save (which sends the pre_create_historical_record signal that audit.history cuts it in)."""

from __future__ import annotations

import pytest
from rest_framework.test import APIClient

from processors.base import RefundResult
from processors.money import Money
from refundops.models import Refund, RefundState
from refundops.services import payouts
from refundops.services.refunds import sync_payment_amounts
from tests.conftest import make_agent_key, make_payment, post


@pytest.mark.django_db
def test_an_agent_with_a_long_name_may_refund_and_its_history_reason_is_cut_to_fit(policy):
    key, raw = make_agent_key(name="Customer support refunds assistant, Europe and the Americas, night shift")
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    response = post(client, "/api/v1/refunds", {"transaction_id": make_payment().pk, "amount": 100,
                                                 "reason": "duplicate"})
    assert response.status_code in (200, 201), response.content[:300]
    reasons = list(Refund.objects.get(pk=response.json()["refund"]["id"]).history
                   .order_by("history_date", "history_id").values_list("history_change_reason", flat=True))
    assert len(reasons[0]) == 100 and reasons[0].startswith("requested by agent:") and reasons[0].endswith("…")


@pytest.mark.django_db
def test_the_worker_records_a_long_gateway_refund_id_and_cuts_its_history_reason_to_fit(policy):
    payment = make_payment(amount=5_000)
    refund = Refund.objects.create(payment=payment, amount_minor=1_000, currency="USD", reason="duplicate",
                                   status=RefundState.CANCELED)
    sync_payment_amounts(payment)
    long_id = "re_" + "9" * 90  # the field keeps 100; the reason names it after 44 characters of its own
    result = RefundResult(processor_refund_id=long_id, status="succeeded", amount=Money(1_000, "USD"))

    refund = payouts.record_gateway_result(refund_id=refund.pk, result=result)

    assert (refund.status, refund.processor_refund_id) == (RefundState.SETTLED, long_id)
    first, second = list(refund.history.order_by("history_date", "history_id"))[-2:]
    assert len(first.history_change_reason) == 100 and first.history_change_reason.endswith("…")
    assert second.history_change_reason == "system:worker: gateway reported success"
