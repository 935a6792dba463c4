"""The PayPal adapter, driven through the official SDK against the local fake PayPal."""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

import pytest

from processors.base import (
    InvalidWebhook,
    PaymentRef,
    ProcessorDeclined,
    ProcessorUnavailable,
    RefundRequest,
)
from processors.money import Money
from processors.paypal import PayPalProcessor, money_from_paypal, paypal_value
from tests.fakes.paypal_server import FakePayPal
from tests.fakes.fixtures import PAYPAL_WEBHOOK_ID


def _capture_ref(capture_id: str) -> PaymentRef:
    return PaymentRef(processor="paypal", account="default", reference=capture_id)


def _authorization_ref(authorization_id: str) -> PaymentRef:
    return PaymentRef(processor="paypal", account="default", reference="",
                      authorization_reference=authorization_id)


def _refund(capture_id: str, amount: int, *, currency: str = "USD", key: str = "rf_1:submit",
            reason: str = "customer_request") -> RefundRequest:
    return RefundRequest(payment=_capture_ref(capture_id), amount=Money(amount, currency),
                         reason=reason, idempotency_key=key, refund_id="rf_1", verdict_id="vd_42")


def _sent(fake: FakePayPal, path_end: str) -> list[dict[str, object]]:
    return [json.loads(r.body or b"{}") for r in fake.received if r.path.endswith(path_end)]


# -- amounts -------------------------------------------------------------------------------------
@pytest.mark.parametrize(("minor", "currency", "text"), [
    (1999, "USD", "19.99"),
    (5, "USD", "0.05"),
    (100, "USD", "1.00"),
    (500, "JPY", "500"),
    (1234, "KWD", "1.234"),
    (5, "KWD", "0.005"),
    (12300, "HUF", "123"),
])
def test_minor_units_become_paypals_exact_decimal_string(minor: int, currency: str,
                                                         text: str) -> None:
    assert paypal_value(Money(minor, currency)) == text
    assert money_from_paypal(text, currency) == Money(minor, currency)


def test_an_amount_paypal_cannot_state_is_refused_not_rounded() -> None:
    with pytest.raises(ProcessorDeclined) as caught:
        paypal_value(Money(12345, "HUF"))  # 123.45 HUF: PayPal takes whole forints only

    assert caught.value.code == "DECIMALS_NOT_SUPPORTED"


def test_a_paypal_amount_with_too_many_decimals_is_not_truncated() -> None:
    with pytest.raises(ValueError):
        money_from_paypal("1.005", "USD")


# -- configuration -------------------------------------------------------------------------------
def test_without_base_url_the_sdk_uses_paypals_own_hosts(paypal_config: dict[str, object]) -> None:
    live = PayPalProcessor(account="default",
                           config={**paypal_config, "base_url": "", "environment": "production"})
    sandbox = PayPalProcessor(account="default", config={**paypal_config, "base_url": ""})

    assert live.configuration.get_base_uri() == "https://api-m.paypal.com"
    assert sandbox.configuration.get_base_uri() == "https://api-m.sandbox.paypal.com"


def test_base_url_reaches_the_same_host_in_either_environment(
        paypal_fake: FakePayPal, paypal_config: dict[str, object]) -> None:
    processor = PayPalProcessor(account="default",
                                config={**paypal_config, "environment": "production"})
    capture = paypal_fake.add_capture("10.00")

    assert processor.refund(_refund(capture, 1000)).status == "succeeded"


# -- refunds -------------------------------------------------------------------------------------
def test_full_refund_of_a_capture_succeeds_and_carries_our_ids(
        paypal_fake: FakePayPal, paypal_processor: PayPalProcessor) -> None:
    capture = paypal_fake.add_capture("50.00")

    result = paypal_processor.refund(_refund(capture, 5000, reason="duplicate"))

    assert (result.status, result.amount) == ("succeeded", Money(5000, "USD"))
    assert _sent(paypal_fake, "/refund") == [{
        "amount": {"currency_code": "USD", "value": "50.00"},
        "custom_id": "rf_1|vd_42|duplicate"}]
    refund_call = next(r for r in paypal_fake.received if r.path.endswith("/refund"))
    assert refund_call.header("PayPal-Request-Id") == "rf_1:submit"
    assert paypal_fake.captures[capture]["status"] == "REFUNDED"


def test_partial_refunds_add_up_to_the_capture(paypal_fake: FakePayPal,
                                               paypal_processor: PayPalProcessor) -> None:
    capture = paypal_fake.add_capture("30.00")

    first = paypal_processor.refund(_refund(capture, 1001, key="rf_1:a"))
    second = paypal_processor.refund(_refund(capture, 1999, key="rf_2:a"))

    assert (first.amount, second.amount) == (Money(1001, "USD"), Money(1999, "USD"))
    assert [body["amount"]["value"] for body in _sent(paypal_fake, "/refund")] == ["10.01", "19.99"]
    assert paypal_fake.captures[capture]["status"] == "REFUNDED"


def test_a_yen_refund_is_sent_without_decimals(paypal_fake: FakePayPal,
                                              paypal_processor: PayPalProcessor) -> None:
    capture = paypal_fake.add_capture("5000", "JPY")

    result = paypal_processor.refund(_refund(capture, 1500, currency="JPY"))

    assert result.amount == Money(1500, "JPY")
    assert _sent(paypal_fake, "/refund")[0]["amount"] == {"currency_code": "JPY", "value": "1500"}


def test_the_same_request_id_twice_creates_one_refund(paypal_fake: FakePayPal,
                                                      paypal_processor: PayPalProcessor) -> None:
    capture = paypal_fake.add_capture("50.00")

    first = paypal_processor.refund(_refund(capture, 2000, key="rf_7:submit"))
    again = paypal_processor.refund(_refund(capture, 2000, key="rf_7:submit"))

    assert again == first
    assert paypal_fake.refund_count == 1


def test_refunding_more_than_remains_is_declined_with_paypals_issue(
        paypal_fake: FakePayPal, paypal_processor: PayPalProcessor) -> None:
    capture = paypal_fake.add_capture("50.00")
    paypal_processor.refund(_refund(capture, 4000, key="rf_1:a"))

    with pytest.raises(ProcessorDeclined) as caught:
        paypal_processor.refund(_refund(capture, 1001, key="rf_2:a"))

    assert caught.value.code == "REFUND_AMOUNT_EXCEEDED"
    assert paypal_fake.refund_count == 1


def test_refunding_a_fully_refunded_capture_is_declined(paypal_fake: FakePayPal,
                                                        paypal_processor: PayPalProcessor) -> None:
    capture = paypal_fake.add_capture("50.00")
    paypal_processor.refund(_refund(capture, 5000, key="rf_1:a"))

    with pytest.raises(ProcessorDeclined) as caught:
        paypal_processor.refund(_refund(capture, 1, key="rf_2:a"))

    assert caught.value.code == "CAPTURE_FULLY_REFUNDED"


def test_refunding_an_unknown_capture_is_declined(paypal_processor: PayPalProcessor) -> None:
    with pytest.raises(ProcessorDeclined) as caught:
        paypal_processor.refund(_refund("0NOSUCHCAPTURE00", 100))

    assert caught.value.code == "INVALID_RESOURCE_ID"


def test_wrong_client_credentials_are_declined_not_retried(
        paypal_fake: FakePayPal, paypal_config: dict[str, object]) -> None:
    processor = PayPalProcessor(account="default",
                                config={**paypal_config, "client_secret": "wrong"})

    with pytest.raises(ProcessorDeclined) as caught:
        processor.refund(_refund(paypal_fake.add_capture("1.00"), 100))

    assert caught.value.code == "invalid_client"


def test_one_access_token_serves_many_calls(paypal_fake: FakePayPal,
                                            paypal_processor: PayPalProcessor) -> None:
    capture = paypal_fake.add_capture("50.00")

    for n in range(3):
        paypal_processor.refund(_refund(capture, 100, key=f"rf_{n}:a"))

    assert paypal_fake.tokens_issued == 1


# -- outages ---------------------------------------------------------------------------------------
def test_a_gateway_answering_503_is_unavailable_even_for_the_token(
        paypal_fake: FakePayPal, paypal_processor: PayPalProcessor) -> None:
    capture = paypal_fake.add_capture("10.00")
    paypal_fake.set_mode("down")

    with pytest.raises(ProcessorUnavailable) as caught:
        paypal_processor.refund(_refund(capture, 1000))

    assert caught.value.code == "SERVICE_UNAVAILABLE"
    assert paypal_fake.refund_count == 0


def test_a_503_after_authenticating_is_unavailable(paypal_fake: FakePayPal,
                                                   paypal_processor: PayPalProcessor) -> None:
    capture = paypal_fake.add_capture("10.00")
    paypal_processor.refund(_refund(capture, 100, key="rf_1:a"))
    paypal_fake.set_mode("down")

    with pytest.raises(ProcessorUnavailable):
        paypal_processor.refund(_refund(capture, 100, key="rf_2:a"))


def test_a_connection_closed_unanswered_is_unavailable(paypal_fake: FakePayPal,
                                                       paypal_processor: PayPalProcessor) -> None:
    capture = paypal_fake.add_capture("10.00")
    paypal_fake.set_mode("unreachable")

    with pytest.raises(ProcessorUnavailable):
        paypal_processor.refund(_refund(capture, 1000))


def test_a_slow_gateway_times_out_as_unavailable(paypal_fake: FakePayPal,
                                                 paypal_config: dict[str, object]) -> None:
    processor = PayPalProcessor(account="default", config={**paypal_config, "timeout": 0.3})
    capture = paypal_fake.add_capture("10.00")
    paypal_fake.set_mode("slow", slow_seconds=3)

    with pytest.raises(ProcessorUnavailable):
        processor.refund(_refund(capture, 1000))


def test_rate_limiting_is_unavailable_with_retry_after(paypal_fake: FakePayPal,
                                                       paypal_processor: PayPalProcessor) -> None:
    capture = paypal_fake.add_capture("10.00")
    paypal_fake.set_mode("rate_limited", retry_after=12)

    with pytest.raises(ProcessorUnavailable) as caught:
        paypal_processor.refund(_refund(capture, 1000))

    assert caught.value.retry_after == 12
    assert caught.value.code == "RATE_LIMIT_REACHED"


def test_a_retry_after_an_outage_with_the_same_request_id_pays_once(
        paypal_fake: FakePayPal, paypal_processor: PayPalProcessor) -> None:
    capture = paypal_fake.add_capture("10.00")
    paypal_fake.set_mode("down")
    with pytest.raises(ProcessorUnavailable):
        paypal_processor.refund(_refund(capture, 1000, key="rf_9:submit"))
    paypal_fake.set_mode("up")

    first = paypal_processor.refund(_refund(capture, 1000, key="rf_9:submit"))
    second = paypal_processor.refund(_refund(capture, 1000, key="rf_9:submit"))

    assert first == second
    assert paypal_fake.refund_count == 1


# -- fetching a refund ---------------------------------------------------------------------------
@pytest.mark.parametrize(("paypals", "ours"), [
    ("COMPLETED", "succeeded"),
    ("PENDING", "pending"),
    ("FAILED", "failed"),
    ("CANCELLED", "canceled"),
])
def test_fetch_refund_maps_paypals_status(paypal_fake: FakePayPal,
                                         paypal_processor: PayPalProcessor,
                                         paypals: str, ours: str) -> None:
    capture = paypal_fake.add_capture("10.00")
    paypal_fake.next_refund_status = "PENDING"
    created = paypal_processor.refund(_refund(capture, 750))
    paypal_fake.set_refund_status(created.processor_refund_id, paypals)

    fetched = paypal_processor.fetch_refund(created.processor_refund_id)

    assert created.status == "pending"
    assert (fetched.status, fetched.amount) == (ours, Money(750, "USD"))
    assert bool(fetched.failure_code) == (ours in ("failed", "canceled"))


def test_fetching_an_unknown_refund_is_declined(paypal_processor: PayPalProcessor) -> None:
    with pytest.raises(ProcessorDeclined) as caught:
        paypal_processor.fetch_refund("0NOSUCHREFUND000")

    assert caught.value.code == "INVALID_RESOURCE_ID"


# -- void and capture ----------------------------------------------------------------------------
def test_void_releases_an_authorisation(paypal_fake: FakePayPal,
                                        paypal_processor: PayPalProcessor) -> None:
    authorization = paypal_fake.add_authorization("80.00")

    result = paypal_processor.void(_authorization_ref(authorization), idempotency_key="void:1",
                                   verdict_id="vd_1")

    assert (result.reference, result.status) == (authorization, "voided")
    assert paypal_fake.authorizations[authorization]["status"] == "VOIDED"
    assert paypal_fake.received[-1].header("PayPal-Request-Id") == "void:1"


def test_a_repeated_void_with_the_same_request_id_answers_the_same(
        paypal_fake: FakePayPal, paypal_processor: PayPalProcessor) -> None:
    authorization = paypal_fake.add_authorization("80.00")
    ref = _authorization_ref(authorization)

    first = paypal_processor.void(ref, idempotency_key="void:1", verdict_id="vd_1")
    again = paypal_processor.void(ref, idempotency_key="void:1", verdict_id="vd_1")

    assert again == first


def test_voiding_a_captured_authorisation_is_declined(paypal_fake: FakePayPal,
                                                      paypal_processor: PayPalProcessor) -> None:
    authorization = paypal_fake.add_authorization("80.00")
    paypal_processor.capture(_authorization_ref(authorization), Money(8000, "USD"),
                             idempotency_key="capture:1", verdict_id="vd_1")

    with pytest.raises(ProcessorDeclined) as caught:
        paypal_processor.void(_authorization_ref(authorization), idempotency_key="void:1",
                              verdict_id="vd_2")

    assert caught.value.code == "PREVIOUSLY_CAPTURED"


def test_void_and_capture_need_the_authorisation_id(paypal_processor: PayPalProcessor) -> None:
    with pytest.raises(ProcessorDeclined) as caught:
        paypal_processor.void(_capture_ref("CAPTUREONLY00000"), idempotency_key="v",
                              verdict_id="vd_1")

    assert caught.value.code == "AUTHORIZATION_ID_REQUIRED"


@pytest.mark.parametrize(("authorised", "minor", "currency", "text"), [
    ("80.00", 6599, "USD", "65.99"),
    ("80.00", 8000, "USD", "80.00"),
    ("12000", 11999, "JPY", "11999"),
])
def test_capture_sends_the_exact_decimal_string(paypal_fake: FakePayPal,
                                                paypal_processor: PayPalProcessor,
                                                authorised: str, minor: int, currency: str,
                                                text: str) -> None:
    authorization = paypal_fake.add_authorization(authorised, currency)

    result = paypal_processor.capture(_authorization_ref(authorization), Money(minor, currency),
                                      idempotency_key="capture:1", verdict_id="vd_1")

    assert _sent(paypal_fake, "/capture")[0]["amount"] == {"currency_code": currency,
                                                           "value": text}
    assert (result.amount, result.status) == (Money(minor, currency), "captured")
    assert result.reference in paypal_fake.captures


def test_a_dinar_capture_goes_out_with_three_decimals_and_paypal_refuses_the_currency(
        paypal_fake: FakePayPal, paypal_processor: PayPalProcessor) -> None:
    # PayPal does not take KWD at all; what matters here is that 12.345 KWD leaves exactly.
    authorization = paypal_fake.add_authorization("80.00")

    with pytest.raises(ProcessorDeclined) as caught:
        paypal_processor.capture(_authorization_ref(authorization), Money(12345, "KWD"),
                                 idempotency_key="capture:1", verdict_id="vd_1")

    assert _sent(paypal_fake, "/capture")[0]["amount"] == {"currency_code": "KWD",
                                                           "value": "12.345"}
    assert caught.value.code == "CURRENCY_NOT_SUPPORTED"


def test_capturing_more_than_authorised_is_declined(paypal_fake: FakePayPal,
                                                    paypal_processor: PayPalProcessor) -> None:
    authorization = paypal_fake.add_authorization("80.00")

    with pytest.raises(ProcessorDeclined) as caught:
        paypal_processor.capture(_authorization_ref(authorization), Money(8001, "USD"),
                                 idempotency_key="capture:1", verdict_id="vd_1")

    assert caught.value.code == "MAX_CAPTURE_AMOUNT_EXCEEDED"


def test_a_repeated_capture_with_the_same_request_id_captures_once(
        paypal_fake: FakePayPal, paypal_processor: PayPalProcessor) -> None:
    authorization = paypal_fake.add_authorization("80.00")
    ref = _authorization_ref(authorization)

    first = paypal_processor.capture(ref, Money(5000, "USD"), idempotency_key="capture:1",
                                     verdict_id="vd_1")
    again = paypal_processor.capture(ref, Money(5000, "USD"), idempotency_key="capture:1",
                                     verdict_id="vd_1")

    assert again == first
    assert len(paypal_fake.captures) == 1


# -- webhooks ------------------------------------------------------------------------------------
EVENT = {"id": "WH-58D329510W468432D-8HN650336L201105X", "event_type": "PAYMENT.CAPTURE.REFUNDED",
         "resource_type": "refund", "create_time": "2024-05-01T12:00:00Z",
         "resource": {"id": "1Y1234567A1234567", "status": "COMPLETED",
                      "amount": {"currency_code": "USD", "value": "10.00"},
                      "custom_id": "rf_1|vd_42|customer_request"}}


def _payload(event: dict[str, object] = EVENT) -> bytes:
    return json.dumps(event).encode()


def test_a_genuine_event_verifies(paypal_fake: FakePayPal,
                                  paypal_processor: PayPalProcessor) -> None:
    headers = paypal_fake.sign_webhook(EVENT, webhook_id=PAYPAL_WEBHOOK_ID)

    event = paypal_processor.verify_webhook(_payload(), headers)

    assert (event.processor, event.event_id, event.type, event.object_id) == (
        "paypal", EVENT["id"], "PAYMENT.CAPTURE.REFUNDED", "1Y1234567A1234567")
    assert event.data["custom_id"] == "rf_1|vd_42|customer_request"
    asked = _sent(paypal_fake, "/verify-webhook-signature")[0]
    assert asked["webhook_id"] == PAYPAL_WEBHOOK_ID and asked["webhook_event"] == EVENT


def test_transmission_headers_are_found_whatever_their_case(
        paypal_fake: FakePayPal, paypal_processor: PayPalProcessor) -> None:
    headers = paypal_fake.sign_webhook(EVENT, webhook_id=PAYPAL_WEBHOOK_ID)

    event = paypal_processor.verify_webhook(
        _payload(), {name.title(): value for name, value in headers.items()})

    assert event.event_id == EVENT["id"]


def test_a_forged_signature_is_invalid(paypal_fake: FakePayPal,
                                       paypal_processor: PayPalProcessor) -> None:
    headers = paypal_fake.sign_webhook(EVENT, webhook_id=PAYPAL_WEBHOOK_ID)
    headers["PAYPAL-TRANSMISSION-SIG"] = "Zm9yZ2Vk" + headers["PAYPAL-TRANSMISSION-SIG"][8:]

    with pytest.raises(InvalidWebhook):
        paypal_processor.verify_webhook(_payload(), headers)


def test_a_tampered_event_is_invalid(paypal_fake: FakePayPal,
                                     paypal_processor: PayPalProcessor) -> None:
    headers = paypal_fake.sign_webhook(EVENT, webhook_id=PAYPAL_WEBHOOK_ID)
    tampered = {**EVENT, "resource": {**EVENT["resource"], "status": "FAILED"}}  # type: ignore[dict-item]

    with pytest.raises(InvalidWebhook):
        paypal_processor.verify_webhook(_payload(tampered), headers)


def test_an_event_signed_for_another_webhook_is_invalid(
        paypal_fake: FakePayPal, paypal_processor: PayPalProcessor) -> None:
    headers = paypal_fake.sign_webhook(EVENT, webhook_id="WH-SOMEONE-ELSES")

    with pytest.raises(InvalidWebhook):
        paypal_processor.verify_webhook(_payload(), headers)


def test_a_stale_transmission_is_invalid(paypal_fake: FakePayPal,
                                         paypal_processor: PayPalProcessor) -> None:
    headers = paypal_fake.sign_webhook(
        EVENT, webhook_id=PAYPAL_WEBHOOK_ID,
        transmission_time=datetime.now(timezone.utc) - timedelta(hours=1))

    with pytest.raises(InvalidWebhook):
        paypal_processor.verify_webhook(_payload(), headers)


def test_missing_transmission_headers_are_invalid_without_asking_paypal(
        paypal_fake: FakePayPal, paypal_processor: PayPalProcessor) -> None:
    headers = paypal_fake.sign_webhook(EVENT, webhook_id=PAYPAL_WEBHOOK_ID)
    del headers["PAYPAL-TRANSMISSION-SIG"]

    with pytest.raises(InvalidWebhook) as caught:
        paypal_processor.verify_webhook(_payload(), headers)

    assert caught.value.code == "missing_signature"
    assert paypal_fake.received == []


def test_a_body_that_is_not_an_event_is_invalid(paypal_fake: FakePayPal,
                                                paypal_processor: PayPalProcessor) -> None:
    headers = paypal_fake.sign_webhook({"id": "x"}, webhook_id=PAYPAL_WEBHOOK_ID)

    with pytest.raises(InvalidWebhook) as caught:
        paypal_processor.verify_webhook(b'{"id": "x"}', headers)

    assert caught.value.code == "malformed"


def test_without_a_webhook_id_nothing_verifies(paypal_fake: FakePayPal,
                                               paypal_config: dict[str, object]) -> None:
    processor = PayPalProcessor(account="default", config={**paypal_config, "webhook_id": ""})
    headers = paypal_fake.sign_webhook(EVENT, webhook_id=PAYPAL_WEBHOOK_ID)

    with pytest.raises(InvalidWebhook):
        processor.verify_webhook(_payload(), headers)


def test_when_paypal_cannot_be_asked_the_event_is_unverified_not_forged(
        paypal_fake: FakePayPal, paypal_processor: PayPalProcessor) -> None:
    headers = paypal_fake.sign_webhook(EVENT, webhook_id=PAYPAL_WEBHOOK_ID)
    paypal_fake.set_mode("down")

    with pytest.raises(ProcessorUnavailable):
        paypal_processor.verify_webhook(_payload(), headers)


# -- reading PayPal's answers defensively ------------------------------------------------------------
def test_a_refund_answer_without_its_amount_value_is_unavailable_not_a_crash(
        paypal_fake: FakePayPal, paypal_processor: PayPalProcessor) -> None:
    refund_id = paypal_fake.refund_directly(paypal_fake.add_capture("10.00"), "4.00")
    del paypal_fake.refunds[refund_id]["amount"]["value"]

    with pytest.raises(ProcessorUnavailable) as caught:  # ours may have paid: look again later
        paypal_processor.fetch_refund(refund_id)

    assert caught.value.code == "malformed_response"


def test_transaction_search_reads_captures_and_refunds_with_their_signs(
        paypal_fake: FakePayPal, paypal_processor: PayPalProcessor) -> None:
    now = datetime.now(timezone.utc)
    capture = paypal_fake.add_capture("25.00", payer={"account_id": "PAYER1", "email_address": "p@example.com"},
                                      created=now - timedelta(days=1))
    refund = paypal_fake.refund_directly(capture, "5.00", custom_id="rf_1|vd_1|duplicate")

    page = paypal_processor.search_transactions(start=now - timedelta(days=2), end=now + timedelta(minutes=1))

    rows = {row.id: row for row in page.transactions}
    assert (rows[capture].event_code, rows[capture].amount, rows[capture].payer_id) == ("T0006", Money(2_500, "USD"),
                                                                                          "PAYER1")
    assert (rows[refund].event_code, rows[refund].amount_minor, rows[refund].reference) == ("T1107", -500, capture)
    assert rows[refund].custom == "rf_1|vd_1|duplicate" and page.total_pages == 1


def test_a_search_longer_than_31_days_is_paypals_final_refusal(paypal_processor: PayPalProcessor) -> None:
    now = datetime.now(timezone.utc)

    with pytest.raises(ProcessorDeclined) as caught:
        paypal_processor.search_transactions(start=now - timedelta(days=40), end=now)

    assert caught.value.code == "INVALID_PARAMETER_VALUE"
