"""Each adapter's ``fetch_payment_book``: what the gateway's own books say of one payment (captured,
and every refund with its amount, state and our refund id), read through the official SDKs from
the fakes, and from the sandbox's own ledger. The reconciler compares this with ours."""

from __future__ import annotations

from datetime import timedelta

import pytest
from django.utils import timezone

from processors import sandbox
from processors.base import PaymentRef, ProcessorDeclined, ProcessorUnavailable, RefundRequest
from processors.models import SandboxControl, SandboxRefund
from processors.money import Money
from processors.paypal import PayPalProcessor
from processors.sandbox import SandboxProcessor
from processors.stripe import StripeProcessor
from tests.fakes.paypal_server import FakePayPal
from tests.fakes.stripe_server import FakeStripe


def _ref(processor: str, reference: str, authorization: str = "") -> PaymentRef:
    return PaymentRef(processor=processor, account="default", reference=reference,
                      authorization_reference=authorization)


def _refund(payment: PaymentRef, amount: int, *, refund_id: str = "", key: str = "",
            currency: str = "USD") -> RefundRequest:
    """Ours when ``refund_id`` is given; otherwise as made on the gateway's dashboard."""
    return RefundRequest(payment=payment, amount=Money(amount, currency), reason="customer_request",
                         idempotency_key=key or f"k-{refund_id or 'dashboard'}-{amount}", refund_id=refund_id,
                         verdict_id="vd_1" if refund_id else "")


# -- Stripe ---------------------------------------------------------------------------------------
def test_a_stripe_payment_intents_book_has_its_capture_and_every_refund(
        stripe_fake: FakeStripe, stripe_processor: StripeProcessor) -> None:
    payment = _ref("stripe", stripe_fake.add_payment_intent(10_000))
    ours = stripe_processor.refund(_refund(payment, 2_500, refund_id="rf_ours"))
    theirs = stripe_processor.refund(_refund(payment, 1_000))
    stripe_fake.set_refund_status(theirs.processor_refund_id, "failed", failure_reason="lost_or_stolen_card")
    other = _ref("stripe", stripe_fake.add_payment_intent(4_000))
    stripe_processor.refund(_refund(other, 4_000, refund_id="rf_other"))

    book = stripe_processor.fetch_payment_book(payment)

    assert book.reference == payment.reference and book.complete
    assert book.captured == Money(10_000, "USD")
    listed = {r.processor_refund_id: r for r in book.refunds}
    assert set(listed) == {ours.processor_refund_id, theirs.processor_refund_id}
    assert (listed[ours.processor_refund_id].amount, listed[ours.processor_refund_id].status,
            listed[ours.processor_refund_id].our_refund_id) == (Money(2_500, "USD"), "succeeded", "rf_ours")
    assert (listed[theirs.processor_refund_id].status, listed[theirs.processor_refund_id].our_refund_id) == (
        "failed", "")
    assert abs(listed[ours.processor_refund_id].created_at - timezone.now()) < timedelta(minutes=1)


def test_a_stripe_book_reads_every_page_of_refunds(stripe_fake: FakeStripe, stripe_processor: StripeProcessor,
                                                   monkeypatch) -> None:
    monkeypatch.setattr(StripeProcessor, "BOOK_PAGE_SIZE", 2)
    payment = _ref("stripe", stripe_fake.add_payment_intent(10_000))
    made = {stripe_processor.refund(_refund(payment, 100 * n, refund_id=f"rf_{n}")).processor_refund_id
            for n in range(1, 6)}

    book = stripe_processor.fetch_payment_book(payment)

    assert {r.processor_refund_id for r in book.refunds} == made
    assert len([r for r in stripe_fake.received if r.path == "/v1/refunds" and r.method == "GET"]) == 3


def test_a_stripe_charges_book_lists_the_refunds_of_that_charge(
        stripe_fake: FakeStripe, stripe_processor: StripeProcessor) -> None:
    payment = _ref("stripe", stripe_fake.add_charge(3_000))
    made = stripe_processor.refund(_refund(payment, 1_200, refund_id="rf_ch"))
    stripe_processor.refund(_refund(_ref("stripe", stripe_fake.add_charge(900)), 900))

    book = stripe_processor.fetch_payment_book(payment)

    assert book.captured == Money(3_000, "USD")
    assert [(r.processor_refund_id, r.our_refund_id) for r in book.refunds] == [(made.processor_refund_id, "rf_ch")]


def test_a_stripe_authorisation_not_captured_has_captured_nothing(
        stripe_fake: FakeStripe, stripe_processor: StripeProcessor) -> None:
    intent = stripe_fake.add_payment_intent(5_000, captured=False)

    book = stripe_processor.fetch_payment_book(_ref("stripe", intent, intent))

    assert book.captured == Money(0, "USD") and book.refunds == ()


def test_a_stripe_payment_stripe_does_not_know_is_declined_and_an_outage_is_unavailable(
        stripe_fake: FakeStripe, stripe_processor: StripeProcessor) -> None:
    with pytest.raises(ProcessorDeclined) as missing:
        stripe_processor.fetch_payment_book(_ref("stripe", "pi_3Fknothere"))
    assert missing.value.code == "resource_missing"
    stripe_fake.set_mode("down")
    with pytest.raises(ProcessorUnavailable):
        stripe_processor.fetch_payment_book(_ref("stripe", "pi_3Fknothere"))


# -- PayPal ---------------------------------------------------------------------------------------
def test_a_paypal_captures_book_lists_its_refunds_through_its_order(
        paypal_fake: FakePayPal, paypal_processor: PayPalProcessor) -> None:
    payment = _ref("paypal", paypal_fake.add_capture("100.00"))
    ours = paypal_processor.refund(_refund(payment, 2_500, refund_id="rf_pp"))
    theirs = paypal_processor.refund(_refund(payment, 1_000))
    paypal_fake.set_refund_status(theirs.processor_refund_id, "PENDING")

    book = paypal_processor.fetch_payment_book(payment)

    assert book.complete and book.captured == Money(10_000, "USD")
    listed = {r.processor_refund_id: r for r in book.refunds}
    assert set(listed) == {ours.processor_refund_id, theirs.processor_refund_id}
    assert (listed[ours.processor_refund_id].amount, listed[ours.processor_refund_id].status,
            listed[ours.processor_refund_id].our_refund_id) == (Money(2_500, "USD"), "succeeded", "rf_pp")
    assert (listed[theirs.processor_refund_id].status, listed[theirs.processor_refund_id].our_refund_id) == (
        "pending", "")
    assert listed[ours.processor_refund_id].created_at is not None
    assert {r.path.split("/")[2] for r in paypal_fake.received if r.method == "GET"} >= {"payments", "checkout"}


def test_a_paypal_book_leaves_out_refunds_of_the_orders_other_captures(
        paypal_fake: FakePayPal, paypal_processor: PayPalProcessor) -> None:
    authorization = paypal_fake.add_authorization("100.00")
    first = paypal_fake.capture_authorization(authorization, "60.00", final_capture=False)
    second = paypal_fake.capture_authorization(authorization, "40.00")
    paypal_processor.refund(_refund(_ref("paypal", second, authorization), 4_000, refund_id="rf_second"))
    mine = paypal_processor.refund(_refund(_ref("paypal", first, authorization), 1_000, refund_id="rf_first"))

    book = paypal_processor.fetch_payment_book(_ref("paypal", first, authorization))

    assert book.captured == Money(6_000, "USD")
    assert [(r.processor_refund_id, r.our_refund_id) for r in book.refunds] == [(mine.processor_refund_id, "rf_first")]


def test_a_paypal_capture_without_an_order_shows_only_the_refunds_asked_for_by_id(
        paypal_fake: FakePayPal, paypal_processor: PayPalProcessor) -> None:
    payment = _ref("paypal", paypal_fake.add_capture("50.00", with_order=False))
    known = paypal_processor.refund(_refund(payment, 1_500, refund_id="rf_known"))
    paypal_processor.refund(_refund(payment, 500))  # made on PayPal: cannot be listed without the order

    book = paypal_processor.fetch_payment_book(payment, known_refund_ids=[known.processor_refund_id])

    assert not book.complete and book.captured == Money(5_000, "USD")
    assert [(r.processor_refund_id, r.our_refund_id) for r in book.refunds] == [(known.processor_refund_id, "rf_known")]


def test_a_paypal_capture_paypal_does_not_know_is_declined_and_an_outage_is_unavailable(
        paypal_fake: FakePayPal, paypal_processor: PayPalProcessor) -> None:
    with pytest.raises(ProcessorDeclined) as missing:
        paypal_processor.fetch_payment_book(_ref("paypal", "0NOSUCHCAPTURE000"))
    assert missing.value.code == "INVALID_RESOURCE_ID"
    paypal_fake.set_mode("down")
    with pytest.raises(ProcessorUnavailable):
        paypal_processor.fetch_payment_book(_ref("paypal", "0NOSUCHCAPTURE000"))


# -- the sandbox ----------------------------------------------------------------------------------
@pytest.mark.django_db
def test_the_sandboxs_book_is_its_own_ledger_listed_like_a_real_gateways() -> None:
    processor = SandboxProcessor()
    payment = _ref("sandbox", sandbox.open_charge(amount=Money(8_000, "EUR")))
    sandbox.set_mode("up", settle_delay_seconds=0)
    ours = processor.refund(_refund(payment, 3_000, refund_id="rf_sb", currency="EUR"))
    sandbox.set_mode("up", settle_delay_seconds=3600)
    later = processor.refund(_refund(payment, 1_000, currency="EUR"))
    processor.refund(_refund(_ref("sandbox", sandbox.open_charge(amount=Money(500, "EUR"))), 500, currency="EUR"))

    book = processor.fetch_payment_book(payment)

    assert book.complete and book.captured == Money(8_000, "EUR")
    assert [(r.processor_refund_id, r.amount, r.status, r.our_refund_id) for r in book.refunds] == [
        (ours.processor_refund_id, Money(3_000, "EUR"), "succeeded", "rf_sb"),
        (later.processor_refund_id, Money(1_000, "EUR"), "pending", "")]
    assert book.refunds[0].created_at == SandboxRefund.objects.get(reference=ours.processor_refund_id).created_at


@pytest.mark.django_db
def test_a_voided_sandbox_authorisation_has_captured_nothing_and_an_unknown_charge_is_declined() -> None:
    processor = SandboxProcessor()
    charge = sandbox.open_charge(amount=Money(2_000, "USD"), captured=False)
    processor.void(_ref("sandbox", charge), idempotency_key="void-1", verdict_id="vd_1")

    assert processor.fetch_payment_book(_ref("sandbox", charge)).captured == Money(0, "USD")
    with pytest.raises(ProcessorDeclined):
        processor.fetch_payment_book(_ref("sandbox", "sbch_nothere"))
    sandbox.set_mode(SandboxControl.Mode.DOWN)
    with pytest.raises(ProcessorUnavailable):
        processor.fetch_payment_book(_ref("sandbox", charge))
