"""Fixtures over the fake gateways, shared by the adapter tests and the end-to-end tests.

Only configuration points an adapter at its fake: the adapter and the SDK run unpatched. A test
module is a pytest plugin (tests/conftest.py names it), so every test can ask for these fixtures.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Iterator
from decimal import Decimal
from typing import Any, TypeVar

import pytest
import stripe
from celery.contrib.testing.worker import start_worker
from django.utils import timezone

from processors.paypal import PayPalProcessor, forget_tokens
from processors.stripe import StripeProcessor
from refundops.celery import app as celery_app
from refundops.models import Payment
from tests.conftest import make_customer
from tests.fakes.paypal_server import FakePayPal
from tests.fakes.stripe_server import FakeStripe

STRIPE_WEBHOOK_SECRET = "whsec_test_secret"
PAYPAL_WEBHOOK_ID = "WH-1TEST0000000000A"
SANDBOX_WEBHOOK_SECRET = "whsec_sandbox_test"
T = TypeVar("T")


def stripe_account(fake: FakeStripe, *, webhook_secret: str = STRIPE_WEBHOOK_SECRET) -> dict[str, Any]:
    return {"api_key": fake.api_key, "api_base": fake.url, "webhook_secret": webhook_secret, "timeout": 5}


def paypal_account(fake: FakePayPal) -> dict[str, Any]:
    return {"client_id": fake.client_id, "client_secret": fake.client_secret, "environment": "sandbox",
            "base_url": fake.url, "webhook_id": PAYPAL_WEBHOOK_ID, "timeout": 5}


@pytest.fixture
def stripe_fake() -> Iterator[FakeStripe]:
    fake = FakeStripe(api_key="sk_test_refundops").start()
    yield fake
    fake.stop()


@pytest.fixture
def stripe_config(stripe_fake: FakeStripe) -> dict[str, object]:
    return stripe_account(stripe_fake)


@pytest.fixture
def stripe_processor(stripe_config: dict[str, object]) -> StripeProcessor:
    return StripeProcessor(account="default", config=stripe_config)


@pytest.fixture
def paypal_fake() -> Iterator[FakePayPal]:
    forget_tokens()  # a token cached for an earlier fake on the same port is not this one's
    fake = FakePayPal(client_id="refundops-client", client_secret="refundops-secret").start()
    yield fake
    fake.stop()


@pytest.fixture
def paypal_config(paypal_fake: FakePayPal) -> dict[str, object]:
    return paypal_account(paypal_fake)


@pytest.fixture
def paypal_processor(paypal_config: dict[str, object]) -> PayPalProcessor:
    return PayPalProcessor(account="default", config=paypal_config)


@pytest.fixture
def gateways(settings, stripe_fake: FakeStripe, paypal_fake: FakePayPal) -> dict[str, Any]:
    """settings.PROCESSORS pointing every gateway's default account at its fake."""
    settings.PROCESSORS = {
        "sandbox": {"default": {"webhook_secret": SANDBOX_WEBHOOK_SECRET}},
        "stripe": {"default": stripe_account(stripe_fake)},
        "paypal": {"default": paypal_account(paypal_fake)},
    }
    return settings.PROCESSORS


@pytest.fixture
def worker(settings) -> Iterator[None]:
    """A real Celery worker in a thread, on the Redis broker, with quick retries."""
    settings.REFUND_SUBMIT_BACKOFF_BASE_SECONDS = 0.2
    settings.REFUND_SUBMIT_BACKOFF_MAX_SECONDS = 0.5
    settings.REFUND_FIRST_SYNC_SECONDS = 0.3
    settings.WEBHOOK_BACKOFF_BASE_SECONDS = 0.2
    settings.WEBHOOK_BACKOFF_MAX_SECONDS = 0.5
    celery_app.conf.task_always_eager = False
    broker = celery_app.conf.broker_url
    celery_app.conf.broker_url = settings.REDIS_URL
    with start_worker(celery_app, pool="threads", concurrency=4, perform_ping_check=False,
                      queues=settings.CELERY_WORKER_QUEUES, loglevel="WARNING", shutdown_timeout=10):
        yield
    celery_app.conf.broker_url = broker
    celery_app.conf.task_always_eager = True


def wait_for(predicate: Callable[[], T], *, timeout: float = 30.0, what: str = "condition") -> T:
    """Poll until ``predicate`` is truthy. The timeout only ends a hopeless wait; it asserts nothing."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"gave up waiting for {what}")


# -- our records of payments on the fakes, and events as the gateways send them -----------------

def stripe_payment(fake: FakeStripe, amount: int = 10_000, *, account: str = "default", customer=None,
                   **fields: Any) -> Payment:
    """A captured payment intent on the fake Stripe, and our record of it."""
    intent = fake.add_payment_intent(amount, "usd")
    return Payment.objects.create(**{
        "customer": customer or make_customer(), "processor": "stripe", "processor_account": account,
        "processor_reference": intent, "currency": "USD", "amount_authorized_minor": amount,
        "amount_captured_minor": amount, "status": Payment.Status.CAPTURED, "method_type": "card",
        "method_brand": "visa", "method_last4": "4242", "captured_at": timezone.now(), **fields})


def paypal_payment(fake: FakePayPal, value: str = "100.00", *, customer=None) -> Payment:
    """A completed capture on the fake PayPal, and our record of it."""
    capture = fake.add_capture(value, "USD")
    minor = int(Decimal(value) * 100)
    return Payment.objects.create(
        customer=customer or make_customer(), processor="paypal", processor_reference=capture,
        currency="USD", amount_authorized_minor=minor, amount_captured_minor=minor,
        status=Payment.Status.CAPTURED, method_type="paypal", captured_at=timezone.now())


def stripe_event(event_type: str, obj: dict[str, Any], *, event_id: str | None = None) -> dict[str, Any]:
    return {"id": event_id or f"evt_{secrets.token_hex(12)}", "object": "event", "type": event_type,
            "api_version": "2024-06-20", "created": int(time.time()), "livemode": False,
            "data": {"object": obj}}


def post_stripe_event(client, event: dict[str, Any], *, secret: str = STRIPE_WEBHOOK_SECRET,
                      timestamp: int | None = None, path: str = "/webhooks/stripe/"):
    payload = json.dumps(event)
    header = stripe.WebhookSignature.generate_signature_header(payload, secret, timestamp=timestamp)
    return client.post(path, data=payload, content_type="application/json", HTTP_STRIPE_SIGNATURE=header)
