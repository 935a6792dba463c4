"""Review of issue 28, finding 3, under concurrency: people refunding at once around the cumulative
threshold do not all pass it, on one payment or across one customer's payments."""

from __future__ import annotations

import pytest

from refundops.callers import Caller
from refundops.models import Refund, RefundState
from refundops.services.refunds import request_refund
from tests.conftest import make_limits, make_payment, make_rules, make_staff, race

THRESHOLD = 20_000  # 200.00 USD: two 100.00 refunds reach it, a third passes it


@pytest.fixture
def policy(transactional_db):
    make_limits(approval_threshold_minor=THRESHOLD)
    make_rules()


@pytest.mark.parametrize("spread", ["one payment", "one customer"])
@pytest.mark.usefixtures("policy", "quiet_breaker")
def test_four_people_refunding_100_at_once_approve_two_and_hold_two(spread: str):
    people = [make_staff(f"person{i}") for i in range(4)]
    first = make_payment(amount=100_000)
    payments = [first] * 4 if spread == "one payment" else [
        first, *(make_payment(amount=100_000, customer=first.customer) for _ in range(3))]

    def work(i: int) -> int:
        return request_refund(caller=Caller.for_user(people[i]), idempotency_key=f"k{i}",
                              data={"transaction_id": payments[i].pk, "amount": 10_000,
                                    "reason": "customer_request"}).status

    assert sorted(race(4, work)) == [201, 201, 202, 202]
    held = Refund.objects.filter(status=RefundState.HELD)
    assert all("APPROVAL_REQUIRED_CUMULATIVE" in r.hold_reasons for r in held)
