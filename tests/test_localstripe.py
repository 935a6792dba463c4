"""A second Stripe to agree with: the Stripe adapter and ``import_payments`` against ``localstripe``
(a stateful fake Stripe that nobody on this project wrote), started as a subprocess on a free port,
so our own fake (tests/fakes/stripe_server.py) is not the only Stripe we are proven against.

localstripe lacks some of Stripe's normal API; tests/fakes/localstripe_server.py patches exactly
those gaps and lists them in its docstring: its state file at a fixed /tmp path (kept in memory),
``Idempotency-Key`` (added), a refund's ``reason`` (taken), capture ``metadata`` (taken), a payment
intent's ``amount_received`` (shown), the ``created[gte]`` list filter and Stripe's newest-first
order (added), and disputes (none at all: the list answers empty). Only operations localstripe
supports are tried here: refunds, retries, capture, void, refund status, the import with refunds
made outside RefundOps and an authorisation to capture. Disputes, payment links and evidence
are proven against our own fake only.
"""

from __future__ import annotations

import io
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests
import stripe
from django.core.management import call_command

from processors.base import PaymentRef, RefundRequest
from processors.money import Money
from processors.stripe import StripeProcessor
from refundops.models import Payment, Refund, RefundState

pytestmark = pytest.mark.django_db
KEY = "sk_test_localstripe"
ROOT = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def localstripe() -> Iterator[str]:
    port = _free_port()
    process = subprocess.Popen([sys.executable, "-m", "tests.fakes.localstripe_server", "--port", str(port),
                                "--from-scratch"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60  # ends a hopeless wait for it to start; asserts nothing about speed
    while True:
        try:
            requests.get(f"{url}/v1/balance", auth=(KEY, ""), timeout=1)
            break
        except requests.ConnectionError:
            if process.poll() is not None or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(f"localstripe did not start: {process.stderr.read().decode()[-2000:]}")
            time.sleep(0.1)
    yield url
    process.terminate()
    process.wait(timeout=10)


@pytest.fixture
def world(localstripe, settings) -> stripe.StripeClient:
    """A clean localstripe, our Stripe account pointed at it, and a client acting as the rest of the
    world (customers paying, the Dashboard refunding)."""
    requests.delete(f"{localstripe}/_config/data", timeout=5)
    settings.PROCESSORS = {**settings.PROCESSORS,
                           "stripe": {"default": {"api_key": KEY, "api_base": localstripe, "timeout": 10}}}
    return stripe.StripeClient(KEY, base_addresses={"api": localstripe}, max_network_retries=0)


@pytest.fixture
def adapter(world, settings) -> StripeProcessor:
    return StripeProcessor(account="default", config=settings.PROCESSORS["stripe"]["default"])


def pay(world: stripe.StripeClient, amount: int, *, capture: bool = True) -> str:
    """A customer pays by card: a confirmed payment intent, captured or awaiting capture."""
    method = world.v1.payment_methods.create(params={
        "type": "card", "card": {"number": "4242424242424242", "exp_month": 12, "exp_year": 2034, "cvc": "123"}})
    intent = world.v1.payment_intents.create(params={
        "amount": amount, "currency": "usd", "payment_method": method.id, "confirm": True,
        "capture_method": "automatic" if capture else "manual"})
    return intent.id


def refund_request(intent: str, amount: int, *, key: str) -> RefundRequest:
    return RefundRequest(payment=PaymentRef(processor="stripe", account="default", reference=intent),
                         amount=Money(amount, "USD"), reason="duplicate", idempotency_key=key,
                         refund_id="rf_local", verdict_id="vd_local")


def test_partial_and_full_refunds_settle_with_the_verdict_in_metadata(world, adapter):
    intent = pay(world, 5_000)

    partial = adapter.refund(refund_request(intent, 2_000, key="rf_local:1"))
    rest = adapter.refund(refund_request(intent, 3_000, key="rf_local:2"))

    assert (partial.status, partial.amount, rest.amount) == ("succeeded", Money(2_000, "USD"), Money(3_000, "USD"))
    stored = world.v1.refunds.retrieve(partial.processor_refund_id)
    assert stored.metadata.to_dict() == {"refund_id": "rf_local", "verdict_id": "vd_local", "our_reason": "duplicate"}
    assert stored.reason == "duplicate"
    assert adapter.fetch_refund(rest.processor_refund_id) == rest


def test_a_retry_with_the_same_key_refunds_once(world, adapter):
    intent = pay(world, 5_000)

    first = adapter.refund(refund_request(intent, 1_000, key="rf_local:same"))
    again = adapter.refund(refund_request(intent, 1_000, key="rf_local:same"))

    assert again == first
    assert len(world.v1.refunds.list(params={"payment_intent": intent}).data) == 1


def test_capture_and_void_of_authorisations(world, adapter):
    to_capture, to_void = pay(world, 7_000, capture=False), pay(world, 4_000, capture=False)

    captured = adapter.capture(PaymentRef("stripe", "default", to_capture, to_capture), Money(7_000, "USD"),
                               idempotency_key="op_1", verdict_id="vd_capture")
    voided = adapter.void(PaymentRef("stripe", "default", to_void, to_void), idempotency_key="op_2",
                          verdict_id="vd_void")

    assert (captured.status, captured.amount) == ("captured", Money(7_000, "USD"))
    assert world.v1.payment_intents.retrieve(to_capture).metadata.to_dict() == {"verdict_id": "vd_capture"}
    assert voided.status == "voided" and world.v1.payment_intents.retrieve(to_void).status == "canceled"


def test_import_payments_brings_in_what_localstripe_holds_with_the_refunds_made_there(world):
    refunded = pay(world, 900)
    world.v1.refunds.create(params={"payment_intent": refunded, "amount": 900})  # on the Dashboard
    partly = pay(world, 5_000)
    world.v1.refunds.create(params={"payment_intent": partly, "amount": 1_500, "reason": "duplicate"})
    authorised = pay(world, 6_000, capture=False)
    out, err = io.StringIO(), io.StringIO()

    call_command("import_payments", "--gateway", "stripe", "--page-size", "2", stdout=out, stderr=err)
    call_command("import_payments", "--gateway", "stripe", stdout=out, stderr=err)  # again: nothing twice

    payments = {p.processor_reference: p for p in Payment.objects.all()}
    assert set(payments) == {refunded, partly, authorised}
    assert (payments[refunded].amount_refunded_minor, payments[refunded].refundable_minor) == (900, 0)
    assert payments[partly].refundable_minor == 3_500
    assert list(payments[partly].refunds.values_list("origin", "status", "reason")) == [
        (Refund.Origin.EXTERNAL, RefundState.SETTLED, "duplicate")]
    assert Refund.objects.count() == 2
    assert (payments[authorised].status, payments[authorised].order_amount_minor) == ("authorized", 6_000)
    assert "3 payment intents: 3 created" in out.getvalue()
    assert "3 payment intents: 0 created, 3 already here" in out.getvalue()
