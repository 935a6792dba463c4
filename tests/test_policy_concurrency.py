"""Running totals under races that mix who refunds: agents through the API and staff through the
service share the customer's and the global totals, exactly."""

from __future__ import annotations

import uuid

import pytest

from refundops.callers import Caller
from refundops.models import Refund
from refundops.services.refunds import request_refund
from tests.conftest import make_agent_key, make_customer, make_limits, make_payment, make_rules, make_staff, race
from tests.test_refund_concurrency import AMOUNT, counted, outcomes, refund

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("quiet_breaker")]


def staff_refund(user, payment_id: str) -> tuple[int, str]:
    answer = request_refund(caller=Caller.for_user(user), idempotency_key=uuid.uuid4().hex,
                            data={"transaction_id": payment_id, "amount": AMOUNT, "reason": "duplicate"})
    return answer.status, answer.body["refund"]["id"] if answer.status == 201 else answer.code


def test_agents_and_staff_racing_share_the_customer_and_global_totals_exactly():
    make_limits(customer_daily_amount_minor=6 * AMOUNT, global_daily_amount_minor=10 * AMOUNT)
    make_rules()
    customer = make_customer()
    users = [make_staff(f"finance-{i}") for i in range(24)]
    keys = [make_agent_key()[1] for _ in range(24)]
    mine = [make_payment(customer=customer).pk for _ in range(24)]  # 12 by agents, 12 by staff
    others = [make_payment().pk for _ in range(24)]  # other customers: only the global total binds

    def work(i: int) -> tuple[int, str]:
        payment = (mine if i < 24 else others)[i % 24]
        return refund(keys[i % 24], payment) if i % 2 else staff_refund(users[i % 24], payment)

    results = race(48, work)
    assert outcomes(results) == {"approved": 10, "DAILY_LIMIT_REACHED": 38}
    assert counted() == (10, 10 * AMOUNT)
    assert counted(payment__customer=customer)[1] <= 6 * AMOUNT
    assert Refund.objects.count() == 48  # refused requests are recorded too, whoever asked
