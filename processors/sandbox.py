"""The built-in sandbox gateway: a real adapter behind the processor interface.

It keeps its own ledger (``processors.models``), refuses to refund more than a charge captured,
answers a repeated idempotency key with the first refund (so a retry can never pay twice), reports
success after a configurable delay, and can be told to decline or to be down.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any

from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from processors import signing
from processors.base import (
    CaptureResult,
    GatewayRefund,
    InvalidWebhook,
    PaymentBook,
    PaymentRef,
    PaymentState,
    ProcessorDeclined,
    ProcessorUnavailable,
    RefundRequest,
    RefundResult,
    VoidResult,
    WebhookEvent,
)
from processors.models import SandboxCharge, SandboxControl, SandboxRefund
from processors.money import Money

SIGNATURE_HEADER = "Sandbox-Signature"


def open_charge(*, amount: Money, captured: bool = True, reference: str | None = None) -> str:
    """Create a charge on the sandbox's side (demo data and tests); return its reference."""
    reference = reference or f"sbch_{secrets.token_hex(8)}"
    SandboxCharge.objects.create(
        reference=reference, currency=amount.currency, authorized_minor=amount.amount_minor,
        captured_minor=amount.amount_minor if captured else 0)
    return reference


def set_mode(mode: str, *, settle_delay_seconds: int | None = None) -> SandboxControl:
    control = SandboxControl.current()
    control.mode = mode
    if settle_delay_seconds is not None:
        control.settle_delay_seconds = settle_delay_seconds
    control.save()
    return control


_CONTROL_COLUMNS = [field.attname for field in SandboxControl._meta.concrete_fields]
_READ_CONTROL = (f"SELECT {', '.join(SandboxControl._meta.get_field(name).column for name in _CONTROL_COLUMNS)}"
                 f" FROM {SandboxControl._meta.db_table} WHERE id = 1")


def _read_control() -> SandboxControl:
    """``SandboxControl.current()``, read every call (an operator's flip counts at once): on
    PostgreSQL its row by plain SQL, as the ORM would read it. Compiling the ORM's get() cost
    the worker's settle more than the sandbox's own statement."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute(_READ_CONTROL)
            row = cursor.fetchone()
        if row is not None:
            return SandboxControl.from_db("default", _CONTROL_COLUMNS, row)
    return SandboxControl.current()


def _refund_at_once(request: RefundRequest, *, settle_delay_seconds: int) -> SandboxRefund | None:
    """A new refund in one statement (issue 31: the worker's settle spent a third of its time in the
    sandbox's eight): the charge's refunded total raised where the charge has this reference, this
    currency and room for the amount, and no refund has this key yet, and the refund inserted for
    the charge so raised; both or neither. The UPDATE takes the charge's row lock, as the locked way
    below does. None when nothing was written (the key was seen, the charge is not there or has no
    room, the currency differs, or a call with the same key got in first: the key's unique index
    refuses the second INSERT and the whole statement with it); the caller then answers the locked
    way, which finds the first refund or says why not. Only the success is answered here, and it is
    the answer the locked way would give."""
    now = timezone.now()
    made = SandboxRefund(reference=f"sbre_{secrets.token_hex(8)}", amount_minor=request.amount.amount_minor,
                         currency=request.amount.currency, idempotency_key=request.idempotency_key,
                         metadata={"refund_id": request.refund_id, "verdict_id": request.verdict_id,
                                   "reason": request.reason},
                         settles_at=now + timedelta(seconds=settle_delay_seconds), created_at=now)
    metadata = SandboxRefund._meta.get_field("metadata").get_db_prep_save(made.metadata, connection)
    try:
        # Inside a caller's transaction, a savepoint: a refused INSERT must not abort the caller's.
        with transaction.atomic() if connection.in_atomic_block else contextlib.nullcontext():
            with connection.cursor() as cursor:
                cursor.execute(_REFUND_AT_ONCE, [
                    made.amount_minor, request.payment.reference, made.currency, made.amount_minor,
                    made.idempotency_key, made.reference, made.amount_minor, made.currency, made.idempotency_key,
                    metadata, made.status, made.settles_at, made.created_at])
                row = cursor.fetchone()
    except IntegrityError:
        return None
    if row is None:
        return None
    made.pk, made.charge_id = row
    return made


_REFUND_AT_ONCE = f"""
WITH charge AS (
  UPDATE {SandboxCharge._meta.db_table} SET refunded_minor = refunded_minor + %s
   WHERE reference = %s AND currency = %s AND refunded_minor + %s <= captured_minor
     AND NOT EXISTS (SELECT FROM {SandboxRefund._meta.db_table} WHERE idempotency_key = %s)
  RETURNING id)
INSERT INTO {SandboxRefund._meta.db_table}
       (reference, charge_id, amount_minor, currency, idempotency_key, metadata, status, settles_at, created_at)
SELECT %s, charge.id, %s, %s, %s, %s, %s, %s, %s FROM charge
RETURNING id, charge_id"""


class SandboxProcessor:
    name = "sandbox"

    def __init__(self, *, account: str = "default", config: Mapping[str, Any] | None = None) -> None:
        self.account = account
        self.config = config or {}

    # -- helpers -------------------------------------------------------------------------------
    def _control(self) -> SandboxControl:
        control = _read_control()
        if control.mode == SandboxControl.Mode.DOWN:
            raise ProcessorUnavailable("sandbox gateway is down", code="gateway_down")
        return control

    @staticmethod
    def _result(refund: SandboxRefund) -> RefundResult:
        status = refund.status
        if status == "pending" and refund.settles_at <= timezone.now():
            status = "succeeded"
        return RefundResult(processor_refund_id=refund.reference, status=status,  # type: ignore[arg-type]
                            amount=Money(refund.amount_minor, refund.currency))

    # -- the interface ---------------------------------------------------------------------------
    def refund(self, request: RefundRequest) -> RefundResult:
        control = self._control()
        if control.mode == SandboxControl.Mode.UP and connection.vendor == "postgresql":
            made = _refund_at_once(request, settle_delay_seconds=control.settle_delay_seconds)
            if made is not None:
                return self._result(made)
            # Nothing written: the key was seen before, or a refusal. Answered as always, below.
        existing = SandboxRefund.objects.filter(idempotency_key=request.idempotency_key).first()
        if existing is not None:
            return self._result(existing)
        if control.mode == SandboxControl.Mode.DECLINE:
            raise ProcessorDeclined("sandbox declined the refund", code="refund_declined")
        try:
            with transaction.atomic():
                charge = SandboxCharge.objects.select_for_update().get(
                    reference=request.payment.reference)
                # Again under the lock: a call with this key that got here first has its refund by
                # now, and that refund is the answer (not a decline for the room it took).
                existing = SandboxRefund.objects.filter(idempotency_key=request.idempotency_key).first()
                if existing is not None:
                    return self._result(existing)
                if charge.currency != request.amount.currency:
                    raise ProcessorDeclined("currency does not match the charge", code="currency_mismatch")
                if charge.refunded_minor + request.amount.amount_minor > charge.captured_minor:
                    raise ProcessorDeclined("refund exceeds the captured amount",
                                            code="amount_too_large")
                charge.refunded_minor += request.amount.amount_minor
                charge.save(update_fields=["refunded_minor"])
                refund = SandboxRefund.objects.create(
                    reference=f"sbre_{secrets.token_hex(8)}", charge=charge,
                    amount_minor=request.amount.amount_minor, currency=request.amount.currency,
                    idempotency_key=request.idempotency_key,
                    metadata={"refund_id": request.refund_id, "verdict_id": request.verdict_id,
                              "reason": request.reason},
                    settles_at=timezone.now() + timedelta(seconds=control.settle_delay_seconds))
        except SandboxCharge.DoesNotExist:
            raise ProcessorDeclined(f"no sandbox charge {request.payment.reference}",
                                    code="no_such_charge") from None
        except IntegrityError:
            # Two calls raced with one idempotency key: the first one's refund is the answer.
            return self._result(SandboxRefund.objects.get(idempotency_key=request.idempotency_key))
        return self._result(refund)

    def fetch_refund(self, processor_refund_id: str) -> RefundResult:
        self._control()
        try:
            return self._result(SandboxRefund.objects.get(reference=processor_refund_id))
        except SandboxRefund.DoesNotExist:
            raise ProcessorDeclined(f"no sandbox refund {processor_refund_id}",
                                    code="no_such_refund") from None

    def fetch_payment_book(self, payment: PaymentRef, *,
                           known_refund_ids: Sequence[str] = ()) -> PaymentBook:
        """The charge and every refund of it, from the sandbox's own ledger."""
        book = self.fetch_payment_books([payment])[payment.reference]
        if isinstance(book, ProcessorDeclined):
            raise book
        return book

    def fetch_payment_books(self, payments: Sequence[PaymentRef], *,
                            known_refund_ids: Mapping[str, Sequence[str]] | None = None,
                            ) -> dict[str, PaymentBook | ProcessorDeclined]:
        """Many payments' books in two queries (reconcile reads a chunk at a time): by reference,
        each book, or the refusal ``fetch_payment_book`` would raise for it."""
        self._control()
        charges = {c.reference: c for c in SandboxCharge.objects.filter(reference__in=[p.reference for p in payments])}
        refunds: dict[int, list[GatewayRefund]] = {}
        for refund in SandboxRefund.objects.filter(charge__in=charges.values()).order_by("created_at", "pk"):
            result = self._result(refund)
            refunds.setdefault(refund.charge_id, []).append(GatewayRefund(
                processor_refund_id=result.processor_refund_id, amount=result.amount, status=result.status,
                our_refund_id=str(refund.metadata.get("refund_id") or ""), created_at=refund.created_at))
        books: dict[str, PaymentBook | ProcessorDeclined] = {}
        for payment in payments:
            charge = charges.get(payment.reference)
            if charge is None:
                books[payment.reference] = ProcessorDeclined(f"no sandbox charge {payment.reference}",
                                                             code="no_such_charge")
                continue
            captured = 0 if charge.voided else charge.captured_minor
            books[payment.reference] = PaymentBook(reference=charge.reference, captured=Money(captured, charge.currency),
                                                   refunds=tuple(refunds.get(charge.pk, ())))
        return books

    def void(self, payment: PaymentRef, *, idempotency_key: str, verdict_id: str) -> VoidResult:
        self._control()
        with transaction.atomic():
            charge = SandboxCharge.objects.select_for_update().filter(reference=payment.reference).first()
            if charge is None:
                raise ProcessorDeclined(f"no sandbox charge {payment.reference}", code="no_such_charge")
            if charge.captured_minor:
                raise ProcessorDeclined("a captured charge cannot be voided", code="already_captured")
            charge.voided = True
            charge.save(update_fields=["voided"])
        return VoidResult(reference=payment.reference, status="voided")

    def capture(self, payment: PaymentRef, amount: Money, *, idempotency_key: str,
                verdict_id: str) -> CaptureResult:
        self._control()
        with transaction.atomic():
            charge = SandboxCharge.objects.select_for_update().filter(reference=payment.reference).first()
            if charge is None:
                raise ProcessorDeclined(f"no sandbox charge {payment.reference}", code="no_such_charge")
            if charge.voided:
                raise ProcessorDeclined("the authorisation was voided", code="authorization_voided")
            if charge.captured_minor and charge.captured_minor != amount.amount_minor:
                raise ProcessorDeclined("already captured", code="already_captured")
            if amount.amount_minor > charge.authorized_minor:
                raise ProcessorDeclined("capture exceeds the authorised amount", code="amount_too_large")
            charge.captured_minor = amount.amount_minor
            charge.save(update_fields=["captured_minor"])
        return CaptureResult(reference=payment.reference, amount=amount, status="captured")

    def fetch_payment_state(self, payment: PaymentRef) -> PaymentState:
        self._control()
        charge = SandboxCharge.objects.filter(reference=payment.reference).first()
        if charge is None:
            raise ProcessorDeclined(f"no sandbox charge {payment.reference}", code="no_such_charge")
        if charge.voided:
            return PaymentState(reference=charge.reference, status="voided")
        if charge.captured_minor:
            return PaymentState(reference=charge.reference, status="captured",
                                captured=Money(charge.captured_minor, charge.currency))
        return PaymentState(reference=charge.reference, status="authorized")

    def verify_webhook(self, payload: bytes, headers: Mapping[str, str]) -> WebhookEvent:
        import json

        secret = self.config.get("webhook_secret") or ""
        if not secret:
            raise InvalidWebhook("no sandbox webhook secret is configured", code="not_configured")
        header = next((v for k, v in headers.items() if k.lower() == SIGNATURE_HEADER.lower()), "")
        try:
            signing.verify(payload, header, secret, tolerance=int(self.config.get("tolerance", 300)))
            body = json.loads(payload)
            return WebhookEvent(processor=self.name, event_id=str(body["id"]), type=str(body["type"]),
                                object_id=str(body["data"]["object"]["id"]),
                                data=body["data"]["object"])
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidWebhook(str(exc)) from None
