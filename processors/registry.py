"""Find the adapter for a payment's gateway and account, from settings.PROCESSORS.

A refund always goes to the gateway and account that took the payment; the agent never chooses.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from django.conf import settings
from django.utils.module_loading import import_string

from processors.base import PaymentProcessor

ADAPTERS: dict[str, str] = {
    "sandbox": "processors.sandbox.SandboxProcessor",
    "stripe": "processors.stripe.StripeProcessor",
    "paypal": "processors.paypal.PayPalProcessor",
}


class UnknownProcessor(LookupError):
    pass


def processor_config(processor: str, account: str = "default") -> Mapping[str, Any]:
    try:
        return settings.PROCESSORS[processor][account]
    except KeyError:
        raise UnknownProcessor(f"no configured account {account!r} for gateway {processor!r}") from None


def get_processor(processor: str, account: str = "default") -> PaymentProcessor:
    if processor not in ADAPTERS:
        raise UnknownProcessor(f"unknown gateway {processor!r}")
    adapter: Callable[..., PaymentProcessor] = import_string(ADAPTERS[processor])
    return adapter(account=account, config=processor_config(processor, account))
