"""A gateway down, unreachable, slow or rate limiting: refunds stay approved, the worker backs off
(never sooner than Retry-After), a per-gateway breaker stops calling it for a while, operators see
the backlog, and when it is back every refund is paid exactly once."""

from __future__ import annotations

import time

import pytest

from processors import breaker
from processors.base import ProcessorUnavailable
from refundops import tasks
from refundops.models import Refund, RefundState
from refundops.services import payouts
from tests.conftest import make_payment, post
from tests.fakes.fixtures import stripe_payment, wait_for
from tests.fakes.stripe_server import FakeStripe

S = RefundState


def approved_refund(payment, amount: int = 1_000) -> Refund:
    return Refund.objects.create(payment=payment, amount_minor=amount, currency=payment.currency,
                                 reason="duplicate", status=S.APPROVED)


def ask_refund(api, payment, amount: int) -> str:
    response = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": amount, "reason": "duplicate"})
    assert response.status_code == 201, response.json()
    return response.json()["refund"]["id"]


def refund_calls(fake: FakeStripe) -> int:
    with fake.lock:
        return sum(1 for r in fake.received if r.method == "POST" and r.path == "/v1/refunds")


def gateway_calls(fake: FakeStripe) -> int:
    with fake.lock:
        return len(fake.received)


@pytest.fixture
def quick_breaker(settings):
    settings.GATEWAY_BREAKER_THRESHOLD = 3
    settings.GATEWAY_BREAKER_COOLDOWN_SECONDS = 60


# -- the breaker ------------------------------------------------------------------------------------
@pytest.mark.django_db
def test_the_breaker_stops_calling_a_gateway_after_repeated_unavailable_answers(gateways, stripe_fake,
                                                                                quick_breaker):
    stripe_fake.set_mode("down")
    refund = approved_refund(stripe_payment(stripe_fake))
    for _ in range(3):
        with pytest.raises(ProcessorUnavailable) as down:
            payouts.submit_refund(refund_id=refund.pk)
        assert down.value.code != "gateway_circuit_open"
    # The first call's answer is unknown (a 503 may follow an act), so the next two look it up first.
    assert (refund_calls(stripe_fake), gateway_calls(stripe_fake)) == (1, 3)

    with pytest.raises(payouts.CircuitOpen) as resting:
        payouts.submit_refund(refund_id=refund.pk)

    assert gateway_calls(stripe_fake) == 3  # not called
    assert 0 < resting.value.retry_after <= 60
    assert breaker.state("stripe", "default").phase == "open"
    refund.refresh_from_db()
    assert refund.status == S.APPROVED


@pytest.mark.django_db
def test_one_breaker_per_gateway_and_account(gateways, stripe_fake, quick_breaker):
    stripe_fake.set_mode("down")
    for _ in range(3):
        with pytest.raises(ProcessorUnavailable):
            payouts.submit_refund(refund_id=approved_refund(stripe_payment(stripe_fake)).pk)

    assert breaker.state("stripe", "default").phase == "open"
    assert breaker.state("stripe", "eu").phase == "closed"
    assert payouts.submit_refund(refund_id=approved_refund(make_payment()).pk).status == S.SUBMITTED


@pytest.mark.django_db
def test_after_the_cool_down_one_call_probes_and_its_answer_closes_or_reopens(quick_breaker):
    start = time.time()
    for _ in range(3):
        breaker.record_unavailable("stripe", "probe", now=start)
    assert breaker.wait_seconds("stripe", "probe", now=start + 30) == pytest.approx(30, abs=1)

    later = start + 61
    assert breaker.wait_seconds("stripe", "probe", now=later) == 0  # the one probe
    assert breaker.wait_seconds("stripe", "probe", now=later) > 0  # everyone else waits
    breaker.record_unavailable("stripe", "probe", now=later)  # the probe failed: open again
    assert breaker.state("stripe", "probe", now=later + 1).phase == "open"

    again = later + 61
    assert breaker.wait_seconds("stripe", "probe", now=again) == 0
    breaker.record_success("stripe", "probe")
    assert breaker.state("stripe", "probe").phase == "closed"
    assert breaker.wait_seconds("stripe", "probe") == 0


@pytest.mark.django_db
def test_a_final_answer_closes_the_count_of_unavailable_ones(gateways, stripe_fake, quick_breaker):
    stripe_fake.set_mode("down")
    payment = stripe_payment(stripe_fake)
    for _ in range(2):
        with pytest.raises(ProcessorUnavailable):
            payouts.submit_refund(refund_id=approved_refund(payment).pk)
    stripe_fake.set_mode("up")
    payouts.submit_refund(refund_id=approved_refund(payment).pk)

    assert breaker.state("stripe", "default").failures == 0


# -- backoff ----------------------------------------------------------------------------------------
@pytest.mark.django_db
def test_a_rate_limited_gateway_is_retried_no_sooner_than_its_retry_after(gateways, stripe_fake):
    stripe_fake.set_mode("rate_limited", retry_after=7)
    refund = approved_refund(stripe_payment(stripe_fake))

    with pytest.raises(ProcessorUnavailable) as limited:
        payouts.submit_refund(refund_id=refund.pk)

    assert (limited.value.code, limited.value.retry_after) == ("rate_limited", 7)
    assert all(tasks.backoff_seconds(attempt, retry_after=7) >= 7 for attempt in range(6))
    refund.refresh_from_db()
    assert refund.status == S.APPROVED


def test_backoff_grows_exponentially_with_jitter_and_is_capped(settings):
    settings.REFUND_SUBMIT_BACKOFF_BASE_SECONDS = 5
    settings.REFUND_SUBMIT_BACKOFF_MAX_SECONDS = 300
    for attempt, ceiling in [(0, 5), (1, 10), (3, 40), (10, 300)]:
        waits = {tasks.backoff_seconds(attempt) for _ in range(50)}
        assert all(ceiling / 2 <= wait <= ceiling for wait in waits) and len(waits) > 1


# -- the backlog operators see ------------------------------------------------------------------------
@pytest.mark.django_db
def test_the_backlog_counts_approved_refunds_per_gateway_with_the_oldest_age(gateways, stripe_fake,
                                                                             quick_breaker):
    stripe_fake.set_mode("down")
    stripe_refunds = [approved_refund(stripe_payment(stripe_fake)) for _ in range(3)]
    approved_refund(make_payment())
    Refund.objects.filter(pk=stripe_refunds[0].pk).update(created_at=stripe_refunds[0].created_at.replace(
        year=stripe_refunds[0].created_at.year - 1))
    for refund in stripe_refunds:
        with pytest.raises(ProcessorUnavailable):
            payouts.submit_refund(refund_id=refund.pk)

    backlog = {(row["gateway"], row["account"]): row for row in payouts.gateway_backlog()}

    assert backlog[("stripe", "default")]["count"] == 3
    assert backlog[("stripe", "default")]["oldest_age_seconds"] >= 365 * 86400
    assert backlog[("stripe", "default")]["breaker"] == "open"
    assert (backlog[("sandbox", "default")]["count"], backlog[("sandbox", "default")]["breaker"]) == (1, "closed")


# -- the whole way, with a real worker -----------------------------------------------------------------
@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("outage", ["down", "unreachable"])
def test_every_refund_is_paid_exactly_once_after_an_outage(settings, api, policy, gateways, stripe_fake,
                                                           worker, outage):
    settings.GATEWAY_BREAKER_THRESHOLD = 3
    settings.GATEWAY_BREAKER_COOLDOWN_SECONDS = 0.5
    settings.REFUND_SUBMIT_MAX_RETRIES = 1_000  # the outage may outlast the default's few seconds here
    stripe_fake.set_mode(outage)
    payments = [stripe_payment(stripe_fake, 5_000) for _ in range(10)]

    ids = [ask_refund(api, p, 1_000 + i) for i, p in enumerate(payments)]

    wait_for(lambda: breaker.state("stripe", "default").phase == "open", what="the breaker to open")
    assert set(Refund.objects.filter(pk__in=ids).values_list("status", flat=True)) == {S.APPROVED}
    assert stripe_fake.refund_count == 0
    detail = api.get(f"/api/v1/refunds/{ids[0]}").json()["refund"]
    assert detail["pending_at_gateway"] is True and detail["estimated_arrival"]
    assert payouts.gateway_backlog()[0]["count"] == 10
    stripe_fake.set_mode("up")

    wait_for(lambda: Refund.objects.filter(pk__in=ids, status=S.SETTLED).count() == 10, what="all settled")
    assert stripe_fake.refund_count == 10
    on_stripe = sorted(r["metadata"]["refund_id"] for r in stripe_fake.refunds.values())
    assert on_stripe == sorted(ids)
    assert payouts.gateway_backlog() == []


@pytest.mark.django_db(transaction=True)
def test_a_slow_gateway_that_answered_after_we_gave_up_is_not_paid_twice(settings, api, policy, gateways,
                                                                        stripe_fake, worker):
    settings.PROCESSORS["stripe"]["default"]["timeout"] = 0.3
    stripe_fake.set_mode("slow", slow_seconds=1.0)  # Stripe makes the refund; we have stopped listening
    payments = [stripe_payment(stripe_fake, 5_000) for _ in range(3)]

    ids = [ask_refund(api, p, 700) for p in payments]
    wait_for(lambda: stripe_fake.refund_count == 3, what="the slow gateway to make all three")
    stripe_fake.set_mode("up")

    wait_for(lambda: Refund.objects.filter(pk__in=ids, status=S.SETTLED).count() == 3, what="all settled")
    assert stripe_fake.refund_count == 3
    assert refund_calls(stripe_fake) == 3  # the retries looked the refunds up rather than asking again


@pytest.mark.django_db(transaction=True)
def test_a_rate_limited_gateway_gets_every_refund_once_it_lets_us_in(settings, api, policy, gateways,
                                                                    stripe_fake, worker):
    settings.GATEWAY_BREAKER_THRESHOLD = 100
    stripe_fake.set_mode("rate_limited", retry_after=1)
    payments = [stripe_payment(stripe_fake, 5_000) for _ in range(3)]

    ids = [ask_refund(api, p, 900) for p in payments]
    wait_for(lambda: refund_calls(stripe_fake) >= 3, what="the first tries")
    stripe_fake.set_mode("up")

    wait_for(lambda: Refund.objects.filter(pk__in=ids, status=S.SETTLED).count() == 3, what="all settled")
    assert stripe_fake.refund_count == 3
