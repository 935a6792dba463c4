"""Stripe behind the processor interface, through the official SDK (``stripe.StripeClient``).

Every SDK call goes through :func:`_edge`, which turns Stripe's typed errors into
:class:`ProcessorUnavailable` (retry later) or :class:`ProcessorDeclined` (final, with a code).
Outside production ``api_base`` points the same client at another host, such as a local fake.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from datetime import datetime, timezone
from typing import Any

import stripe

from processors.base import (
    CaptureResult,
    GatewayRefund,
    InvalidWebhook,
    PaymentBook,
    PaymentRef,
    ProcessorDeclined,
    ProcessorUnavailable,
    RefundRequest,
    RefundResult,
    RefundStatus,
    VoidResult,
    WebhookEvent,
)
from processors.money import Money

SIGNATURE_HEADER = "Stripe-Signature"

# Stripe has no "product issue" reason; such refunds are still the customer's request.
REASONS: dict[str, str] = {
    "customer_request": "requested_by_customer",
    "duplicate": "duplicate",
    "fraudulent": "fraudulent",
    "product_issue": "requested_by_customer",
}

# requires_action: Stripe needs more from the customer before the money moves; still in flight.
STATUSES: dict[str, RefundStatus] = {
    "pending": "pending",
    "requires_action": "pending",
    "succeeded": "succeeded",
    "failed": "failed",
    "canceled": "canceled",
}


@dataclass(frozen=True, slots=True)
class StripeDispute:
    id: str
    amount: Money
    status: str  # e.g. "needs_response", "under_review", "won", "lost"
    reason: str
    charge: str
    payment_intent: str
    evidence_due_by: int | None  # Unix time
    is_charge_refundable: bool


@dataclass(frozen=True, slots=True)
class StripePaymentIntent:
    id: str
    amount: Money
    amount_received: Money
    status: str
    created: int  # Unix time
    latest_charge: str
    customer: str
    metadata: Mapping[str, str] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class StripePaymentLink:
    id: str
    url: str
    amount: Money
    active: bool


def _header(headers: Mapping[str, str] | None, name: str) -> str | None:
    for key, value in (headers or {}).items():
        if key.lower() == name.lower():
            return value
    return None


def _retry_after(headers: Mapping[str, str] | None) -> float | None:
    """``Retry-After`` in seconds, whether given as a number or as an HTTP date."""
    value = _header(headers, "Retry-After")
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, (when - datetime.now(timezone.utc)).total_seconds())


@contextmanager
def _edge(action: str) -> Iterator[None]:
    """Translate every Stripe error raised inside into our two outcomes; nothing else escapes."""
    try:
        yield
    except stripe.APIConnectionError as exc:
        raise ProcessorUnavailable(f"stripe {action}: {exc.user_message or exc}",
                                   code="stripe_unreachable") from exc
    except stripe.RateLimitError as exc:
        raise ProcessorUnavailable(f"stripe {action}: {exc.user_message or exc}",
                                   code="rate_limited", retry_after=_retry_after(exc.headers)) from exc
    except stripe.IdempotencyError as exc:
        raise ProcessorDeclined(f"stripe {action}: {exc.user_message}",
                                code=exc.code or "idempotency_error") from exc
    except stripe.AuthenticationError as exc:
        raise ProcessorDeclined(f"stripe {action}: {exc.user_message}",
                                code=exc.code or "authentication_failed") from exc
    except stripe.PermissionError as exc:
        raise ProcessorDeclined(f"stripe {action}: {exc.user_message}",
                                code=exc.code or "permission_denied") from exc
    except (stripe.InvalidRequestError, stripe.CardError) as exc:
        error_type = getattr(exc.error, "type", None) if exc.error else None
        raise ProcessorDeclined(f"stripe {action}: {exc.user_message}",
                                code=exc.code or error_type or "invalid_request_error") from exc
    except stripe.StripeError as exc:
        # APIError and anything newer: 5xx and 409 (a concurrent request holds the key) are
        # worth retrying; any other status is Stripe's final word.
        status = exc.http_status
        if status is None or status >= 500 or status == 409:
            raise ProcessorUnavailable(f"stripe {action}: {exc.user_message or exc}",
                                       code=exc.code or "stripe_unavailable",
                                       retry_after=_retry_after(exc.headers)) from exc
        raise ProcessorDeclined(f"stripe {action}: {exc.user_message or exc}",
                                code=exc.code or "api_error") from exc


def _money(amount: int, currency: str) -> Money:
    return Money(int(amount), currency.upper())


class StripeProcessor:
    name = "stripe"
    BOOK_PAGE_SIZE = 100  # refunds per page when listing a payment's refunds; Stripe's largest

    def __init__(self, *, account: str, config: Mapping[str, Any]) -> None:
        self.account = account
        self.webhook_secret: str = config.get("webhook_secret") or ""
        self.tolerance = int(config.get("tolerance") or 300)
        api_base = config.get("api_base") or ""
        # No SDK retries: the worker owns retrying, with the same idempotency key.
        self.client = stripe.StripeClient(
            config["api_key"],
            base_addresses={"api": api_base} if api_base else None,
            max_network_retries=0,
            http_client=stripe.RequestsClient(timeout=float(config.get("timeout") or 30)),
        )

    # -- the interface ---------------------------------------------------------------------------
    def refund(self, request: RefundRequest) -> RefundResult:
        if request.reason not in REASONS:
            raise ProcessorDeclined(f"no Stripe reason for {request.reason!r}", code="unknown_reason")
        params: dict[str, Any] = {
            **self._payment_param(request.payment.reference),
            "amount": request.amount.amount_minor,
            "reason": REASONS[request.reason],
            "metadata": {"refund_id": request.refund_id, "verdict_id": request.verdict_id,
                         "our_reason": request.reason},
        }
        with _edge("refund"):
            refund = self.client.v1.refunds.create(
                params=params,  # type: ignore[arg-type]
                options={"idempotency_key": request.idempotency_key})
        return self._refund_result(refund)

    def fetch_refund(self, processor_refund_id: str) -> RefundResult:
        with _edge("fetch refund"):
            refund = self.client.v1.refunds.retrieve(processor_refund_id)
        return self._refund_result(refund)

    def fetch_payment_book(self, payment: PaymentRef, *,
                           known_refund_ids: Sequence[str] = ()) -> PaymentBook:
        """What a payment intent (or a charge) captured, and every refund Stripe lists for it."""
        reference = payment.reference
        param = self._payment_param(reference)
        with _edge("fetch payment"):
            if "payment_intent" in param:
                intent = self.client.v1.payment_intents.retrieve(reference)
                captured = _read(lambda: _money(getattr(intent, "amount_received", 0) or 0, intent.currency), intent)
            else:
                charge = self.client.v1.charges.retrieve(reference)
                captured = _read(lambda: _money(getattr(charge, "amount_captured", 0) or 0, charge.currency), charge)
        params: dict[str, Any] = {**param, "limit": self.BOOK_PAGE_SIZE}
        refunds: list[GatewayRefund] = []
        while True:
            with _edge("list refunds"):
                page = self.client.v1.refunds.list(params=params)  # type: ignore[arg-type]
            refunds += [_read(lambda r=refund: _gateway_refund(r), refund) for refund in page.data]
            if not page.has_more or not page.data:
                break
            params["starting_after"] = page.data[-1].id
        return PaymentBook(reference=reference, captured=captured, refunds=tuple(refunds))

    def void(self, payment: PaymentRef, *, idempotency_key: str, verdict_id: str) -> VoidResult:
        # Stripe's cancel takes no metadata, so the verdict travels only in our own records.
        intent_id = self._intent_id(payment, "void")
        with _edge("void"):
            intent = self.client.v1.payment_intents.cancel(
                intent_id, options={"idempotency_key": idempotency_key})
        if intent.status != "canceled":
            raise ProcessorDeclined(f"payment intent {intent_id} is {intent.status}, not canceled",
                                    code="payment_intent_unexpected_state")
        return VoidResult(reference=intent.id, status="voided")

    def capture(self, payment: PaymentRef, amount: Money, *, idempotency_key: str,
                verdict_id: str) -> CaptureResult:
        intent_id = self._intent_id(payment, "capture")
        with _edge("capture"):
            intent = self.client.v1.payment_intents.capture(
                intent_id,
                params={"amount_to_capture": amount.amount_minor,
                        "metadata": {"verdict_id": verdict_id}},
                options={"idempotency_key": idempotency_key})
        if intent.status not in ("succeeded", "processing"):
            raise ProcessorDeclined(f"payment intent {intent_id} is {intent.status} after capture",
                                    code="payment_intent_unexpected_state")
        return CaptureResult(reference=intent.id,
                             amount=_money(intent.amount_received or amount.amount_minor,
                                           intent.currency),
                             status="captured" if intent.status == "succeeded" else "pending")

    def verify_webhook(self, payload: bytes, headers: Mapping[str, str]) -> WebhookEvent:
        if not self.webhook_secret:
            raise InvalidWebhook("no Stripe webhook secret is configured", code="not_configured")
        signature = _header(headers, SIGNATURE_HEADER)
        if not signature:
            raise InvalidWebhook(f"missing {SIGNATURE_HEADER} header", code="missing_signature")
        try:
            stripe.Webhook.construct_event(payload, signature, self.webhook_secret, self.tolerance)
            # The verified bytes, as plain JSON: the event is handed on without SDK objects.
            body = json.loads(payload)
            obj = body["data"]["object"]
            return WebhookEvent(processor=self.name, event_id=str(body["id"]),
                                type=str(body["type"]), object_id=str(obj["id"]), data=obj)
        except stripe.SignatureVerificationError as exc:
            raise InvalidWebhook(f"Stripe signature did not verify: {exc.user_message}") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidWebhook(f"malformed Stripe event: {exc}", code="malformed") from None

    # -- Stripe-only operations ------------------------------------------------------------------
    def fetch_dispute(self, dispute_id: str) -> StripeDispute:
        with _edge("fetch dispute"):
            dispute = self.client.v1.disputes.retrieve(dispute_id)
        details = getattr(dispute, "evidence_details", None)
        return StripeDispute(
            id=dispute.id, amount=_money(dispute.amount, dispute.currency),
            status=dispute.status, reason=dispute.reason,
            charge=_ref_id(getattr(dispute, "charge", None)),
            payment_intent=_ref_id(getattr(dispute, "payment_intent", None)),
            evidence_due_by=getattr(details, "due_by", None),
            is_charge_refundable=bool(getattr(dispute, "is_charge_refundable", False)))

    def list_payment_intents(self, *, created_gte: int | None = None,
                             limit: int = 100) -> Iterator[StripePaymentIntent]:
        """Every payment intent created at or after ``created_gte``, newest first, page by page."""
        params: dict[str, Any] = {"limit": limit}
        if created_gte is not None:
            params["created"] = {"gte": created_gte}
        while True:
            with _edge("list payment intents"):
                page = self.client.v1.payment_intents.list(params=params)  # type: ignore[arg-type]
            for intent in page.data:
                yield StripePaymentIntent(
                    id=intent.id, amount=_money(intent.amount, intent.currency),
                    amount_received=_money(intent.amount_received or 0, intent.currency),
                    status=intent.status, created=intent.created,
                    latest_charge=_ref_id(getattr(intent, "latest_charge", None)),
                    customer=_ref_id(getattr(intent, "customer", None)),
                    metadata=_plain(getattr(intent, "metadata", None)))
            if not page.has_more or not page.data:
                return
            params["starting_after"] = page.data[-1].id

    def create_payment_link(self, *, amount: Money, description: str, metadata: Mapping[str, str],
                            idempotency_key: str) -> StripePaymentLink:
        """A one-item link for exactly ``amount``. ``price_data`` creates the price inline, so the
        whole write is one idempotent request rather than a price and a link that could part."""
        params: dict[str, Any] = {
            "line_items": [{
                "price_data": {"currency": amount.currency.lower(),
                               "unit_amount": amount.amount_minor,
                               "product_data": {"name": description}},
                "quantity": 1,
            }],
            "metadata": dict(metadata),
            # The payment the link produces carries the same metadata, so it can be matched back.
            "payment_intent_data": {"metadata": dict(metadata)},
        }
        with _edge("create payment link"):
            link = self.client.v1.payment_links.create(
                params=params,  # type: ignore[arg-type]
                options={"idempotency_key": idempotency_key})
        return StripePaymentLink(id=link.id, url=link.url, amount=amount, active=bool(link.active))

    # -- helpers ---------------------------------------------------------------------------------
    @staticmethod
    def _payment_param(reference: str) -> dict[str, str]:
        if reference.startswith("pi_"):
            return {"payment_intent": reference}
        if reference.startswith(("ch_", "py_")):
            return {"charge": reference}
        raise ProcessorDeclined(f"{reference!r} is neither a payment intent nor a charge",
                                code="unknown_payment_reference")

    @staticmethod
    def _intent_id(payment: PaymentRef, action: str) -> str:
        intent_id = payment.authorization_reference or payment.reference
        if not intent_id.startswith("pi_"):
            raise ProcessorDeclined(f"Stripe can {action} only a payment intent, not {intent_id!r}",
                                    code="payment_intent_required")
        return intent_id

    @staticmethod
    def _refund_result(refund: stripe.Refund) -> RefundResult:
        status = STATUSES.get(refund.status or "")
        if status is None:
            # An unknown status is not success: keep it in flight until Stripe says more.
            status = "pending"
        final_failure = status in ("failed", "canceled")
        return RefundResult(
            processor_refund_id=refund.id, status=status,
            amount=_money(refund.amount, refund.currency),
            failure_code=(getattr(refund, "failure_reason", None) or refund.status)
            if final_failure else "",
            failure_message=f"Stripe refund {refund.status}" if final_failure else "")


def _gateway_refund(refund: stripe.Refund) -> GatewayRefund:
    created = getattr(refund, "created", None)
    return GatewayRefund(
        processor_refund_id=refund.id, amount=_money(refund.amount, refund.currency),
        # An unknown status is not success: in flight until Stripe says more.
        status=STATUSES.get(getattr(refund, "status", None) or "", "pending"),
        our_refund_id=_plain(getattr(refund, "metadata", None)).get("refund_id", ""),
        created_at=datetime.fromtimestamp(created, tz=timezone.utc) if created else None)


def _read(read: Any, obj: Any) -> Any:
    """A Stripe object read into ours; one lacking what we need is Stripe's malformed answer."""
    try:
        return read()
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ProcessorDeclined(f"stripe answered a malformed {getattr(obj, 'object', 'object')} "
                                f"{getattr(obj, 'id', '?')}: {exc!r}", code="malformed_response") from None


def _ref_id(value: Any) -> str:
    """An expandable field is an id or, when expanded, the object itself."""
    if value is None:
        return ""
    return value if isinstance(value, str) else str(getattr(value, "id", ""))


def _plain(metadata: stripe.StripeObject | None) -> dict[str, str]:
    return {str(k): str(v) for k, v in metadata.to_dict().items()} if metadata else {}
