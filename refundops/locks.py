"""Row locks in one place, always taken in the same order (payment, then platform) so two
transactions never wait on each other in a circle. Locks live in PostgreSQL, not in memory."""

from __future__ import annotations

from refundops.models import Payment, PlatformState, Refund


def lock_payment(payment_id: str, *, merchant_id: str | None = None) -> Payment | None:
    """The payment, locked; None when there is none, or it is not ``merchant_id``'s (an agent
    must not tell the two apart, and must not lock another merchant's row)."""
    payments = Payment.objects.select_for_update(of=("self",)).select_related("customer").filter(pk=payment_id)
    return (payments.filter(merchant_id=merchant_id) if merchant_id else payments).first()


def lock_refund(refund_id: str) -> Refund:
    return Refund.objects.select_for_update(of=("self",)).select_related("payment").get(pk=refund_id)


def lock_platform() -> PlatformState:
    """Serialises every write that moves a global running total. One query once the row exists."""
    state = PlatformState.objects.select_for_update().filter(pk=1).first()
    if state is None:
        PlatformState.objects.get_or_create(pk=1)
        state = PlatformState.objects.select_for_update().get(pk=1)
    return state
