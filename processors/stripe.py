"""Stripe behind the processor interface, through the official SDK (``stripe.StripeClient``).

Every SDK call goes through :func:`_edge`, which turns Stripe's typed errors into
:class:`ProcessorUnavailable` (retry later) or :class:`ProcessorDeclined` (final, with a code), and
every answer is read through :class:`_Fields`, so a field Stripe left out (older API versions,
other Stripes) is a translated ``malformed_response`` or a stated fallback, never an
``AttributeError``. Outside production ``api_base`` points the same client at another host, such
as a local fake.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from datetime import datetime, timezone
from typing import Any, NoReturn

import stripe

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
    ProcessorUnavailable,
    RefundRequest,
    RefundResult,
    RefundStatus,
    VoidResult,
    WebhookEvent,
    request_may_have_been_sent,
)
from processors.money import Money

SIGNATURE_HEADER = "Stripe-Signature"
EVIDENCE_TEXT_MAX = 20_000  # characters in one of Stripe's evidence text fields

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
    """A payment intent with what its latest charge says happened to it since. Amounts are kept in
    minor units beside the currency, so one in a currency we do not take can still be listed."""

    id: str
    amount_minor: int  # what the intent asks for: the order amount
    received_minor: int  # captured so far (0 while it awaits capture)
    currency: str
    status: str
    created: int  # Unix time
    latest_charge: str
    customer: str
    metadata: Mapping[str, str] = field(default_factory=dict)
    refunded_minor: int | None = None  # refunded on the charge; None when Stripe did not say
    disputed: bool | None = None  # ever disputed; None when Stripe did not say
    card_brand: str = ""
    card_last4: str = ""

    @property
    def amount(self) -> Money:
        return Money(self.amount_minor, self.currency)

    @property
    def order_amount(self) -> Money:
        return self.amount

    @property
    def amount_received(self) -> Money:
        return Money(self.received_minor, self.currency)

    @property
    def refunded(self) -> Money | None:
        return None if self.refunded_minor is None else Money(self.refunded_minor, self.currency)


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
def _edge(action: str, *, write: bool = False) -> Iterator[None]:
    """Translate every Stripe error raised inside into our outcomes; nothing else escapes. For a
    write (``write``), an answer lost after the request may have reached Stripe is
    :class:`OutcomeUnknown`: Stripe may have acted."""
    try:
        yield
    except stripe.APIConnectionError as exc:
        if write and request_may_have_been_sent(exc):
            raise OutcomeUnknown(f"stripe {action}: no answer after the request was sent ({exc.user_message or exc})",
                                 code="stripe_no_answer") from exc
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
        if write and (status is None or (status >= 500 and status != 503) or status == 409):
            # 409: our own earlier request with this key is still being processed.
            raise OutcomeUnknown(f"stripe {action}: {exc.user_message or exc}",
                                 code=exc.code or "stripe_unavailable",
                                 retry_after=_retry_after(exc.headers)) from exc
        if status is None or status >= 500 or status == 409:
            raise ProcessorUnavailable(f"stripe {action}: {exc.user_message or exc}",
                                       code=exc.code or "stripe_unavailable",
                                       retry_after=_retry_after(exc.headers)) from exc
        raise ProcessorDeclined(f"stripe {action}: {exc.user_message or exc}",
                                code=exc.code or "api_error") from exc


class _Fields:
    """One Stripe object's fields, read defensively. A required field that is missing or of the
    wrong type is Stripe's fault, said as ``malformed_response``: after a write the money may have
    moved, so it is unavailable (look again later); after a read it is final."""

    def __init__(self, obj: Any, what: str, *, after_write: bool = False) -> None:
        if isinstance(obj, stripe.StripeObject):
            obj = obj.to_dict()
        self.obj = obj if isinstance(obj, Mapping) else {}
        self.what, self.after_write = what, after_write
        if not isinstance(obj, Mapping):
            self.fail(f"is {type(obj).__name__}, not an object")

    def fail(self, problem: str) -> NoReturn:
        error = OutcomeUnknown if self.after_write else ProcessorDeclined
        raise error(f"stripe {self.what} {self.obj.get('id') or ''} {problem}".replace("  ", " "),
                    code="malformed_response")

    def get(self, name: str) -> Any:
        return self.obj.get(name)

    def text(self, name: str, default: str | None = None) -> str:
        value = self.obj.get(name)
        if isinstance(value, str) and value:
            return value
        if default is None:
            self.fail(f"has no {name}")
        return default

    def integer(self, name: str, default: int | None = None) -> int:
        value = self.obj.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if value is None and default is not None:
            return default
        self.fail(f"has no whole number {name} ({value!r})")

    def optional_integer(self, name: str) -> int | None:
        value = self.obj.get(name)
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def money(self, amount: str = "amount") -> Money:
        currency = self.text("currency").upper()
        try:
            return Money(self.integer(amount), currency)
        except ValueError:
            self.fail(f"is in {currency}, a currency RefundOps does not take")

    def child(self, name: str) -> _Fields | None:
        """An expandable or nested object, or None when it is absent or only an id."""
        value = self.obj.get(name)
        return _Fields(value, f"{self.what} {name}", after_write=self.after_write) \
            if isinstance(value, Mapping) else None


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
        return self._refund_result(_Fields(refund, "refund", after_write=True))

    def fetch_refund(self, processor_refund_id: str) -> RefundResult:
        with _edge("fetch refund"):
            refund = self.client.v1.refunds.retrieve(processor_refund_id)
        # Read as after a write: the refund is ours, and the money may have moved.
        return self._refund_result(_Fields(refund, "refund", after_write=True))

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
        with _edge("void", write=True):
            answer = self.client.v1.payment_intents.cancel(
                intent_id, options={"idempotency_key": idempotency_key})
        intent = _Fields(answer, "payment intent", after_write=True)
        status = intent.text("status")
        if status != "canceled":
            raise ProcessorDeclined(f"payment intent {intent_id} is {status}, not canceled",
                                    code="payment_intent_unexpected_state")
        return VoidResult(reference=intent.text("id"), status="voided")

    def capture(self, payment: PaymentRef, amount: Money, *, idempotency_key: str,
                verdict_id: str) -> CaptureResult:
        intent_id = self._intent_id(payment, "capture")
        with _edge("capture", write=True):
            answer = self.client.v1.payment_intents.capture(
                intent_id,
                params={"amount_to_capture": amount.amount_minor,
                        "metadata": {"verdict_id": verdict_id}},
                options={"idempotency_key": idempotency_key})
        intent = _Fields(answer, "payment intent", after_write=True)
        status = intent.text("status")
        if status not in ("succeeded", "processing"):
            raise ProcessorDeclined(f"payment intent {intent_id} is {status} after capture",
                                    code="payment_intent_unexpected_state")
        # amount_received is 0 while a capture is processing: what we asked for is on its way.
        received = intent.optional_integer("amount_received") or amount.amount_minor
        return CaptureResult(reference=intent.text("id"),
                             amount=_money(received, intent.text("currency", amount.currency)),
                             status="captured" if status == "succeeded" else "pending")

    def fetch_payment_state(self, payment: PaymentRef) -> PaymentState:
        """The payment intent as Stripe has it now: canceled, captured (or capturing), or still
        waiting for capture. Only a payment intent can be voided or captured here."""
        intent_id = self._intent_id(payment, "fetch payment state")
        with _edge("fetch payment intent"):
            intent = _Fields(self.client.v1.payment_intents.retrieve(intent_id), "payment intent")
        status = intent.text("status")
        states = {"canceled": "voided", "succeeded": "captured", "processing": "capture_pending"}
        received = intent.optional_integer("amount_received")
        return PaymentState(reference=intent.text("id"), status=states.get(status, "authorized"),  # type: ignore[arg-type]
                            captured=_money(received, intent.text("currency")) if status == "succeeded"
                            and received is not None else None)

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
        return self._dispute(_Fields(dispute, "dispute"))

    def list_payment_intents(self, *, created_gte: int | None = None, limit: int = 100,
                             starting_after: str | None = None) -> Iterator[StripePaymentIntent]:
        """Every payment intent created at or after ``created_gte`` (after ``starting_after``, when
        given), newest first, page by page, each with its latest charge's summary."""
        params: dict[str, Any] = {"limit": limit, "expand": ["data.latest_charge"]}
        if created_gte is not None:
            params["created"] = {"gte": created_gte}
        if starting_after:
            params["starting_after"] = starting_after
        for intent in self._pages(self.client.v1.payment_intents, params, "list payment intents"):
            yield self._payment_intent(_Fields(intent, "payment intent"))

    def list_disputes(self, payment: PaymentRef, *, limit: int = 100) -> list[StripeDispute]:
        """Every dispute of a payment, open or closed, newest first."""
        params: dict[str, Any] = {**self._payment_param(payment.reference), "limit": limit}
        return [self._dispute(_Fields(item, "dispute"))
                for item in self._pages(self.client.v1.disputes, params, "list disputes")]

    def submit_dispute_evidence(self, dispute_id: str, evidence: Mapping[str, str], *,
                                idempotency_key: str) -> DisputeSubmission:
        """``disputes.update`` with the evidence and ``submit``: the bank gets it now. Stripe's
        file fields (customer_communication, shipping_documentation, …) take uploaded files, so
        our texts go as text: the refund policy as ``refund_policy_disclosure``, the rest, with
        headings, as ``uncategorized_text``."""
        sections = [f"{EVIDENCE_HEADINGS[name]}:\n{evidence[name].strip()}"
                    for name in ("summary", "customer_communication", "shipping_documentation")
                    if evidence.get(name, "").strip()]
        fields = {"uncategorized_text": "\n\n".join(sections),
                  "refund_policy_disclosure": evidence.get("refund_policy", "").strip()}
        fields = {name: text for name, text in fields.items() if text}
        for name, text in fields.items():
            if len(text) > EVIDENCE_TEXT_MAX:
                raise ProcessorDeclined(f"stripe takes at most {EVIDENCE_TEXT_MAX:,} characters in evidence "
                                        f"{name}; this draft has {len(text):,} there: shorten it",
                                        code="evidence_too_long")
        with _edge("submit dispute evidence"):
            answer = self.client.v1.disputes.update(
                dispute_id, params={"evidence": fields, "submit": True},  # type: ignore[typeddict-item]
                options={"idempotency_key": idempotency_key})
        dispute = _Fields(answer, "dispute", after_write=True)
        return DisputeSubmission(dispute_id=dispute.text("id"), status=dispute.text("status"))

    def deactivate_payment_link(self, link_id: str, *, idempotency_key: str) -> None:
        """``active=false``: the link's page tells a customer it has expired and takes no payment."""
        with _edge("deactivate payment link"):
            answer = self.client.v1.payment_links.update(
                link_id, params={"active": False}, options={"idempotency_key": idempotency_key})
        link = _Fields(answer, "payment link", after_write=True)
        if link.get("active") is not False:
            link.fail("is still active after deactivation")

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
            answer = self.client.v1.payment_links.create(
                params=params,  # type: ignore[arg-type]
                options={"idempotency_key": idempotency_key})
        link = _Fields(answer, "payment link", after_write=True)
        return StripePaymentLink(id=link.text("id"), url=link.text("url"), amount=amount,
                                 active=link.get("active") is not False)

    # -- helpers ---------------------------------------------------------------------------------
    @staticmethod
    def _pages(service: Any, params: dict[str, Any], action: str) -> Iterator[Any]:
        """Each object of a Stripe list, following ``has_more`` with ``starting_after``."""
        params = dict(params)
        while True:
            with _edge(action):
                page = service.list(params=params)
            listed = _Fields(page, action)
            data = listed.get("data")
            if not isinstance(data, list):
                listed.fail("has no data")
            yield from data
            if not data or listed.get("has_more") is not True:
                return
            last = data[-1].get("id") if isinstance(data[-1], Mapping) else None
            if not last:
                listed.fail("ends with an object without an id")
            params["starting_after"] = last

    @staticmethod
    def _payment_intent(intent: _Fields) -> StripePaymentIntent:
        status = intent.text("status")
        charge = intent.child("latest_charge")
        received = intent.optional_integer("amount_received")
        if received is None and charge is not None:
            received = charge.optional_integer("amount_captured")
        if received is None:
            if status == "succeeded":  # money was taken, and neither object says how much
                intent.fail("has no amount_received, and its charge no amount_captured")
            received = 0
        card = (charge.child("payment_method_details") if charge else None)
        card = card.child("card") if card else None
        last4 = str(card.get("last4") or "") if card else ""
        disputed = charge.get("disputed") if charge else None
        metadata = intent.get("metadata")
        return StripePaymentIntent(
            id=intent.text("id"), amount_minor=intent.integer("amount"), received_minor=received,
            currency=intent.text("currency").upper(), status=status, created=intent.integer("created", 0),
            latest_charge=_ref_id(intent.get("latest_charge")), customer=_ref_id(intent.get("customer")),
            metadata={str(k): str(v) for k, v in metadata.items()} if isinstance(metadata, Mapping) else {},
            refunded_minor=charge.optional_integer("amount_refunded") if charge else None,
            disputed=disputed if isinstance(disputed, bool) else None,
            card_brand=str(card.get("brand") or "")[:20] if card else "",
            card_last4=last4 if len(last4) == 4 and last4.isdigit() else "")

    @staticmethod
    def _dispute(dispute: _Fields) -> StripeDispute:
        details = dispute.child("evidence_details")
        return StripeDispute(
            id=dispute.text("id"), amount=dispute.money(), status=dispute.text("status"),
            reason=str(dispute.get("reason") or ""),
            charge=_ref_id(dispute.get("charge")), payment_intent=_ref_id(dispute.get("payment_intent")),
            evidence_due_by=details.optional_integer("due_by") if details else None,
            is_charge_refundable=dispute.get("is_charge_refundable") is True)

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
    def _refund_result(refund: _Fields) -> RefundResult:
        raw_status = str(refund.get("status") or "")
        # An unknown status is not success: keep it in flight until Stripe says more.
        status = STATUSES.get(raw_status, "pending")
        final_failure = status in ("failed", "canceled")
        return RefundResult(
            processor_refund_id=refund.text("id"), status=status, amount=refund.money(),
            failure_code=str(refund.get("failure_reason") or raw_status) if final_failure else "",
            failure_message=f"Stripe refund {raw_status}" if final_failure else "")


def _gateway_refund(refund: stripe.Refund) -> GatewayRefund:
    created = getattr(refund, "created", None)
    return GatewayRefund(
        processor_refund_id=refund.id, amount=_money(refund.amount, refund.currency),
        # An unknown status is not success: in flight until Stripe says more.
        status=STATUSES.get(getattr(refund, "status", None) or "", "pending"),
        our_refund_id=_plain(getattr(refund, "metadata", None)).get("refund_id", ""),
        created_at=datetime.fromtimestamp(created, tz=timezone.utc) if created else None,
        reason=str(getattr(refund, "reason", None) or ""))


def _read(read: Any, obj: Any) -> Any:
    """A Stripe object read into ours; one lacking what we need is Stripe's malformed answer."""
    try:
        return read()
    except (AttributeError, KeyError, TypeError, ValueError) as exc:
        raise ProcessorDeclined(f"stripe answered a malformed {getattr(obj, 'object', 'object')} "
                                f"{getattr(obj, 'id', '?')}: {exc!r}", code="malformed_response") from None


def _ref_id(value: Any) -> str:
    """An expandable field is an id or, when expanded, the object itself."""
    if isinstance(value, Mapping):
        return str(value.get("id") or "")
    return value if isinstance(value, str) else ""


def _plain(metadata: stripe.StripeObject | None) -> dict[str, str]:
    return {str(k): str(v) for k, v in metadata.to_dict().items()} if metadata else {}
