"""Fake gateways on 127.0.0.1 (a free port, a background thread) and adapters pointed at them.
The fixtures live in tests/fakes/fixtures.py, shared with the end-to-end tests."""

from tests.fakes.fixtures import (  # noqa: F401 - fixtures and constants the adapter tests use
    PAYPAL_WEBHOOK_ID,
    STRIPE_WEBHOOK_SECRET,
    paypal_config,
    paypal_fake,
    paypal_processor,
    stripe_config,
    stripe_fake,
    stripe_processor,
)
