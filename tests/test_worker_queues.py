"""A real Celery worker on the Redis broker: each gateway's payments ride its own queue, and a
retry waits its countdown (eager mode, used elsewhere, runs retries at once and ignores queues)."""

from __future__ import annotations

import time
from contextlib import contextmanager

import pytest
import redis
from celery.contrib.testing.worker import start_worker
from django.conf import settings as django_settings

from processors import sandbox
from refundops.celery import app as celery_app
from refundops.models import Refund, RefundState
from tests.conftest import make_payment, post
from tests.fakes.fixtures import stripe_payment, wait_for

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("quiet_breaker")]
S = RefundState


@contextmanager
def real_worker(settings, queues: list[str]):
    settings.REFUND_SUBMIT_BACKOFF_BASE_SECONDS = 0.2
    settings.REFUND_SUBMIT_BACKOFF_MAX_SECONDS = 0.5
    settings.REFUND_FIRST_SYNC_SECONDS = 0.3
    celery_app.conf.task_always_eager = False
    try:
        with start_worker(celery_app, pool="threads", concurrency=2, perform_ping_check=False,
                          queues=queues, loglevel="WARNING", shutdown_timeout=10):
            yield
    finally:
        celery_app.conf.task_always_eager = True


def waiting_in(queue: str) -> int:
    """Messages waiting in one broker queue (a Redis list under this run's key prefix)."""
    client = redis.Redis.from_url(django_settings.REDIS_URL)
    return client.llen(f"{django_settings.REDIS_KEY_PREFIX}{queue}")


def ask_refund(api, payment, amount: int) -> str:
    response = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": amount, "reason": "duplicate"})
    assert response.status_code == 201, response.json()
    return response.json()["refund"]["id"]


def status(refund_id: str) -> str:
    return Refund.objects.values_list("status", flat=True).get(pk=refund_id)


def test_each_gateways_refunds_ride_its_own_queue(settings, api, policy, gateways, stripe_fake):
    sandbox.set_mode("up", settle_delay_seconds=0)
    with real_worker(settings, ["default", "payments.sandbox"]):
        on_stripe = ask_refund(api, stripe_payment(stripe_fake, 5_000), 700)
        on_sandbox = ask_refund(api, make_payment(amount=5_000), 700)
        wait_for(lambda: status(on_sandbox) == S.SETTLED, what="the sandbox refund settled")
        # Nobody serves payments.stripe: its refund waits there, whatever the sandbox's worker does.
        wait_for(lambda: waiting_in("payments.stripe") == 1, what="the Stripe submission queued")
        assert status(on_stripe) == S.APPROVED and stripe_fake.refund_count == 0
    with real_worker(settings, ["payments.stripe"]):
        wait_for(lambda: status(on_stripe) in (S.SUBMITTED, S.SETTLED), what="the Stripe worker paid it")
    assert stripe_fake.refund_count == 1


def test_a_retry_waits_for_the_gateways_retry_after(settings, api, policy, gateways, stripe_fake):
    stripe_fake.set_mode("rate_limited", retry_after=2)

    def refund_posts() -> list[float]:
        with stripe_fake.lock:
            return [r for r in stripe_fake.received if r.method == "POST" and r.path == "/v1/refunds"]

    with real_worker(settings, ["default", "payments.stripe"]):
        refund_id = ask_refund(api, stripe_payment(stripe_fake, 5_000), 700)
        wait_for(lambda: len(refund_posts()) == 1, what="the first try")
        first = time.monotonic()
        stripe_fake.set_mode("up")
        wait_for(lambda: status(refund_id) in (S.SUBMITTED, S.SETTLED), what="paid after the wait")
        waited = time.monotonic() - first

    assert waited >= 1.5  # Retry-After: 2 (less the polling's own delay), never at once
    assert stripe_fake.refund_count == 1
