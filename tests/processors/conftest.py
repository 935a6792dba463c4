"""Fake gateways on 127.0.0.1 (a free port, a background thread) and adapters pointed at them.

Only configuration points an adapter at its fake: the adapter and the SDK run unpatched.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from processors.stripe import StripeProcessor
from tests.fakes.stripe_server import FakeStripe

STRIPE_WEBHOOK_SECRET = "whsec_test_secret"


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
