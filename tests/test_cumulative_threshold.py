"""Splitting a refund does not beat the approval threshold.

The threshold applies to what agents already refunded on the same payment, and to the same
customer within the limits' cumulative window, plus the new amount. The refund that crosses it is
held with APPROVAL_REQUIRED_CUMULATIVE, and so is every later one (a held refund reserves its
amount). Sequential and racing, on one payment and across one customer's payments: the refunds an
agent moved without a person never add up past the threshold.
"""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest
from django.db.models import Sum
from django.utils import timezone
from rest_framework.test import APIClient

from audit.models import Verdict
from refundops.callers import Caller
from refundops.models import Refund
from refundops.services.refunds import request_refund
from tests.conftest import make_agent_key, make_customer, make_limits, make_payment, make_rules, make_staff, race

THRESHOLD = 20_000  # 200.00 USD, as in the demo
# (refunds, each amount): 450.00 split in two (each 150.00 is under the threshold alone), three and ten.
SPLITS = [(2, 15_000), (3, 15_000), (10, 4_500)]


def client_for(raw_key: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw_key}")
    return client


def ask(raw_key: str, payment_id: str, amount: int) -> dict:
    response = client_for(raw_key).post(
        "/api/v1/refunds", {"transaction_id": payment_id, "amount": amount, "reason": "customer_request"},
        format="json", HTTP_IDEMPOTENCY_KEY=uuid.uuid4().hex)
    assert response.status_code in (201, 202), response.json()
    return response.json()


def targets(scope: str, n: int, amount: int) -> list[str]:
    """Where the n refunds go: all on one payment, or one on each of one customer's n payments."""
    if scope == "payment":
        return [make_payment(amount=n * amount).pk] * n
    customer = make_customer()
    return [make_payment(amount=amount, customer=customer).pk for _ in range(n)]


def approved_without_a_person() -> int:
    return Refund.objects.filter(hold_reasons=[], status__in=("approved", "submitted", "settled")).aggregate(
        s=Sum("amount_minor", default=0))["s"]


def expect(bodies: list[dict], n: int, amount: int) -> None:
    alone = THRESHOLD // amount  # how many fit under the threshold together
    statuses = sorted(b["refund"]["status"] for b in bodies)
    assert statuses.count("held") == n - alone, statuses
    for body in bodies:
        if body["refund"]["status"] == "held":
            assert body["hold_reasons"] == ["APPROVAL_REQUIRED_CUMULATIVE"]
    assert approved_without_a_person() == alone * amount <= THRESHOLD


@pytest.fixture
def threshold(db):
    make_limits(approval_threshold_minor=THRESHOLD)
    make_rules()


@pytest.mark.django_db
@pytest.mark.usefixtures("threshold", "quiet_breaker")
@pytest.mark.parametrize("scope", ["payment", "customer"])
@pytest.mark.parametrize(("n", "amount"), SPLITS)
def test_sequential_splits_are_held_once_they_add_up_past_the_threshold(scope, n, amount):
    _, raw = make_agent_key()
    bodies = [ask(raw, payment_id, amount) for payment_id in targets(scope, n, amount)]
    expect(bodies, n, amount)
    alone = THRESHOLD // amount
    assert [b["refund"]["status"] for b in bodies[:alone]] == ["approved"] * alone
    # The verdict shows the amounts that added up.
    crossing = Verdict.objects.get(pk=bodies[alone]["verdict"]["id"])
    check = next(c for c in crossing.checks if c["name"] == "approval_threshold_cumulative")
    assert check["result"] == "hold" and check["limit"] == THRESHOLD
    assert check["inputs"]["amount"] == amount
    assert check["inputs"][f"agents_on_{scope}"] == alone * amount
    assert check["observed"] == (alone + 1) * amount
    assert check["message"].startswith(f"{alone * amount / 100:,.2f} USD already refunded by agents")


@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("threshold", "quiet_breaker")
@pytest.mark.parametrize("scope", ["payment", "customer"])
@pytest.mark.parametrize(("n", "amount"), SPLITS)
def test_racing_agents_cannot_split_around_the_threshold(scope, n, amount):
    where = targets(scope, n, amount)
    keys = [make_agent_key()[1] for _ in range(n)]  # n different agents, all at once
    bodies = race(n, lambda i: ask(keys[i], where[i], amount))
    expect(bodies, n, amount)


@pytest.mark.django_db
@pytest.mark.usefixtures("quiet_breaker")
def test_the_customer_window_is_finances_and_the_payment_counts_whatever_its_age():
    make_limits(approval_threshold_minor=THRESHOLD, cumulative_window_hours=24)
    make_rules()
    _, raw = make_agent_key()
    customer = make_customer()
    old, other = make_payment(amount=50_000, customer=customer), make_payment(amount=50_000, customer=customer)
    first = ask(raw, old.pk, 15_000)
    Refund.objects.filter(pk=first["refund"]["id"]).update(counted_at=timezone.now() - timedelta(hours=25))

    # Outside the 24 hours for the customer: another payment of theirs starts from zero...
    assert ask(raw, other.pk, 6_000)["refund"]["status"] == "approved"
    # ...but on the same payment, what agents refunded counts however long ago.
    on_payment = ask(raw, old.pk, 6_000)
    assert on_payment["hold_reasons"] == ["APPROVAL_REQUIRED_CUMULATIVE"]

    # Finance widens the window to 48 hours: the old refund counts for the customer again.
    make_limits(approval_threshold_minor=THRESHOLD, cumulative_window_hours=48)
    third = make_payment(amount=50_000, customer=customer)
    held = ask(raw, third.pk, 1_000)
    assert held["hold_reasons"] == ["APPROVAL_REQUIRED_CUMULATIVE"]
    check = next(c for c in Verdict.objects.get(pk=held["verdict"]["id"]).checks
                 if c["name"] == "approval_threshold_cumulative")
    # 150.00 a day ago, 60.00 approved, 60.00 held (reserved): 270.00, then 10.00 more.
    assert check["inputs"] == {"amount": 1_000, "agents_on_payment": 0, "agents_on_customer": 27_000,
                               "window_hours": 48}


@pytest.mark.django_db
@pytest.mark.usefixtures("threshold", "quiet_breaker")
def test_a_person_refunding_does_not_use_up_what_agents_may_move():
    payment = make_payment(amount=50_000)
    staff = make_staff("finance-1")
    staff_answer = request_refund(caller=Caller.for_user(staff), idempotency_key=uuid.uuid4().hex,
                                  data={"transaction_id": payment.pk, "amount": 15_000, "reason": "duplicate"})
    assert staff_answer.status == 201
    _, raw = make_agent_key()
    assert ask(raw, payment.pk, 15_000)["refund"]["status"] == "approved"
    assert ask(raw, payment.pk, 6_000)["hold_reasons"] == ["APPROVAL_REQUIRED_CUMULATIVE"]


@pytest.mark.django_db
@pytest.mark.usefixtures("threshold", "quiet_breaker")
def test_a_single_refund_over_the_threshold_keeps_its_own_reason():
    _, raw = make_agent_key()
    assert ask(raw, make_payment(amount=50_000).pk, 25_000)["hold_reasons"] == ["APPROVAL_REQUIRED"]


@pytest.mark.django_db
@pytest.mark.usefixtures("threshold", "quiet_breaker")
def test_the_dry_run_tells_an_agent_the_split_would_be_held():
    _, raw = make_agent_key()
    payment = make_payment(amount=50_000)
    ask(raw, payment.pk, 15_000)
    response = client_for(raw).post("/api/v1/refunds/check", {"transaction_id": payment.pk, "amount": 15_000,
                                                               "reason": "customer_request"},
                                    format="json", HTTP_IDEMPOTENCY_KEY=uuid.uuid4().hex)
    assert response.status_code == 200
    assert (response.json()["would_be"], response.json()["verdict"]["hold_reasons"]) == (
        "held", ["APPROVAL_REQUIRED_CUMULATIVE"])
