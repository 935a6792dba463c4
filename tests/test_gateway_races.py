"""Races on the money path between the gateway's news and our own writers, on real PostgreSQL.

Every thread has its own connection (closed at its end), all start at once behind a barrier, and
the invariants are read back from the database afterwards. Gateways are the fakes, over sockets;
approved refunds are paid on commit in the requesting thread (Celery is eager here; the broker,
its queues and countdowns are exercised with a real worker in tests/test_worker_queues.py).
"""

from __future__ import annotations

import time
import uuid

import pytest
from django.db.models import Sum
from django.test import Client
from django.urls import include, path
from rest_framework.test import APIClient

from audit.models import AuditEntry, Verdict
from processors.base import RefundRequest, RefundResult
from processors.models import InboundEvent
from processors.money import Money
from processors.registry import get_processor
from refundops.models import COUNTING_STATES, Payment, Refund, RefundState
from refundops.services import payouts
from tests.conftest import make_agent_key, make_customer, make_limits, make_rules, race
from tests.fakes.fixtures import post_stripe_event, stripe_event, stripe_payment
from tests.fakes.stripe_server import FakeStripe

urlpatterns = [path("", include("refundops.urls")), path("webhooks/", include("refundops.webhook_urls"))]
pytestmark = [pytest.mark.urls(__name__), pytest.mark.django_db(transaction=True),
              pytest.mark.usefixtures("quiet_breaker")]

AGENTS = 16
AMOUNT = 1_000


def dashboard_refund(payment: Payment, amount: int) -> str:
    """A refund made in Stripe's dashboard: no metadata of ours, a key we never used."""
    result = get_processor("stripe").refund(RefundRequest(
        payment=payouts.payment_ref(payment), amount=Money(amount, payment.currency), reason="customer_request",
        idempotency_key=f"dashboard-{time.time_ns()}", refund_id="", verdict_id=""))
    return result.processor_refund_id


def refund_event(fake: FakeStripe, refund_id: str, event_type: str = "charge.refund.updated") -> dict:
    with fake.lock:
        obj = {**fake.refunds[refund_id], "metadata": dict(fake.refunds[refund_id].get("metadata") or {})}
    return stripe_event(event_type, obj)


def assert_amounts_consistent(payment: Payment) -> int:
    """The payment's kept amounts are its counting refunds' sum, within what was captured."""
    payment.refresh_from_db()
    counted = Refund.objects.filter(payment=payment, status__in=COUNTING_STATES) \
        .aggregate(s=Sum("amount_minor", default=0))["s"]
    assert payment.amount_refunded_minor + payment.amount_reserved_minor == counted
    assert counted <= payment.amount_captured_minor
    return counted


def test_an_external_refund_racing_agents_is_counted_by_every_decision_after_it(gateways, stripe_fake):
    limit, external = 6_000, 3_000
    make_limits(customer_daily_amount_minor=limit)
    make_rules()
    customer = make_customer()
    payment = stripe_payment(stripe_fake, 10_000, customer=customer)
    # Half the agents refund another payment of the customer's: only the customer's running
    # total, not the payment's row lock, stands between them and the external refund.
    other = stripe_payment(stripe_fake, 10_000, customer=customer)
    dashboard = dashboard_refund(payment, external)
    event = refund_event(stripe_fake, dashboard)
    keys = [make_agent_key()[1] for _ in range(AGENTS)]

    def work(i: int) -> int | tuple[int, str]:
        if i == AGENTS:
            return post_stripe_event(Client(), event).status_code
        client = APIClient()
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {keys[i]}")
        target = payment if i % 2 else other
        answer = client.post("/api/v1/refunds", {"transaction_id": target.pk, "amount": AMOUNT,
                                                 "reason": "customer_request"},
                             format="json", HTTP_IDEMPOTENCY_KEY=uuid.uuid4().hex)
        return answer.status_code, answer.json().get("error", {}).get("code", "")

    answers = race(AGENTS + 1, work)

    assert answers[AGENTS] == 200
    assert Refund.objects.filter(payment=payment, origin=Refund.Origin.EXTERNAL,
                                 processor_refund_id=dashboard, status=RefundState.SETTLED).count() == 1
    approved = Verdict.objects.filter(operation="refund.create", payment_id__in=(payment.pk, other.pk),
                                      outcome=Verdict.Outcome.APPROVED)
    seen = sorted(v.totals["customer_day_minor"] for v in approved)
    # Decisions are serialised with the external refund's recording: each saw every refund before
    # it, so the totals seen run 0, 1000, … and jump by the external amount once, after the k-th.
    assert any(seen == [AMOUNT * i + (external if i >= k else 0) for i in range(len(seen))]
               for k in range(len(seen) + 1)), seen
    assert all(total + AMOUNT <= limit for total in seen)
    assert (len(seen) + 1) * AMOUNT + external > limit  # refused only once the limit was really full
    assert sorted(answers[:AGENTS]) == [(201, "")] * len(seen) + [(422, "DAILY_LIMIT_REACHED")] * (AGENTS - len(seen))
    assert Refund.objects.filter(payment__customer=customer, origin=Refund.Origin.AGENT,
                                 status=RefundState.SETTLED).count() == len(seen)
    assert assert_amounts_consistent(payment) + assert_amounts_consistent(other) == external + AMOUNT * len(seen)


def test_one_event_delivered_eight_times_at_once_is_applied_once(gateways, stripe_fake):
    payment = stripe_payment(stripe_fake, 10_000)
    dashboard = dashboard_refund(payment, 2_500)
    event = refund_event(stripe_fake, dashboard)

    answers = race(8, lambda i: post_stripe_event(Client(), event))

    assert [a.status_code for a in answers] == [200] * 8
    assert sorted(a.json()["duplicate"] for a in answers) == [False] + [True] * 7
    inbound = InboundEvent.objects.get(event_id=event["id"])
    assert inbound.deliveries == 8 and inbound.applied_at is not None
    external = Refund.objects.get(payment=payment)
    assert (external.origin, external.processor_refund_id, external.amount_minor) == (
        Refund.Origin.EXTERNAL, dashboard, 2_500)
    assert AuditEntry.objects.filter(action="refund.external_recorded").count() == 1
    assert Verdict.objects.filter(operation="refund.external").count() == 1
    assert assert_amounts_consistent(payment) == 2_500


def test_a_refund_failed_event_racing_the_workers_success_ends_as_the_gateway_says(gateways, stripe_fake):
    payment = stripe_payment(stripe_fake, 10_000)
    kept = Refund.objects.create(payment=payment, amount_minor=AMOUNT, currency="USD", reason="duplicate",
                                 status=RefundState.APPROVED)
    assert payouts.submit_refund(refund_id=kept.pk).status == RefundState.SETTLED
    for _ in range(5):  # a few rounds, so the interleavings vary
        refund = Refund.objects.create(payment=payment, amount_minor=AMOUNT, currency="USD", reason="duplicate",
                                       status=RefundState.APPROVED)
        answer = worker_call(refund)  # the gateway said succeeded; the worker has yet to record it
        stripe_fake.set_refund_status(answer.processor_refund_id, "failed")
        event = refund_event(stripe_fake, answer.processor_refund_id, "refund.failed")

        def work(i: int, refund_id: str = refund.pk, answer: RefundResult = answer,
                 event: dict = event) -> str | int:
            if i == 0:
                return payouts.record_gateway_result(refund_id=refund_id, result=answer).status
            return post_stripe_event(Client(), event).status_code

        first = race(2, work)[1]
        if first == 503:  # the event came before the worker's record: Stripe sends it again
            assert post_stripe_event(Client(), event).status_code == 200

        refund.refresh_from_db()
        truth = get_processor("stripe").fetch_refund(answer.processor_refund_id)
        assert (truth.status, refund.status, refund.processor_refund_id) == (
            "failed", RefundState.FAILED, answer.processor_refund_id)
    assert assert_amounts_consistent(payment) == AMOUNT


def worker_call(refund: Refund) -> RefundResult:
    """The worker's own gateway call for ``refund``, as submit_refund makes it."""
    request = RefundRequest(payment=payouts.payment_ref(refund.payment), amount=refund.money, reason=refund.reason,
                            idempotency_key=payouts.gateway_idempotency_key(refund), refund_id=refund.pk,
                            verdict_id="")
    return get_processor("stripe").refund(request)
