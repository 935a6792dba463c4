"""PayPal behind the processor interface, through the official ``paypal-server-sdk``.

The SDK knows only PayPal's two hosts; :class:`_Configuration` adds a ``base_url`` override (as
``stripe`` takes ``base_addresses``) so the same adapter code reaches a local fake in tests.
Every SDK call goes through :func:`_edge`, which turns its errors into
:class:`ProcessorUnavailable` (retry later) or :class:`ProcessorDeclined` (final, with PayPal's
issue name as the code).
"""

from __future__ import annotations

import json
import threading
import time
from urllib.parse import urlsplit
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from decimal import Decimal, InvalidOperation
from typing import Any

import redis
import requests
from apimatic_core.exceptions.auth_validation_exception import AuthValidationException
from paypalserversdk.configuration import Configuration, Environment, Server
from paypalserversdk.exceptions.api_exception import ApiException
from paypalserversdk.http.auth.o_auth_2 import ClientCredentialsAuthCredentials, OAuth2
from paypalserversdk.models.capture_request import CaptureRequest
from paypalserversdk.models.money import Money as PayPalMoney
from paypalserversdk.models.o_auth_token import OAuthToken
from paypalserversdk.models.refund_request import RefundRequest as PayPalRefundRequest
from paypalserversdk.paypal_serversdk_client import PaypalServersdkClient

from processors.base import (
    EVIDENCE_HEADINGS,
    CaptureResult,
    DisputeSubmission,
    GatewayRefund,
    InvalidWebhook,
    OutcomeUnknown,
    PaymentBook,
    PaymentRef,
    PaymentState,
    ProcessorDeclined,
    ProcessorError,
    ProcessorUnavailable,
    RefundRequest,
    RefundResult,
    RefundStatus,
    VoidResult,
    WebhookEvent,
    request_may_have_been_sent,
)
from processors.money import Money, currency_exponent
from processors.redis_client import redis_client, redis_key

STATUSES: dict[str, RefundStatus] = {
    "COMPLETED": "succeeded",
    "PENDING": "pending",
    "FAILED": "failed",
    "CANCELLED": "canceled",
}

# PayPal takes these currencies in whole units only, though ISO 4217 gives HUF and TWD cents.
NO_DECIMALS = frozenset({"HUF", "JPY", "TWD"})

TRANSMISSION_HEADERS = {
    "auth_algo": "PAYPAL-AUTH-ALGO",
    "cert_url": "PAYPAL-CERT-URL",
    "transmission_id": "PAYPAL-TRANSMISSION-ID",
    "transmission_sig": "PAYPAL-TRANSMISSION-SIG",
    "transmission_time": "PAYPAL-TRANSMISSION-TIME",
}

CUSTOM_ID_MAX = 127  # PayPal's limit for custom_id
# Where PayPal keeps the certificates it signs webhooks with; a transmission naming any other is forged.
CERT_HOSTS = frozenset({"api.paypal.com", "api-m.paypal.com", "api.sandbox.paypal.com", "api-m.sandbox.paypal.com"})
WEBHOOK_TOLERANCE_SECONDS = 300  # PayPal stamps each transmission (retries too) when it sends it

# One OAuth token per PayPal app (base URL, client id) per process, kept until it expires: every
# adapter instance (one per call) used to fetch its own, spending PayPal's rate limit on tokens.
_tokens: dict[tuple[str, str], OAuthToken] = {}
_tokens_lock = threading.Lock()
EVIDENCE_NOTES_MAX = 2_000  # characters in one evidence's notes

# A capture in these states took the money (pending: PayPal holds it, but it is taken).
CAPTURED_STATUSES = frozenset({"COMPLETED", "PARTIALLY_REFUNDED", "REFUNDED", "PENDING"})
MISSING = frozenset({"INVALID_RESOURCE_ID", "RESOURCE_NOT_FOUND"})


@dataclass(frozen=True, slots=True)
class PayPalDispute:
    id: str
    amount: Money | None  # PayPal may leave it out of a dispute it is still gathering
    status: str  # PayPal's own: OPEN, WAITING_FOR_SELLER_RESPONSE, UNDER_REVIEW, RESOLVED, …
    outcome: str  # dispute_outcome.outcome_code once RESOLVED, e.g. RESOLVED_SELLER_FAVOUR; else ""
    reason: str
    captures: tuple[str, ...]  # disputed_transactions[].seller_transaction_id: our capture ids
    respond_by: int | None  # seller_response_due_date as Unix time


@dataclass(frozen=True, slots=True)
class PayPalTransaction:
    """One row of PayPal's transaction search (the reporting API), read defensively."""

    id: str
    event_code: str  # T-code: T0006 a checkout payment, T1107 a refund by the merchant, …
    status: str  # S completed, P pending, V reversed, D denied
    currency: str
    amount_minor: int | None  # signed as PayPal gives it (a refund is negative); None in a currency we do not take
    initiated: int  # Unix time
    reference: str  # paypal_reference_id: for a refund, the capture it refunds
    custom: str  # custom_field: for a refund RefundOps made, "rf_…|vd_…|reason"
    invoice: str
    payer_id: str
    payer_email: str
    payer_name: str

    @property
    def amount(self) -> Money | None:
        return None if self.amount_minor is None else Money(abs(self.amount_minor), self.currency)


@dataclass(frozen=True, slots=True)
class TransactionPage:
    transactions: tuple[PayPalTransaction, ...]
    page: int
    total_pages: int


def paypal_time(value: str) -> int:
    """PayPal's times ("…Z", "…+00:00" and the reporting API's "…+0000") as Unix time."""
    text = value.strip().replace("Z", "+00:00")
    if len(text) > 5 and text[-5] in "+-" and text[-3] != ":":
        text = f"{text[:-2]}:{text[-2:]}"
    return int(datetime.fromisoformat(text).timestamp())


def paypal_value(amount: Money) -> str:
    """Minor units as PayPal's decimal string, exactly: 1999 USD → "19.99", 500 JPY → "500",
    1234 KWD → "1.234". Refuses an amount PayPal cannot state rather than rounding it."""
    if amount.amount_minor < 0:
        raise ProcessorDeclined("PayPal amounts are never negative", code="NEGATIVE_AMOUNT")
    exponent = amount.exponent
    whole, fraction = divmod(amount.amount_minor, 10**exponent)
    if amount.currency in NO_DECIMALS:
        if fraction:
            raise ProcessorDeclined(f"PayPal takes {amount.currency} in whole units only; "
                                    f"{amount} is not one", code="DECIMALS_NOT_SUPPORTED")
        return str(whole)
    return f"{whole}.{fraction:0{exponent}d}" if exponent else str(whole)


def money_from_paypal(value: str, currency: str) -> Money:
    """PayPal's decimal string back into minor units, exactly."""
    try:
        minor = Decimal(value).scaleb(currency_exponent(currency))
    except InvalidOperation:
        raise ValueError(f"{value!r} is not a PayPal amount") from None
    if minor != minor.to_integral_value():
        raise ValueError(f"{value} {currency} has more decimals than {currency} allows")
    return Money(int(minor), currency)


class _Configuration(Configuration):
    """The SDK's configuration with one addition: ``base_url`` replaces PayPal's host."""

    def __init__(self, *, base_url: str = "", **kwargs: Any) -> None:
        self._base_url = base_url.rstrip("/")
        super().__init__(**kwargs)

    def get_base_uri(self, server: Server = Server.DEFAULT) -> str:
        return self._base_url or super().get_base_uri(server)


def _retry_after(headers: Mapping[str, str] | None) -> float | None:
    for name, value in (headers or {}).items():
        if name.lower() == "retry-after":
            try:
                return max(0.0, float(value))
            except ValueError:
                return None  # an HTTP date: PayPal sends seconds when it sends anything
    return None


def _error_code(exc: ApiException) -> str:
    """PayPal's most specific name for the error: the first issue, else the error's name."""
    details = getattr(exc, "details", None) or []
    issue = getattr(details[0], "issue", None) if details else None
    code = issue or getattr(exc, "name", None) or getattr(exc, "error", None)
    if not code:
        # The SDK reads the token call's errors as OAuth errors, so a 503 or 429 there keeps
        # PayPal's usual error object unread.
        try:
            body = json.loads(exc.response.text or "")
        except ValueError:
            body = None
        if isinstance(body, dict):
            code = body.get("name") or body.get("error")
    return str(code or f"http_{exc.response_code}")


def _body_code(answer: requests.Response) -> str:
    """PayPal's error name (first issue first) from a raw answer, else its HTTP status."""
    try:
        body = answer.json()
    except ValueError:
        body = None
    if isinstance(body, dict):
        issue = ((body.get("details") or [{}])[0] or {}).get("issue")
        if issue or body.get("name"):
            return str(issue or body["name"])
    return f"http_{answer.status_code}"


def _body_message(answer: requests.Response) -> str:
    """PayPal's own words for an error: the first issue's description, else the message."""
    try:
        body = answer.json()
    except ValueError:
        return ""
    if not isinstance(body, dict):
        return ""
    detail = (body.get("details") or [{}])[0] or {}
    return str(detail.get("description") or body.get("message") or "")


@contextmanager
def _reading(what: str, *, after_write: bool = False) -> Iterator[None]:
    """Read a PayPal answer defensively: a field missing or of the wrong type is PayPal's fault,
    ``malformed_response``: unavailable after a write (the money may have moved), else final."""
    try:
        yield
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        error = OutcomeUnknown if after_write else ProcessorDeclined
        raise error(f"paypal {what}: an answer RefundOps cannot read ({exc})", code="malformed_response") from None


def forget_tokens() -> None:
    with _tokens_lock:
        _tokens.clear()


@contextmanager
def _edge(action: str, *, write: bool = False) -> Iterator[None]:
    """Translate every SDK and transport error raised inside; nothing else escapes. For a write
    (``write``), an answer lost after the request may have reached PayPal is
    :class:`OutcomeUnknown`: PayPal may have acted."""
    try:
        yield
    except ApiException as exc:
        status = exc.response_code
        if status == 401:
            forget_tokens()  # revoked or rotated: the next call fetches a new one
        message = f"paypal {action}: HTTP {status} {getattr(exc, 'message', None) or exc.reason}"
        if write and status >= 500 and status != 503:
            raise OutcomeUnknown(message, code=_error_code(exc),
                                 retry_after=_retry_after(exc.response.headers)) from exc
        if status == 429 or status >= 500:
            raise ProcessorUnavailable(message, code=_error_code(exc),
                                       retry_after=_retry_after(exc.response.headers)) from exc
        raise ProcessorDeclined(message, code=_error_code(exc)) from exc
    except requests.RequestException as exc:
        if write and request_may_have_been_sent(exc):
            raise OutcomeUnknown(f"paypal {action}: no answer after the request was sent ({exc})",
                                 code="paypal_no_answer") from exc
        raise ProcessorUnavailable(f"paypal {action}: {exc}", code="paypal_unreachable") from exc
    except AuthValidationException as exc:
        raise ProcessorDeclined(f"paypal {action}: {exc}", code="AUTHENTICATION_FAILURE") from exc


class PayPalProcessor:
    name = "paypal"

    def __init__(self, *, account: str, config: Mapping[str, Any]) -> None:
        self.account = account
        self.webhook_id: str = config.get("webhook_id") or ""
        self.timeout = float(config.get("timeout") or 30)
        environment = (Environment.PRODUCTION if config.get("environment") == "production"
                       else Environment.SANDBOX)
        self._token: OAuthToken | None = None
        self._client_id = str(config["client_id"])
        self.webhook_tolerance = int(config.get("webhook_tolerance") or WEBHOOK_TOLERANCE_SECONDS)
        self.verify_per_minute = int(config.get("webhook_verify_per_minute") or 120)
        self.configuration = _Configuration(
            base_url=config.get("base_url") or "",
            environment=environment,
            timeout=self.timeout,
            max_retries=0,  # the worker owns retrying, with the same PayPal-Request-Id
            client_credentials_auth_credentials=ClientCredentialsAuthCredentials(
                o_auth_client_id=config["client_id"], o_auth_client_secret=config["client_secret"],
                o_auth_token_provider=self._fetch_token),
        )
        self.client = PaypalServersdkClient(config=self.configuration)

    # -- the interface ---------------------------------------------------------------------------
    def refund(self, request: RefundRequest) -> RefundResult:
        body = PayPalRefundRequest(
            amount=PayPalMoney(currency_code=request.amount.currency,
                               value=paypal_value(request.amount)),
            custom_id=self._custom_id(request))
        with _edge("refund"):
            response = self.client.payments.refund_captured_payment({
                "capture_id": request.payment.reference,
                "paypal_request_id": request.idempotency_key,
                "prefer": "return=representation",
                "body": body,
            })
        with _reading("refund", after_write=True):
            return self._refund_result(response.body, fallback_amount=request.amount)

    def fetch_refund(self, processor_refund_id: str) -> RefundResult:
        with _edge("fetch refund"):
            response = self.client.payments.get_refund({"refund_id": processor_refund_id})
        with _reading("refund", after_write=True):  # ours: the money may have moved
            return self._refund_result(response.body)

    def fetch_payment_book(self, payment: PaymentRef, *,
                           known_refund_ids: Sequence[str] = ()) -> PaymentBook:
        """A capture's amount and its refunds. PayPal lists a capture's refunds only with its order
        (``GET /v2/checkout/orders/{id}``, the purchase unit's ``payments``, each refund linking
        ``up`` to its capture); the capture names its order in ``supplementary_data.related_ids``.
        A capture with no order (made before the Orders API) is read with the refunds we know, by
        id, and its book says it is not complete."""
        with _edge("fetch capture"):
            capture = self.client.payments.get_captured_payment({"capture_id": payment.reference}).body
        captured, order_id = _read("capture", payment.reference, lambda: (
            _captured(capture), getattr(getattr(getattr(capture, "supplementary_data", None), "related_ids", None),
                                        "order_id", None) or ""))
        if order_id:
            with _edge("fetch order"):
                order = self.client.orders.get_order({"id": order_id}).body
            listed = _read("order", order_id, lambda: _order_refunds(order, capture_id=payment.reference))
        else:
            listed = []
            for refund_id in known_refund_ids:
                try:
                    with _edge("fetch refund"):
                        refund = self.client.payments.get_refund({"refund_id": refund_id}).body
                except ProcessorDeclined as refused:
                    if refused.code in MISSING:
                        continue  # not at PayPal: the book leaves it out, for the reconciler to see
                    raise
                if _link_id(refund, "up") in ("", payment.reference):
                    listed.append(refund)
        refunds = tuple(_read("refund", getattr(refund, "id", "?"), lambda r=refund: _gateway_refund(r))
                        for refund in listed)
        return PaymentBook(reference=payment.reference, captured=captured, refunds=refunds, complete=bool(order_id))

    def void(self, payment: PaymentRef, *, idempotency_key: str, verdict_id: str) -> VoidResult:
        # PayPal's void takes no body, so the verdict travels only in our own records.
        authorization_id = self._authorization_id(payment)
        with _edge("void", write=True):
            response = self.client.payments.void_payment({
                "authorization_id": authorization_id,
                "paypal_request_id": idempotency_key,
                "prefer": "return=representation",
            })
        status = getattr(response.body, "status", None)
        if status not in (None, "VOIDED"):  # None: a minimal 204 answer, which means voided
            raise ProcessorDeclined(f"authorisation {authorization_id} is {status} after void",
                                    code="AUTHORIZATION_NOT_VOIDED")
        return VoidResult(reference=authorization_id, status="voided")

    def capture(self, payment: PaymentRef, amount: Money, *, idempotency_key: str,
                verdict_id: str) -> CaptureResult:
        authorization_id = self._authorization_id(payment)
        body = CaptureRequest(
            amount=PayPalMoney(currency_code=amount.currency, value=paypal_value(amount)),
            final_capture=True)
        with _edge("capture", write=True):
            response = self.client.payments.capture_authorized_payment({
                "authorization_id": authorization_id,
                "paypal_request_id": idempotency_key,
                "prefer": "return=representation",
                "body": body,
            })
        with _reading("capture", after_write=True):
            capture = response.body
            if capture.status not in ("COMPLETED", "PENDING"):
                raise ProcessorDeclined(f"PayPal capture is {capture.status}",
                                        code=f"CAPTURE_{capture.status}")
            captured = (money_from_paypal(capture.amount.value, capture.amount.currency_code)
                        if getattr(capture, "amount", None) else amount)
            if not capture.id:
                raise ValueError("a capture without an id")
            return CaptureResult(reference=str(capture.id), amount=captured,
                                 status="captured" if capture.status == "COMPLETED" else "pending")

    def fetch_payment_state(self, payment: PaymentRef) -> PaymentState:
        """The authorisation as PayPal has it now (``GET /v2/payments/authorizations/{id}``); once
        captured, its captures are read from its order, each linking ``up`` to the authorisation."""
        authorization_id = self._authorization_id(payment)
        with _edge("fetch authorization"):
            authorization = self.client.payments.get_authorized_payment({"authorization_id": authorization_id}).body
        status, order_id = _read("authorization", authorization_id, lambda: (
            str(authorization.status),
            getattr(getattr(getattr(authorization, "supplementary_data", None), "related_ids", None),
                    "order_id", None) or ""))
        if status == "VOIDED":
            return PaymentState(reference=authorization_id, status="voided")
        if status not in ("CAPTURED", "PARTIALLY_CAPTURED"):
            return PaymentState(reference=authorization_id, status="authorized")
        captures: list[Any] = []
        if order_id:
            with _edge("fetch order"):
                order = self.client.orders.get_order({"id": order_id}).body
            captures = _read("order", order_id, lambda: [
                c for unit in order.purchase_units or [] for c in getattr(unit.payments, "captures", None) or []
                if _link_id(c, "up") == authorization_id and c.status in ("COMPLETED", "PENDING")])
        if not captures:  # captured, PayPal says, but its captures are not to be read here
            return PaymentState(reference=authorization_id, status="captured")
        captured = _read("capture", captures[0].id, lambda: Money(
            sum(money_from_paypal(c.amount.value, c.amount.currency_code).amount_minor for c in captures),
            captures[0].amount.currency_code))
        pending = all(c.status == "PENDING" for c in captures)
        return PaymentState(reference=authorization_id, status="capture_pending" if pending else "captured",
                            captured=captured, capture_reference=str(captures[0].id))

    def verify_webhook(self, payload: bytes, headers: Mapping[str, str]) -> WebhookEvent:
        """PayPal verifies its own signatures: we post the transmission headers and the event to
        ``/v1/notifications/verify-webhook-signature`` (the SDK has no call for it). When PayPal
        cannot be asked, that is :class:`ProcessorUnavailable`, not a forged event."""
        if not self.webhook_id:
            raise InvalidWebhook("no PayPal webhook id is configured", code="not_configured")
        lowered = {key.lower(): value for key, value in headers.items()}
        transmission = {field: lowered.get(name.lower(), "")
                        for field, name in TRANSMISSION_HEADERS.items()}
        missing = [TRANSMISSION_HEADERS[f] for f, value in transmission.items() if not value]
        if missing:
            raise InvalidWebhook(f"missing {', '.join(missing)}", code="missing_signature")
        self._plausible(transmission)
        try:
            event = json.loads(payload)
            resource = event["resource"]
            # Disputes name themselves by dispute_id; every other resource by id.
            object_id = resource.get("dispute_id") or resource["id"]
            webhook_event = WebhookEvent(processor=self.name, event_id=str(event["id"]),
                                         type=str(event["event_type"]),
                                         object_id=str(object_id), data=resource)
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidWebhook(f"malformed PayPal event: {exc}", code="malformed") from None
        self._spend_verification()
        with _edge("verify webhook"):
            answer = requests.post(
                f"{self.configuration.get_base_uri()}/v1/notifications/verify-webhook-signature",
                json={**transmission, "webhook_id": self.webhook_id, "webhook_event": event},
                headers={"Authorization": f"Bearer {self._access_token()}"},
                timeout=self.timeout)
        if answer.status_code == 401:
            forget_tokens()
        if answer.status_code in (401, 429) or answer.status_code >= 500:
            raise ProcessorUnavailable(f"paypal verify webhook: HTTP {answer.status_code}",
                                       retry_after=_retry_after(answer.headers))
        try:
            status = answer.json().get("verification_status")
        except ValueError:
            status = None
        if answer.status_code != 200 or status != "SUCCESS":
            raise InvalidWebhook(f"PayPal did not verify the event (HTTP {answer.status_code}, "
                                 f"{status or 'no verification_status'})")
        return webhook_event

    def _plausible(self, transmission: Mapping[str, str]) -> None:
        """What we can check ourselves before asking PayPal (with our token, on our rate limit):
        PayPal's algorithm, a certificate on PayPal's hosts, a transmission sent just now.
        (The webhook id is inside the RSA signature, which only PayPal's verify call checks.)"""
        if transmission["auth_algo"] != "SHA256withRSA":
            raise InvalidWebhook(f"PayPal signs with SHA256withRSA, not {transmission['auth_algo'][:40]!r}")
        cert = urlsplit(transmission["cert_url"])
        if cert.scheme != "https" or cert.hostname not in CERT_HOSTS or cert.port not in (None, 443):
            raise InvalidWebhook("the certificate URL is not on PayPal's hosts")
        try:
            sent = datetime.fromisoformat(transmission["transmission_time"].replace("Z", "+00:00"))
            age = abs(time.time() - sent.timestamp())
        except (ValueError, OverflowError):
            raise InvalidWebhook("PAYPAL-TRANSMISSION-TIME is not a time") from None
        if age > self.webhook_tolerance:
            raise InvalidWebhook(f"the transmission is {int(age)}s old; at most {self.webhook_tolerance}s is "
                                 "accepted", code="stale")

    def _spend_verification(self) -> None:
        """At most ``webhook_verify_per_minute`` verify calls per account: forged deliveries that
        pass :meth:`_plausible` cannot spend the rate limit that refunds depend on. Past it the
        delivery is asked to come again (PayPal retries for three days)."""
        key = redis_key(f"paypal:verify:{self.account}:{int(time.time() // 60)}")
        try:
            client = redis_client()
            count = client.incr(key)
            if count == 1:
                client.expire(key, 120)
        except redis.RedisError:
            return  # our outage is not PayPal's: verify as before
        if count > self.verify_per_minute:
            raise ProcessorUnavailable("paypal verify webhook: this minute's verification budget is spent",
                                       code="verify_budget", retry_after=60 - time.time() % 60)

    # -- PayPal-only operations ------------------------------------------------------------------
    def fetch_dispute(self, dispute_id: str) -> PayPalDispute:
        """``GET /v1/customer/disputes/{id}``: the SDK has no disputes controller, so this goes
        over ``requests`` with the SDK's OAuth token, as :meth:`verify_webhook` does."""
        with _edge("fetch dispute"):
            token = self._access_token()
            answer = requests.get(f"{self.configuration.get_base_uri()}/v1/customer/disputes/{dispute_id}",
                                  headers={"Authorization": f"Bearer {token}"}, timeout=self.timeout)
        if answer.status_code == 429 or answer.status_code >= 500:
            raise ProcessorUnavailable(f"paypal fetch dispute: HTTP {answer.status_code}",
                                       code=_body_code(answer), retry_after=_retry_after(answer.headers))
        if answer.status_code != 200:
            raise ProcessorDeclined(f"paypal fetch dispute {dispute_id}: HTTP {answer.status_code}",
                                    code=_body_code(answer))
        try:
            body = answer.json()
            amount = body.get("dispute_amount")
            due = body.get("seller_response_due_date")
            return PayPalDispute(
                id=str(body["dispute_id"]),
                amount=money_from_paypal(amount["value"], amount["currency_code"]) if amount else None,
                status=str(body["status"]),
                outcome=str((body.get("dispute_outcome") or {}).get("outcome_code") or ""),
                reason=str(body.get("reason") or ""),
                captures=tuple(str(t["seller_transaction_id"]) for t in body.get("disputed_transactions") or []
                               if t.get("seller_transaction_id")),
                respond_by=int(datetime.fromisoformat(due.replace("Z", "+00:00")).timestamp()) if due else None)
        except (ValueError, KeyError, TypeError) as exc:
            raise ProcessorDeclined(f"paypal dispute {dispute_id} is malformed: {exc}",
                                    code="MALFORMED_DISPUTE") from None

    def search_transactions(self, *, start: datetime, end: datetime, page: int = 1,
                            page_size: int = 500) -> TransactionPage:
        """One page of the balance-affecting transactions initiated from ``start`` to ``end``
        (PayPal takes at most 31 days at a time), through the SDK's transaction search."""
        with _edge("search transactions"):
            response = self.client.transaction_search.search_transactions({
                "start_date": start.strftime("%Y-%m-%dT%H:%M:%SZ"), "end_date": end.strftime("%Y-%m-%dT%H:%M:%SZ"),
                "fields": "all", "page_size": page_size, "page": page})
        body = response.body
        try:
            rows = getattr(body, "transaction_details", None) or []
            return TransactionPage(transactions=tuple(self._transaction(row) for row in rows),
                                   page=int(getattr(body, "page", None) or page),
                                   total_pages=int(getattr(body, "total_pages", None) or 1))
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            raise ProcessorDeclined(f"paypal search transactions: an answer RefundOps cannot read ({exc})",
                                    code="malformed_response") from None

    def list_disputes(self, *, created_after: datetime, page_size: int = 50) -> Iterator[str]:
        """The ids of every dispute created at or after ``created_after`` (PayPal lists the last 180
        days), newest first; :meth:`fetch_dispute` tells each one's whole story."""
        page = 1
        while True:
            with _edge("list disputes"):
                token = self._access_token()
                answer = requests.get(f"{self.configuration.get_base_uri()}/v1/customer/disputes",
                                      params={"create_time_after": created_after.strftime("%Y-%m-%dT%H:%M:%S.000Z"),
                                              "page_size": page_size, "page": page},
                                      headers={"Authorization": f"Bearer {token}"}, timeout=self.timeout)
            self._raise_for_status(answer, "list disputes")
            try:
                body = answer.json()
                items = body.get("items") or []
                ids = [str(item["dispute_id"]) for item in items]
                more = any(link.get("rel") == "next" for link in body.get("links") or [])
            except (AttributeError, KeyError, TypeError, ValueError) as exc:
                raise ProcessorDeclined(f"paypal list disputes: an answer RefundOps cannot read ({exc})",
                                        code="malformed_response") from None
            yield from ids
            if not more or not ids:
                return
            page += 1

    def submit_dispute_evidence(self, dispute_id: str, evidence: Mapping[str, str], *,
                                idempotency_key: str) -> DisputeSubmission:
        """``POST /v1/customer/disputes/{id}/provide-evidence`` (multipart, an ``input`` JSON part):
        each drafted text as notes of an ``OTHER`` evidence, headed, in as many notes as PayPal's
        2,000-character limit needs. The SDK has no disputes controller; this goes over
        ``requests`` with the SDK's token, as :meth:`fetch_dispute` does."""
        notes = []
        for name, heading in EVIDENCE_HEADINGS.items():
            text = evidence.get(name, "").strip()
            if text:
                whole = f"{heading}: {text}"
                notes += [whole[i:i + EVIDENCE_NOTES_MAX] for i in range(0, len(whole), EVIDENCE_NOTES_MAX)]
        body = {"evidences": [{"evidence_type": "OTHER", "notes": note} for note in notes]}
        with _edge("provide dispute evidence"):
            token = self._access_token()
            answer = requests.post(
                f"{self.configuration.get_base_uri()}/v1/customer/disputes/{dispute_id}/provide-evidence",
                files={"input": (None, json.dumps(body), "application/json")},
                headers={"Authorization": f"Bearer {token}", "PayPal-Request-Id": idempotency_key},
                timeout=self.timeout)
        self._raise_for_status(answer, f"provide evidence for dispute {dispute_id}")
        # PayPal answers with links only: where the dispute stands now is asked of the dispute.
        try:
            status = self.fetch_dispute(dispute_id).status
        except ProcessorError:
            status = "EVIDENCE_PROVIDED"  # taken; its new state is for the dispute's own events
        return DisputeSubmission(dispute_id=dispute_id, status=status)

    # -- helpers ---------------------------------------------------------------------------------
    @staticmethod
    def _transaction(row: Any) -> PayPalTransaction:
        info = getattr(row, "transaction_info", None)
        payer = getattr(row, "payer_info", None)
        amount = getattr(info, "transaction_amount", None)
        currency = str(getattr(amount, "currency_code", None) or "")
        try:
            minor = money_from_paypal(str(amount.value).lstrip("-"), currency).amount_minor
            minor = -minor if str(amount.value).startswith("-") else minor
        except (AttributeError, ValueError):
            minor = None  # a currency we do not take, or no amount: nothing to import
        name = getattr(payer, "payer_name", None)
        full_name = getattr(name, "alternate_full_name", None) or " ".join(
            part for part in (getattr(name, "given_name", None), getattr(name, "surname", None)) if part)
        transaction_id = getattr(info, "transaction_id", None)
        if not transaction_id:
            raise ValueError("a transaction without transaction_id")
        return PayPalTransaction(
            id=str(transaction_id), event_code=str(getattr(info, "transaction_event_code", None) or ""),
            status=str(getattr(info, "transaction_status", None) or ""), currency=currency, amount_minor=minor,
            initiated=paypal_time(str(info.transaction_initiation_date)),
            reference=str(getattr(info, "paypal_reference_id", None) or ""),
            custom=str(getattr(info, "custom_field", None) or ""), invoice=str(getattr(info, "invoice_id", None) or ""),
            payer_id=str(getattr(payer, "account_id", None) or getattr(info, "paypal_account_id", None) or ""),
            payer_email=str(getattr(payer, "email_address", None) or ""), payer_name=str(full_name or ""))

    @staticmethod
    def _raise_for_status(answer: requests.Response, action: str) -> None:
        if answer.status_code == 429 or answer.status_code >= 500:
            raise ProcessorUnavailable(f"paypal {action}: HTTP {answer.status_code}", code=_body_code(answer),
                                       retry_after=_retry_after(answer.headers))
        if not 200 <= answer.status_code < 300:
            raise ProcessorDeclined(f"paypal {action}: HTTP {answer.status_code} {_body_message(answer)}".rstrip(),
                                    code=_body_code(answer))

    def _fetch_token(self, last_token: OAuthToken | None, auth: OAuth2) -> OAuthToken:
        """The process's token for this app while it lasts; else the SDK's own token call, given
        as a provider so its failures reach :func:`_edge` (the SDK's default path swallows them
        into a bare "token undefined" error)."""
        app = (self.configuration.get_base_uri(), self._client_id)
        with _tokens_lock:
            cached = _tokens.get(app)
        if cached is None or auth.is_token_expired(cached):
            cached = auth.fetch_token()
            with _tokens_lock:
                _tokens[app] = cached
        self._token = cached
        return cached

    def _access_token(self) -> str:
        if not self.client.oauth_2.is_valid() or self._token is None:
            raise AuthValidationException("PayPal gave no access token")
        return str(self._token.access_token)

    @staticmethod
    def _custom_id(request: RefundRequest) -> str:
        # PayPal refunds have no metadata; custom_id carries our ids back on events and reports.
        custom_id = f"{request.refund_id}|{request.verdict_id}|{request.reason}"
        if len(custom_id) > CUSTOM_ID_MAX:
            raise ProcessorDeclined("refund and verdict ids exceed PayPal's custom_id",
                                    code="CUSTOM_ID_TOO_LONG")
        return custom_id

    @staticmethod
    def _authorization_id(payment: PaymentRef) -> str:
        if not payment.authorization_reference:
            raise ProcessorDeclined("a PayPal void or capture needs the authorisation id",
                                    code="AUTHORIZATION_ID_REQUIRED")
        return payment.authorization_reference

    @staticmethod
    def _refund_result(refund: Any, *, fallback_amount: Money | None = None) -> RefundResult:
        status = STATUSES.get(getattr(refund, "status", None) or "", "pending")
        amount = getattr(refund, "amount", None)
        money = (money_from_paypal(amount.value, amount.currency_code) if amount is not None
                 else fallback_amount)
        if money is None:
            raise ProcessorDeclined(f"PayPal refund {refund.id} has no amount", code="NO_AMOUNT")
        if not getattr(refund, "id", None):
            raise ValueError("a refund without an id")
        details = getattr(refund, "status_details", None)
        reason = str(getattr(details, "reason", "") or "") if details else ""
        final_failure = status in ("failed", "canceled")
        return RefundResult(
            processor_refund_id=refund.id, status=status, amount=money,
            failure_code=(reason or refund.status) if final_failure else "",
            failure_message=f"PayPal refund {refund.status}" if final_failure else "")


def _read(what: str, object_id: str, read: Any) -> Any:
    """A PayPal object read into ours; one lacking what we need is PayPal's malformed answer."""
    try:
        return read()
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ProcessorDeclined(f"PayPal {what} {object_id} is malformed: {exc!r}",
                                code=f"MALFORMED_{what.upper()}") from None


def _captured(capture: Any) -> Money:
    money = money_from_paypal(capture.amount.value, capture.amount.currency_code)
    return money if getattr(capture, "status", None) in CAPTURED_STATUSES else Money(0, money.currency)


def _link_id(resource: Any, rel: str) -> str:
    """The last path segment of the resource's HATEOAS link ``rel``, e.g. the capture a refund is of."""
    return next((str(link.href).rstrip("/").rsplit("/", 1)[-1] for link in getattr(resource, "links", None) or []
                 if getattr(link, "rel", None) == rel), "")


def _order_refunds(order: Any, *, capture_id: str) -> list[Any]:
    """The order's refunds of one capture. A refund whose ``up`` link is missing is the capture's
    when the order has no other capture."""
    units = [getattr(unit, "payments", None) for unit in getattr(order, "purchase_units", None) or []]
    captures = {c.id for payments in units if payments for c in getattr(payments, "captures", None) or []}
    refunds = [r for payments in units if payments for r in getattr(payments, "refunds", None) or []]
    return [r for r in refunds if _link_id(r, "up") == capture_id or (not _link_id(r, "up") and captures == {capture_id})]


def _gateway_refund(refund: Any) -> GatewayRefund:
    custom = str(getattr(refund, "custom_id", None) or "").split("|")[0]  # ours: "rf_…|vd_…|reason"
    created = getattr(refund, "create_time", None)
    return GatewayRefund(
        processor_refund_id=str(refund.id),
        amount=money_from_paypal(refund.amount.value, refund.amount.currency_code),
        status=STATUSES.get(getattr(refund, "status", None) or "", "pending"),
        our_refund_id=custom if custom.startswith("rf_") else "",
        created_at=datetime.fromisoformat(str(created).replace("Z", "+00:00")) if created else None)
