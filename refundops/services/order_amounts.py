"""A person confirms the order amount of an authorisation, up to which agents may capture it.

Imported authorisations (and any a gateway kept no order for) start without one; capturing more
than the order always stays with a person (CONTRACT: ``payments.capture``).
"""

from __future__ import annotations

from typing import Any

from django.core.exceptions import PermissionDenied
from django.db import transaction

from audit.services import record_audit
from processors.money import format_minor
from refundops.errors import ApiError
from refundops.locks import lock_payment
from refundops.models import Payment


@transaction.atomic
def confirm_order_amount(*, payment_id: str, amount_minor: int, user: Any, note: str = "") -> Payment:
    if not (user.is_active and user.is_staff and user.has_perm("refundops.change_payment")):
        raise PermissionDenied("Only staff who may change payments confirm an order amount.")
    payment = lock_payment(payment_id)
    if payment is None:
        raise ApiError("PAYMENT_NOT_FOUND", f"No payment {payment_id!r}.")
    if payment.status != Payment.Status.AUTHORIZED or payment.amount_captured_minor:
        raise ApiError("PAYMENT_NOT_CAPTURABLE", f"Payment {payment.pk} is {payment.get_status_display().lower()}: "
                                                 f"an order amount is confirmed only before capture.")
    authorized = payment.amount_authorized_minor
    if not 0 < amount_minor <= authorized:
        raise ApiError("VALIDATION_ERROR", f"The order amount must be more than zero and at most the "
                                           f"{format_minor(authorized, payment.currency)} authorised.",
                       field="amount")
    before = payment.order_amount_minor
    payment.order_amount_minor = amount_minor
    payment._history_user = user
    payment._change_reason = f"order amount confirmed{': ' + note if note else ''}"
    payment.save(update_fields=["order_amount_minor"])
    record_audit(actor=f"user:{user.get_username()}", action="payment.order_amount_set", subject_type="payment",
                 subject_id=payment.pk, data={"from": before, "to": amount_minor, "currency": payment.currency,
                                              "note": note})
    return payment
