"""Racing agents on real PostgreSQL: limits hold exactly, not by one refund over.

Every thread has its own connection and API client, all start at once behind a barrier, and the
invariant is read back from the database afterwards. Approved refunds are paid through the
sandbox on commit in the requesting thread (Celery is eager here; a real worker on the broker runs
in tests/test_worker_queues.py and the outage tests).
"""

from __future__ import annotations

import uuid
from collections import Counter

import pytest
from django.db.models import Sum
from rest_framework.test import APIClient

from audit.models import Verdict
from refundops.models import COUNTING_STATES, Agent, AgentKey, Payment, Refund
from refundops.access import generate_key
from tests.conftest import make_agent_key, make_customer, make_limits, make_payment, make_rules, race

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("quiet_breaker")]

AMOUNT = 1_000


def client_for(raw_key: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw_key}")
    return client


def refund(raw_key: str, payment_id: str, amount: int = AMOUNT, *, key: str | None = None) -> tuple[int, str]:
    response = client_for(raw_key).post(
        "/api/v1/refunds", {"transaction_id": payment_id, "amount": amount, "reason": "customer_request"},
        format="json", HTTP_IDEMPOTENCY_KEY=key or uuid.uuid4().hex)
    body = response.json()
    return response.status_code, body["refund"]["id"] if response.status_code == 201 else body["error"]["code"]


def counted(**filters) -> tuple[int, int]:
    refunds = Refund.objects.filter(status__in=COUNTING_STATES, **filters)
    return refunds.count(), refunds.aggregate(s=Sum("amount_minor", default=0))["s"]


def outcomes(results: list[tuple[int, str]]) -> Counter:
    return Counter(code if status != 201 else "approved" for status, code in results)


def test_64_agents_racing_on_one_customers_daily_amount_pass_it_by_not_one_refund():
    make_limits(customer_daily_amount_minor=10 * AMOUNT)
    make_rules()
    customer = make_customer()
    payments = [make_payment(customer=customer).pk for _ in range(64)]
    keys = [make_agent_key()[1] for _ in range(64)]
    results = race(64, lambda i: refund(keys[i], payments[i]))
    assert outcomes(results) == {"approved": 10, "DAILY_LIMIT_REACHED": 54}
    assert counted(payment__customer=customer) == (10, 10 * AMOUNT)
    # Decisions taken before the lock and overturned under it leave nothing behind: one verdict
    # and one refund per request, each naming the other, denied ones included.
    verdicts = {v.refund_id: v for v in Verdict.objects.filter(operation="refund.create")}
    refunds = Refund.objects.filter(payment__customer=customer)
    assert len(verdicts) == refunds.count() == 64
    for r in refunds:  # approved ones may have been paid by now (eager Celery)
        assert verdicts[r.pk].id == r.verdict_id
        assert verdicts[r.pk].outcome == ("denied" if r.status == "denied" else "approved")


def test_64_agents_racing_on_the_global_daily_amount_pass_it_by_not_one_refund():
    make_limits(global_daily_amount_minor=10 * AMOUNT)
    make_rules()
    payments = [make_payment().pk for _ in range(64)]  # 64 customers
    keys = [make_agent_key()[1] for _ in range(64)]
    results = race(64, lambda i: refund(keys[i], payments[i]))
    assert outcomes(results) == {"approved": 10, "DAILY_LIMIT_REACHED": 54}
    assert counted() == (10, 10 * AMOUNT)


def test_64_requests_of_one_agent_through_many_keys_pass_its_hourly_amount_by_not_one_refund():
    make_limits(agent_hourly_amount_minor=10 * AMOUNT)
    make_rules()
    agent = Agent.objects.create(name="busy-agent", capabilities=["refunds.create"])
    keys = []
    for _ in range(8):
        raw, prefix, digest = generate_key()
        AgentKey.objects.create(agent=agent, prefix=prefix, key_hash=digest)
        keys.append(raw)
    payments = [make_payment().pk for _ in range(64)]
    results = race(64, lambda i: refund(keys[i % 8], payments[i]))
    assert outcomes(results) == {"approved": 10, "DAILY_LIMIT_REACHED": 54}
    assert counted(agent=agent) == (10, 10 * AMOUNT)


def test_32_partial_refunds_racing_on_one_payment_never_exceed_what_was_captured():
    make_limits()
    make_rules()
    payment = make_payment(amount=10_000)
    keys = [make_agent_key()[1] for _ in range(32)]
    results = race(32, lambda i: refund(keys[i], payment.pk, 700))
    assert outcomes(results) == {"approved": 14, "AMOUNT_EXCEEDS_REFUNDABLE": 18}
    assert counted(payment=payment) == (14, 9_800)
    payment = Payment.objects.get(pk=payment.pk)
    assert payment.amount_refunded_minor + payment.amount_reserved_minor == 9_800


def test_32_identical_requests_with_one_idempotency_key_make_exactly_one_refund():
    make_limits()
    make_rules()
    payment = make_payment(amount=10_000)
    _, raw = make_agent_key()
    results = race(32, lambda i: refund(raw, payment.pk, 700, key="same-key"))
    assert {status for status, _ in results} == {201}
    assert len({rf for _, rf in results}) == 1
    assert counted(payment=payment) == (1, 700)
    assert Refund.objects.filter(payment=payment).count() == 1
