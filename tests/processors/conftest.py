"""Fake gateways on 127.0.0.1 (a free port, a background thread) and adapters pointed at them.

Only configuration points an adapter at its fake: the adapter and the SDK run unpatched.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from processors.paypal import PayPalProcessor
from processors.stripe import StripeProcessor
from tests.fakes.paypal_server import FakePayPal
from tests.fakes.stripe_server import FakeStripe

STRIPE_WEBHOOK_SECRET = "whsec_test_secret"
PAYPAL_WEBHOOK_ID = "WH-1TEST0000000000A"


@pytest.fixture
def stripe_fake() -> Iterator[FakeStripe]:
    fake = FakeStripe(api_key="sk_test_refundops").start()
    yield fake
    fake.stop()


@pytest.fixture
def stripe_config(stripe_fake: FakeStripe) -> dict[str, object]:
    return {"api_key": stripe_fake.api_key, "api_base": stripe_fake.url,
            "webhook_secret": STRIPE_WEBHOOK_SECRET, "timeout": 5}


@pytest.fixture
def stripe_processor(stripe_config: dict[str, object]) -> StripeProcessor:
    return StripeProcessor(account="default", config=stripe_config)


@pytest.fixture
def paypal_fake() -> Iterator[FakePayPal]:
    fake = FakePayPal(client_id="refundops-client", client_secret="refundops-secret").start()
    yield fake
    fake.stop()


@pytest.fixture
def paypal_config(paypal_fake: FakePayPal) -> dict[str, object]:
    return {"client_id": paypal_fake.client_id, "client_secret": paypal_fake.client_secret,
            "environment": "sandbox", "base_url": paypal_fake.url,
            "webhook_id": PAYPAL_WEBHOOK_ID, "timeout": 5}


@pytest.fixture
def paypal_processor(paypal_config: dict[str, object]) -> PayPalProcessor:
    return PayPalProcessor(account="default", config=paypal_config)
