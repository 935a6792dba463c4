"""The Stripe adapter, driven through the official SDK against the local fake Stripe."""

from __future__ import annotations

import json
import time

import pytest
import stripe

from processors.base import (
    InvalidWebhook,
    PaymentRef,
    ProcessorDeclined,
    ProcessorUnavailable,
    RefundRequest,
)
from processors.money import Money
from processors.stripe import StripeProcessor
from tests.fakes.stripe_server import FakeStripe, parse_form
from tests.fakes.fixtures import STRIPE_WEBHOOK_SECRET


def _payment(reference: str, authorization: str = "") -> PaymentRef:
    return PaymentRef(processor="stripe", account="default", reference=reference,
                      authorization_reference=authorization)


def _refund(reference: str, amount: int, *, key: str = "rf_1:submit", reason: str = "customer_request",
            currency: str = "USD") -> RefundRequest:
    return RefundRequest(payment=_payment(reference), amount=Money(amount, currency), reason=reason,
                         idempotency_key=key, refund_id="rf_1", verdict_id="vd_42")


# -- refunds -------------------------------------------------------------------------------------
def test_full_refund_of_a_payment_intent_succeeds(stripe_fake: FakeStripe,
                                                  stripe_processor: StripeProcessor) -> None:
    intent = stripe_fake.add_payment_intent(5000)

    result = stripe_processor.refund(_refund(intent, 5000))

    assert result.status == "succeeded"
    assert result.amount == Money(5000, "USD")
    stored = stripe_fake.refunds[result.processor_refund_id]
    assert stored["payment_intent"] == intent and stored["amount"] == 5000


def test_partial_refunds_of_a_charge_add_up_to_the_captured_amount(
        stripe_fake: FakeStripe, stripe_processor: StripeProcessor) -> None:
    charge = stripe_fake.add_charge(3000)

    first = stripe_processor.refund(_refund(charge, 1000, key="rf_1:a"))
    second = stripe_processor.refund(_refund(charge, 2000, key="rf_2:a"))

    assert (first.amount.amount_minor, second.amount.amount_minor) == (1000, 2000)
    assert stripe_fake.charges[charge]["amount_refunded"] == 3000
    assert stripe_fake.charges[charge]["refunded"] is True


def test_a_zero_decimal_currency_is_sent_in_its_own_minor_units(
        stripe_fake: FakeStripe, stripe_processor: StripeProcessor) -> None:
    intent = stripe_fake.add_payment_intent(1200, "jpy")

    result = stripe_processor.refund(_refund(intent, 500, currency="JPY"))

    assert result.amount == Money(500, "JPY")
    assert stripe_fake.refunds[result.processor_refund_id]["amount"] == 500


@pytest.mark.parametrize(("ours", "stripes"), [
    ("customer_request", "requested_by_customer"),
    ("duplicate", "duplicate"),
    ("fraudulent", "fraudulent"),
    ("product_issue", "requested_by_customer"),
])
def test_our_reason_is_mapped_to_stripes_and_kept_in_metadata(
        stripe_fake: FakeStripe, stripe_processor: StripeProcessor, ours: str, stripes: str) -> None:
    intent = stripe_fake.add_payment_intent(1000)

    result = stripe_processor.refund(_refund(intent, 1000, reason=ours))

    stored = stripe_fake.refunds[result.processor_refund_id]
    assert stored["reason"] == stripes
    assert stored["metadata"] == {"refund_id": "rf_1", "verdict_id": "vd_42", "our_reason": ours}


def test_an_unknown_reason_is_refused_before_calling_stripe(
        stripe_fake: FakeStripe, stripe_processor: StripeProcessor) -> None:
    intent = stripe_fake.add_payment_intent(1000)

    with pytest.raises(ProcessorDeclined) as caught:
        stripe_processor.refund(_refund(intent, 1000, reason="changed_mind"))

    assert caught.value.code == "unknown_reason"
    assert stripe_fake.received == []


def test_the_same_idempotency_key_twice_creates_one_refund(
        stripe_fake: FakeStripe, stripe_processor: StripeProcessor) -> None:
    intent = stripe_fake.add_payment_intent(5000)

    first = stripe_processor.refund(_refund(intent, 2000, key="rf_7:submit"))
    again = stripe_processor.refund(_refund(intent, 2000, key="rf_7:submit"))

    assert again == first
    assert stripe_fake.refund_count == 1
    assert [r.header("Idempotency-Key") for r in stripe_fake.received] == ["rf_7:submit"] * 2


def test_an_idempotency_key_reused_with_other_parameters_is_declined(
        stripe_fake: FakeStripe, stripe_processor: StripeProcessor) -> None:
    intent = stripe_fake.add_payment_intent(5000)
    stripe_processor.refund(_refund(intent, 2000, key="rf_7:submit"))

    with pytest.raises(ProcessorDeclined) as caught:
        stripe_processor.refund(_refund(intent, 3000, key="rf_7:submit"))

    assert caught.value.code == "idempotency_error"
    assert stripe_fake.refund_count == 1


def test_refunding_more_than_remains_is_declined_with_stripes_code(
        stripe_fake: FakeStripe, stripe_processor: StripeProcessor) -> None:
    intent = stripe_fake.add_payment_intent(5000)
    stripe_processor.refund(_refund(intent, 4000, key="rf_1:a"))

    with pytest.raises(ProcessorDeclined) as caught:
        stripe_processor.refund(_refund(intent, 1001, key="rf_2:a"))

    assert caught.value.code == "amount_too_large"
    assert "greater than unrefunded amount" in caught.value.message
    assert stripe_fake.refund_count == 1


def test_refunding_a_fully_refunded_charge_is_declined(
        stripe_fake: FakeStripe, stripe_processor: StripeProcessor) -> None:
    charge = stripe_fake.add_charge(5000)
    stripe_processor.refund(_refund(charge, 5000, key="rf_1:a"))

    with pytest.raises(ProcessorDeclined) as caught:
        stripe_processor.refund(_refund(charge, 1, key="rf_2:a"))

    assert caught.value.code == "charge_already_refunded"


def test_refunding_an_unknown_payment_intent_is_declined(
        stripe_processor: StripeProcessor) -> None:
    with pytest.raises(ProcessorDeclined) as caught:
        stripe_processor.refund(_refund("pi_doesnotexist", 100))

    assert caught.value.code == "resource_missing"


def test_a_reference_that_is_not_a_payment_intent_or_charge_is_declined(
        stripe_processor: StripeProcessor) -> None:
    with pytest.raises(ProcessorDeclined) as caught:
        stripe_processor.refund(_refund("txn_123", 100))

    assert caught.value.code == "unknown_payment_reference"


def test_a_wrong_api_key_is_declined_not_retried(stripe_fake: FakeStripe,
                                                 stripe_config: dict[str, object]) -> None:
    intent = stripe_fake.add_payment_intent(1000)
    processor = StripeProcessor(account="default", config={**stripe_config, "api_key": "sk_test_bad"})

    with pytest.raises(ProcessorDeclined) as caught:
        processor.refund(_refund(intent, 1000))

    assert caught.value.code == "authentication_failed"


# -- outages ---------------------------------------------------------------------------------------
def test_a_gateway_answering_503_is_unavailable(stripe_fake: FakeStripe,
                                                stripe_processor: StripeProcessor) -> None:
    intent = stripe_fake.add_payment_intent(1000)
    stripe_fake.set_mode("down")

    with pytest.raises(ProcessorUnavailable):
        stripe_processor.refund(_refund(intent, 1000))

    assert stripe_fake.refund_count == 0


def test_a_connection_closed_unanswered_is_unavailable(stripe_fake: FakeStripe,
                                                       stripe_processor: StripeProcessor) -> None:
    intent = stripe_fake.add_payment_intent(1000)
    stripe_fake.set_mode("unreachable")

    with pytest.raises(ProcessorUnavailable):
        stripe_processor.refund(_refund(intent, 1000))


def test_a_slow_gateway_times_out_as_unavailable(stripe_fake: FakeStripe,
                                                 stripe_config: dict[str, object]) -> None:
    processor = StripeProcessor(account="default", config={**stripe_config, "timeout": 0.3})
    intent = stripe_fake.add_payment_intent(1000)
    stripe_fake.set_mode("slow", slow_seconds=3)

    with pytest.raises(ProcessorUnavailable):
        processor.refund(_refund(intent, 1000))


def test_rate_limiting_is_unavailable_with_stripes_retry_after(
        stripe_fake: FakeStripe, stripe_processor: StripeProcessor) -> None:
    intent = stripe_fake.add_payment_intent(1000)
    stripe_fake.set_mode("rate_limited", retry_after=7)

    with pytest.raises(ProcessorUnavailable) as caught:
        stripe_processor.refund(_refund(intent, 1000))

    assert caught.value.retry_after == 7
    assert caught.value.code == "rate_limited"


def test_a_retry_after_an_outage_with_the_same_key_pays_once(
        stripe_fake: FakeStripe, stripe_processor: StripeProcessor) -> None:
    intent = stripe_fake.add_payment_intent(1000)
    stripe_fake.set_mode("down")
    with pytest.raises(ProcessorUnavailable):
        stripe_processor.refund(_refund(intent, 1000, key="rf_9:submit"))
    stripe_fake.set_mode("up")

    first = stripe_processor.refund(_refund(intent, 1000, key="rf_9:submit"))
    second = stripe_processor.refund(_refund(intent, 1000, key="rf_9:submit"))

    assert first == second
    assert stripe_fake.refund_count == 1


# -- fetching a refund ---------------------------------------------------------------------------
@pytest.mark.parametrize(("stripes", "ours"), [
    ("pending", "pending"),
    ("requires_action", "pending"),
    ("succeeded", "succeeded"),
    ("failed", "failed"),
    ("canceled", "canceled"),
])
def test_fetch_refund_maps_stripes_status(stripe_fake: FakeStripe,
                                          stripe_processor: StripeProcessor,
                                          stripes: str, ours: str) -> None:
    intent = stripe_fake.add_payment_intent(1000)
    stripe_fake.next_refund_status = "pending"
    created = stripe_processor.refund(_refund(intent, 1000))
    stripe_fake.set_refund_status(created.processor_refund_id, stripes,
                                  failure_reason="expired_or_canceled_card")

    fetched = stripe_processor.fetch_refund(created.processor_refund_id)

    assert created.status == "pending"
    assert fetched.status == ours
    assert fetched.amount == Money(1000, "USD")
    if ours == "failed":
        assert fetched.failure_code == "expired_or_canceled_card"


def test_a_refund_failing_after_success_makes_the_amount_refundable_again(
        stripe_fake: FakeStripe, stripe_processor: StripeProcessor) -> None:
    intent = stripe_fake.add_payment_intent(1000)
    first = stripe_processor.refund(_refund(intent, 1000, key="rf_1:a"))
    stripe_fake.set_refund_status(first.processor_refund_id, "failed")

    again = stripe_processor.refund(_refund(intent, 1000, key="rf_2:a"))

    assert again.status == "succeeded"


def test_fetching_an_unknown_refund_is_declined(stripe_processor: StripeProcessor) -> None:
    with pytest.raises(ProcessorDeclined) as caught:
        stripe_processor.fetch_refund("re_nothere")

    assert caught.value.code == "resource_missing"


# -- void and capture ----------------------------------------------------------------------------
def test_void_cancels_an_uncaptured_payment_intent(stripe_fake: FakeStripe,
                                                  stripe_processor: StripeProcessor) -> None:
    intent = stripe_fake.add_payment_intent(8000, captured=False)

    result = stripe_processor.void(_payment(intent), idempotency_key="void:1", verdict_id="vd_1")

    assert (result.reference, result.status) == (intent, "voided")
    assert stripe_fake.payment_intents[intent]["status"] == "canceled"
    assert stripe_fake.received[-1].header("Idempotency-Key") == "void:1"


def test_voiding_a_captured_payment_is_declined(stripe_fake: FakeStripe,
                                               stripe_processor: StripeProcessor) -> None:
    intent = stripe_fake.add_payment_intent(8000)

    with pytest.raises(ProcessorDeclined) as caught:
        stripe_processor.void(_payment(intent), idempotency_key="void:1", verdict_id="vd_1")

    assert caught.value.code == "payment_intent_unexpected_state"


def test_void_needs_a_payment_intent(stripe_fake: FakeStripe,
                                     stripe_processor: StripeProcessor) -> None:
    with pytest.raises(ProcessorDeclined) as caught:
        stripe_processor.void(_payment(stripe_fake.add_charge(100)), idempotency_key="v",
                              verdict_id="vd_1")

    assert caught.value.code == "payment_intent_required"


def test_capture_takes_part_of_an_authorisation_and_names_the_verdict(
        stripe_fake: FakeStripe, stripe_processor: StripeProcessor) -> None:
    intent = stripe_fake.add_payment_intent(8000, captured=False)

    result = stripe_processor.capture(_payment(intent), Money(6500, "USD"),
                                      idempotency_key="capture:1", verdict_id="vd_9")

    assert (result.reference, result.amount, result.status) == (intent, Money(6500, "USD"),
                                                                "captured")
    sent = parse_form(stripe_fake.received[-1].body.decode())
    assert sent == {"amount_to_capture": "6500", "metadata": {"verdict_id": "vd_9"}}
    assert stripe_fake.charges[stripe_fake.payment_intents[intent]["latest_charge"]][
        "amount_captured"] == 6500


def test_capturing_more_than_authorised_is_declined(stripe_fake: FakeStripe,
                                                    stripe_processor: StripeProcessor) -> None:
    intent = stripe_fake.add_payment_intent(8000, captured=False)

    with pytest.raises(ProcessorDeclined) as caught:
        stripe_processor.capture(_payment(intent), Money(8001, "USD"),
                                 idempotency_key="capture:1", verdict_id="vd_9")

    assert caught.value.code == "amount_too_large"


# -- webhooks ------------------------------------------------------------------------------------
def _event(refund_id: str = "re_123") -> bytes:
    return json.dumps({"id": "evt_1", "object": "event", "type": "charge.refund.updated",
                       "api_version": "2024-06-20", "created": int(time.time()),
                       "data": {"object": {"id": refund_id, "object": "refund",
                                           "status": "failed", "amount": 100}}}).encode()


def _signed(payload: bytes, *, secret: str = STRIPE_WEBHOOK_SECRET,
            timestamp: int | None = None) -> dict[str, str]:
    header = stripe.WebhookSignature.generate_signature_header(
        payload.decode(), secret, timestamp=timestamp or int(time.time()))
    return {"Stripe-Signature": header}


def test_a_correctly_signed_event_verifies(stripe_processor: StripeProcessor) -> None:
    payload = _event("re_abc")

    event = stripe_processor.verify_webhook(payload, _signed(payload))

    assert (event.processor, event.event_id, event.type, event.object_id) == (
        "stripe", "evt_1", "charge.refund.updated", "re_abc")
    assert event.data["status"] == "failed"


def test_the_signature_header_is_found_whatever_its_case(stripe_processor: StripeProcessor) -> None:
    payload = _event()

    event = stripe_processor.verify_webhook(
        payload, {"stripe-signature": _signed(payload)["Stripe-Signature"]})

    assert event.event_id == "evt_1"


def test_an_event_signed_with_another_secret_is_invalid(stripe_processor: StripeProcessor) -> None:
    payload = _event()

    with pytest.raises(InvalidWebhook):
        stripe_processor.verify_webhook(payload, _signed(payload, secret="whsec_forged"))


def test_a_tampered_body_is_invalid(stripe_processor: StripeProcessor) -> None:
    headers = _signed(_event("re_abc"))

    with pytest.raises(InvalidWebhook):
        stripe_processor.verify_webhook(_event("re_other"), headers)


def test_a_stale_signature_is_invalid(stripe_processor: StripeProcessor) -> None:
    payload = _event()

    with pytest.raises(InvalidWebhook):
        stripe_processor.verify_webhook(payload, _signed(payload, timestamp=int(time.time()) - 301))


def test_a_missing_signature_is_invalid(stripe_processor: StripeProcessor) -> None:
    with pytest.raises(InvalidWebhook) as caught:
        stripe_processor.verify_webhook(_event(), {})

    assert caught.value.code == "missing_signature"


def test_a_signed_body_that_is_not_an_event_is_invalid(stripe_processor: StripeProcessor) -> None:
    payload = b'{"id": "evt_1"}'

    with pytest.raises(InvalidWebhook) as caught:
        stripe_processor.verify_webhook(payload, _signed(payload))

    assert caught.value.code == "malformed"


def test_without_a_webhook_secret_nothing_verifies(stripe_config: dict[str, object]) -> None:
    processor = StripeProcessor(account="default", config={**stripe_config, "webhook_secret": ""})
    payload = _event()

    with pytest.raises(InvalidWebhook):
        processor.verify_webhook(payload, _signed(payload))


# -- Stripe-only operations ----------------------------------------------------------------------
def test_fetch_dispute_reads_amount_reason_and_deadline(stripe_fake: FakeStripe,
                                                       stripe_processor: StripeProcessor) -> None:
    intent = stripe_fake.add_payment_intent(4200, "eur")
    charge = stripe_fake.payment_intents[intent]["latest_charge"]
    dispute_id = stripe_fake.add_dispute(charge, reason="product_not_received", due_by=1900000000)

    dispute = stripe_processor.fetch_dispute(dispute_id)

    assert dispute.amount == Money(4200, "EUR")
    assert (dispute.reason, dispute.status) == ("product_not_received", "needs_response")
    assert (dispute.charge, dispute.payment_intent) == (charge, intent)
    assert dispute.evidence_due_by == 1900000000


def test_list_payment_intents_walks_every_page_newest_first(
        stripe_fake: FakeStripe, stripe_processor: StripeProcessor) -> None:
    old = stripe_fake.add_payment_intent(100, created=1_600_000_000)
    recent = [stripe_fake.add_payment_intent(100 + i, created=1_700_000_000 + i) for i in range(5)]

    listed = list(stripe_processor.list_payment_intents(created_gte=1_700_000_000, limit=2))

    assert [intent.id for intent in listed] == list(reversed(recent))
    assert old not in {intent.id for intent in listed}
    pages = [r for r in stripe_fake.received if r.path == "/v1/payment_intents"]
    assert len(pages) == 3
    assert "starting_after" in parse_form(pages[-1].query)
    assert listed[0].amount == Money(104, "USD")


def test_listed_payment_intents_carry_their_charge_summary(
        stripe_fake: FakeStripe, stripe_processor: StripeProcessor) -> None:
    intent = stripe_fake.add_payment_intent(5_000)
    stripe_fake.refund_directly(intent, 1_200)

    listed = next(stripe_processor.list_payment_intents())

    assert (listed.amount_received, listed.order_amount) == (Money(5_000, "USD"), Money(5_000, "USD"))
    assert (listed.refunded, listed.disputed) == (Money(1_200, "USD"), False)
    assert (listed.card_brand, listed.card_last4) == ("visa", "4242")
    assert parse_form(stripe_fake.received[-1].query)["expand"] == ["data.latest_charge"]


def test_a_payment_intent_without_amount_received_is_read_from_its_charge(
        stripe_fake: FakeStripe, stripe_processor: StripeProcessor) -> None:
    intent = stripe_fake.add_payment_intent(5_000)
    del stripe_fake.payment_intents[intent]["amount_received"]

    listed = next(stripe_processor.list_payment_intents())

    assert listed.amount_received == Money(5_000, "USD")


def test_a_charge_that_does_not_say_what_was_refunded_or_disputed_is_taken_as_unknown(
        stripe_fake: FakeStripe, stripe_processor: StripeProcessor) -> None:
    intent = stripe_fake.add_payment_intent(5_000)
    charge = stripe_fake.charges[stripe_fake.payment_intents[intent]["latest_charge"]]
    del charge["amount_refunded"], charge["disputed"], charge["payment_method_details"]

    listed = next(stripe_processor.list_payment_intents())

    assert (listed.refunded, listed.disputed, listed.card_brand, listed.card_last4) == (None, None, "", "")


@pytest.mark.parametrize("missing", ["amount", "currency", "status", "id"])
def test_a_payment_intent_missing_a_field_is_a_translated_gateway_error(
        stripe_fake: FakeStripe, stripe_processor: StripeProcessor, missing: str) -> None:
    intent = stripe_fake.add_payment_intent(5_000)
    stripe_fake.payment_intents[intent]["amount_received"] = None
    stripe_fake.charges[stripe_fake.payment_intents[intent]["latest_charge"]]["amount_captured"] = None
    if missing != "amount":
        del stripe_fake.payment_intents[intent][missing]

    with pytest.raises(ProcessorDeclined) as caught:
        list(stripe_processor.list_payment_intents())

    assert caught.value.code == "malformed_response"
    assert "payment intent" in caught.value.message


def test_a_refund_answer_missing_its_amount_is_unavailable_not_a_crash(
        stripe_fake: FakeStripe, stripe_processor: StripeProcessor) -> None:
    intent = stripe_fake.add_payment_intent(5_000)
    refund_id = stripe_fake.refund_directly(intent, 1_000)
    del stripe_fake.refunds[refund_id]["amount"]

    with pytest.raises(ProcessorUnavailable) as caught:  # the money may have moved: look again later
        stripe_processor.fetch_refund(refund_id)

    assert caught.value.code == "malformed_response"


def test_a_payments_book_names_each_refunds_reason_for_the_import(
        stripe_fake: FakeStripe, stripe_processor: StripeProcessor) -> None:
    intent = stripe_fake.add_payment_intent(5_000)
    theirs = stripe_fake.refund_directly(intent, 1_000, reason="duplicate")
    ours = stripe_processor.refund(_refund(intent, 2_000, key="rf_1:a"))

    book = stripe_processor.fetch_payment_book(_payment(intent))

    assert {r.processor_refund_id: (r.reason, r.our_refund_id) for r in book.refunds} == {
        theirs: ("duplicate", ""), ours.processor_refund_id: ("requested_by_customer", "rf_1")}
    assert next(r for r in book.refunds if r.processor_refund_id == ours.processor_refund_id).result == ours


def test_list_disputes_names_each_dispute_of_a_payment(
        stripe_fake: FakeStripe, stripe_processor: StripeProcessor) -> None:
    intent = stripe_fake.add_payment_intent(5_000)
    charge = stripe_fake.payment_intents[intent]["latest_charge"]
    first = stripe_fake.add_dispute(charge, reason="fraudulent")
    stripe_fake.close_dispute(first, "lost")
    second = stripe_fake.add_dispute(charge, reason="duplicate", due_by=1_900_000_000)

    listed = stripe_processor.list_disputes(_payment(intent))

    assert {(d.id, d.status, d.reason) for d in listed} == {(first, "lost", "fraudulent"),
                                                            (second, "needs_response", "duplicate")}
    assert all(d.payment_intent == intent and d.charge == charge for d in listed)


def test_create_payment_link_is_one_idempotent_request_for_the_exact_amount(
        stripe_fake: FakeStripe, stripe_processor: StripeProcessor) -> None:
    link = stripe_processor.create_payment_link(
        amount=Money(2599, "USD"), description="Order 1001: balance owed",
        metadata={"order": "1001", "verdict_id": "vd_5"}, idempotency_key="link:1")
    again = stripe_processor.create_payment_link(
        amount=Money(2599, "USD"), description="Order 1001: balance owed",
        metadata={"order": "1001", "verdict_id": "vd_5"}, idempotency_key="link:1")

    assert again == link
    assert link.url.startswith("https://buy.stripe.com/")
    stored = stripe_fake.payment_links[link.id]
    assert stored["line_items"] == [{"price": stored["line_items"][0]["price"], "quantity": 1,
                                     "amount_total": 2599}]
    assert stored["metadata"] == {"order": "1001", "verdict_id": "vd_5"}
    assert stored["payment_intent_data"]["metadata"] == {"order": "1001", "verdict_id": "vd_5"}
    assert len(stripe_fake.payment_links) == 1
