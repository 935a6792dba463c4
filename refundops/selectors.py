"""Reads: running totals, the active policy, the shapes agents see."""

from __future__ import annotations

from datetime import datetime, timedelta

from django.db.models import Count, Q, Sum
from django.utils import timezone

from refundops.models import COUNTING_STATES, HoldRules, Payment, Refund, RefundLimits
from refundops.policy import Totals


def active_limits(currency: str) -> RefundLimits | None:
    return RefundLimits.objects.filter(currency=currency).order_by("-version").first()


def active_rules() -> HoldRules | None:
    return HoldRules.objects.order_by("-version").first()


def start_of_day(now: datetime) -> datetime:
    return timezone.localtime(now).replace(hour=0, minute=0, second=0, microsecond=0)


def running_totals(*, payment: Payment, agent_id: str | None, session_id: str, now: datetime,
                   velocity_hours: int = 24) -> Totals:
    day = start_of_day(now)
    month = now - timedelta(days=30)
    velocity_since = now - timedelta(hours=velocity_hours)
    hour = now - timedelta(hours=1)
    counting = Refund.objects.filter(status__in=COUNTING_STATES, currency=payment.currency)

    def total(q: Q) -> Sum:
        return Sum("amount_minor", filter=q, default=0)

    customer = counting.filter(payment__customer_id=payment.customer_id,
                               created_at__gte=min(month, velocity_since)).aggregate(
        day_count=Count("id", filter=Q(created_at__gte=day)), day_sum=total(Q(created_at__gte=day)),
        m_count=Count("id", filter=Q(created_at__gte=month)), m_sum=total(Q(created_at__gte=month)),
        velocity=Count("id", filter=Q(created_at__gte=velocity_since)))
    agent = {"hour": 0, "day": 0, "session": 0}
    if agent_id:
        in_session = Q(agent_session_id=session_id)
        recent = Q(created_at__gte=min(day, hour))
        agent = counting.filter(agent_id=agent_id).filter(recent | in_session if session_id else recent).aggregate(
            hour=total(Q(created_at__gte=hour)), day=total(Q(created_at__gte=day)), session=total(in_session))
    global_day = counting.filter(created_at__gte=day).aggregate(s=total(Q()))["s"]
    return Totals(
        payment_refund_count=Refund.objects.filter(payment_id=payment.pk, status__in=COUNTING_STATES).count(),
        customer_day_count=customer["day_count"], customer_day_minor=customer["day_sum"],
        customer_30d_count=customer["m_count"], customer_30d_minor=customer["m_sum"],
        customer_velocity_count=customer["velocity"],
        agent_hour_minor=agent["hour"], agent_day_minor=agent["day"],
        session_minor=agent["session"], global_day_minor=global_day)


def payment_json(payment: Payment) -> dict:
    """What ``payments.read`` may see: amounts, state, method type and last four. Never card data."""
    return {
        "id": payment.pk, "status": payment.status, "currency": payment.currency,
        "amount_authorized": payment.amount_authorized_minor, "amount_captured": payment.amount_captured_minor,
        "amount_refunded": payment.amount_refunded_minor, "amount_refund_pending": payment.amount_reserved_minor,
        "amount_refundable": max(payment.refundable_minor, 0),
        "method": {"type": payment.method_type, "brand": payment.method_brand or None,
                   "last4": payment.method_last4 or None},
        "customer_id": payment.customer_id, "order_reference": payment.order_reference or None,
        "order_amount": payment.order_amount_minor, "amount_owed": payment.amount_owed_minor,
        "dispute_status": payment.dispute_status, "fraud_flagged": bool(payment.fraud_flags),
        "processor": payment.processor,
        "captured_at": payment.captured_at.isoformat() if payment.captured_at else None,
    }
