"""The one interface every gateway adapter implements, and the plain types it speaks.

Adapters translate SDK exceptions at their edge: a failure worth retrying (connection, timeout,
rate limit, 5xx) becomes :class:`ProcessorUnavailable`; a final refusal becomes
:class:`ProcessorDeclined` with a code. Every field of a gateway's answer is read defensively
there too: one that is missing or mistyped is the code ``malformed_response``, unavailable after a
write (the money may have moved: look again) and declined after a read. Nothing else escapes an
adapter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal, Protocol

from processors.money import Money

RefundStatus = Literal["pending", "succeeded", "failed", "canceled"]


@dataclass(frozen=True, slots=True)
class PaymentRef:
    """Where a payment lives on its gateway."""

    processor: str  # "stripe", "paypal", "sandbox"
    account: str  # which configured account of that gateway took the payment
    reference: str  # Stripe payment intent or charge id, PayPal capture id, sandbox charge id
    authorization_reference: str = ""  # PayPal authorisation id, for void and capture


@dataclass(frozen=True, slots=True)
class RefundRequest:
    payment: PaymentRef
    amount: Money
    reason: str  # our reason code; adapters map it to the gateway's own
    idempotency_key: str  # derived from our refund id, so a retry is the same request
    refund_id: str  # rf_…
    verdict_id: str  # vd_… that allowed this write; sent to the gateway as metadata


@dataclass(frozen=True, slots=True)
class RefundResult:
    processor_refund_id: str
    status: RefundStatus
    amount: Money
    failure_code: str = ""
    failure_message: str = ""


@dataclass(frozen=True, slots=True)
class GatewayRefund:
    """One refund of a payment as the gateway's own books show it."""

    processor_refund_id: str
    amount: Money
    status: RefundStatus
    our_refund_id: str = ""  # rf_… from the metadata we sent with it; "" for a refund made elsewhere
    created_at: datetime | None = None  # when the gateway made it
    reason: str = ""  # the gateway's own reason word (Stripe: requested_by_customer, …); "" when it keeps none

    @property
    def result(self) -> RefundResult:
        """As the answer to a refund call would state it (what the webhook path records)."""
        return RefundResult(processor_refund_id=self.processor_refund_id, status=self.status, amount=self.amount)


@dataclass(frozen=True, slots=True)
class PaymentBook:
    """What a gateway's books say of one payment: what it captured, and every refund of it."""

    reference: str
    captured: Money  # zero for an authorisation not (or never) captured, or voided
    refunds: tuple[GatewayRefund, ...] = ()
    # False when the gateway could not list the payment's refunds, so only those asked for by id
    # are here: a refund made elsewhere would not show.
    complete: bool = True


@dataclass(frozen=True, slots=True)
class DisputeSubmission:
    """The gateway took a dispute's evidence; where the dispute stands after it."""

    dispute_id: str
    status: str  # the gateway's own word, e.g. Stripe "under_review", PayPal "UNDER_REVIEW"


# A draft's text fields, in order, with the headings a gateway that takes one text gets.
EVIDENCE_HEADINGS = {"summary": "Summary", "customer_communication": "Customer communication",
                     "refund_policy": "Refund policy", "shipping_documentation": "Shipping documentation"}


@dataclass(frozen=True, slots=True)
class VoidResult:
    reference: str
    status: Literal["voided"]


@dataclass(frozen=True, slots=True)
class CaptureResult:
    reference: str  # the gateway's id for the capture (PayPal capture id, Stripe payment intent)
    amount: Money
    status: Literal["captured", "pending"]


@dataclass(frozen=True, slots=True)
class PaymentState:
    """Where an authorisation stands at its gateway: what a void or capture whose answer was lost
    is resolved by (``fetch_payment_state``)."""

    reference: str
    status: Literal["authorized", "captured", "capture_pending", "voided"]
    captured: Money | None = None  # what the gateway captured, when it says
    capture_reference: str = ""  # the capture's id where the gateway gives it one (PayPal)


@dataclass(frozen=True, slots=True)
class WebhookEvent:
    """A verified inbound event, reduced to what we act on."""

    processor: str
    event_id: str
    type: str  # the gateway's own event type, e.g. "charge.refund.updated"
    object_id: str  # id of the object the event is about (refund, charge, dispute)
    data: Mapping[str, Any] = field(default_factory=dict)


class ProcessorError(Exception):
    def __init__(self, message: str, *, code: str = "processor_error") -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class ProcessorUnavailable(ProcessorError):
    """Retry later: the gateway is down, slow, or rate limiting. Nothing was decided."""

    def __init__(self, message: str, *, code: str = "processor_unavailable",
                 retry_after: float | None = None) -> None:
        super().__init__(message, code=code)
        self.retry_after = retry_after


class OutcomeUnknown(ProcessorUnavailable):
    """A write whose answer was lost after it may have reached the gateway: a read timeout, a
    connection dropped after the request was sent, a 5xx other than 503, an answer that could not
    be read. The gateway may have acted. Look the object up before deciding anything; never take
    it for "nothing changed". (A connection refused, a DNS failure, a 429 or 503 are plain
    :class:`ProcessorUnavailable`: the gateway did not act.)"""

    def __init__(self, message: str, *, code: str = "outcome_unknown", retry_after: float | None = None) -> None:
        super().__init__(message, code=code, retry_after=retry_after)


def request_may_have_been_sent(exc: BaseException) -> bool:
    """For a transport error (``requests``/``urllib3``, possibly wrapped by an SDK): whether the
    request may have reached the gateway. No connection (refused, unresolvable, a connect timeout,
    a TLS handshake that failed) means it was never sent; a read timeout or a connection dropped
    while waiting for the answer means it may have been acted on."""
    import requests
    import urllib3.exceptions as u3

    never_sent = (requests.exceptions.ConnectTimeout, requests.exceptions.SSLError, u3.NewConnectionError,
                  u3.ConnectTimeoutError, u3.NameResolutionError, ConnectionRefusedError)
    seen: set[int] = set()
    pending: list[BaseException] = [exc]
    while pending:
        current = pending.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, never_sent):
            return False
        pending += [e for e in (current.__cause__, current.__context__, getattr(current, "reason", None),
                                *current.args) if isinstance(e, BaseException)]
    return True


class ProcessorDeclined(ProcessorError):
    """A final answer from the gateway: retrying the same request will not change it."""


class InvalidWebhook(ProcessorError):
    """The event's signature did not verify (or it is stale, or malformed)."""

    def __init__(self, message: str, *, code: str = "invalid_signature") -> None:
        super().__init__(message, code=code)


class PaymentProcessor(Protocol):
    name: str
    account: str

    def refund(self, request: RefundRequest) -> RefundResult: ...

    def fetch_refund(self, processor_refund_id: str) -> RefundResult: ...

    def fetch_payment_book(self, payment: PaymentRef, *,
                           known_refund_ids: Sequence[str] = ()) -> PaymentBook:
        """The payment as the gateway books it: captured, and each refund. ``known_refund_ids``
        are refunds we know of; a gateway that cannot list a payment's refunds looks those up."""
        ...

    def void(self, payment: PaymentRef, *, idempotency_key: str, verdict_id: str) -> VoidResult: ...

    def capture(self, payment: PaymentRef, amount: Money, *, idempotency_key: str,
                verdict_id: str) -> CaptureResult: ...

    def fetch_payment_state(self, payment: PaymentRef) -> PaymentState:
        """Where the payment's authorisation stands now (voided, captured, still authorised)."""
        ...

    def verify_webhook(self, payload: bytes, headers: Mapping[str, str]) -> WebhookEvent: ...
