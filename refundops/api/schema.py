"""Serializers that describe the API for the OpenAPI document. Validation itself lives in
refundops.inputs, shared with MCP, so these only document shapes."""

from __future__ import annotations

from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse
from rest_framework import serializers

from refundops.errors import ERROR_STATUS
from refundops.models import Reason

IDEMPOTENCY_KEY = OpenApiParameter(
    "Idempotency-Key", OpenApiTypes.STR, OpenApiParameter.HEADER, required=True,
    description="Required on every POST. The same key with the same body answers the first answer again "
                "with deduplicated: true; with another body, 409 IDEMPOTENCY_KEY_REUSED.")


class AgentContextIn(serializers.Serializer):
    session_id = serializers.CharField(required=False, max_length=200)
    model = serializers.CharField(required=False, max_length=200)
    reasoning = serializers.CharField(required=False, max_length=20000)
    conversation_context = serializers.CharField(required=False, max_length=50000)


class RefundIn(serializers.Serializer):
    transaction_id = serializers.CharField(max_length=40, help_text="The payment, e.g. txn_…")
    amount = serializers.IntegerField(required=False, min_value=1,
                                      help_text="Minor units as a JSON integer (1999 = 19.99 USD). "
                                                "Omit for the whole refundable amount.")
    reason = serializers.ChoiceField(choices=Reason.values)
    note = serializers.CharField(required=False, max_length=2000)
    destination = serializers.ChoiceField(choices=["original_method"], required=False,
                                          help_text="Omit, or original_method. Anything else is refused "
                                                    "with DESTINATION_NOT_ALLOWED.")
    agent = AgentContextIn(required=False)


class MethodOut(serializers.Serializer):
    type = serializers.CharField()
    brand = serializers.CharField(allow_null=True)
    last4 = serializers.CharField(allow_null=True)


class PaymentOut(serializers.Serializer):
    id = serializers.CharField()
    status = serializers.ChoiceField(choices=["authorized", "captured", "voided"])
    currency = serializers.CharField()
    amount_authorized = serializers.IntegerField()
    amount_captured = serializers.IntegerField()
    amount_refunded = serializers.IntegerField()
    amount_refund_pending = serializers.IntegerField()
    amount_refundable = serializers.IntegerField()
    method = MethodOut()
    customer_id = serializers.CharField()
    order_reference = serializers.CharField(allow_null=True)
    order_amount = serializers.IntegerField(allow_null=True)
    amount_owed = serializers.IntegerField()
    dispute_status = serializers.CharField()
    fraud_flagged = serializers.BooleanField()
    processor = serializers.CharField()
    captured_at = serializers.DateTimeField(allow_null=True)


class CheckOut(serializers.Serializer):
    name = serializers.CharField()
    result = serializers.ChoiceField(choices=["pass", "fail", "hold"])
    code = serializers.CharField(required=False)
    message = serializers.CharField(required=False)
    inputs = serializers.DictField(required=False)
    limit = serializers.JSONField(required=False)
    observed = serializers.JSONField(required=False)


class VerdictOut(serializers.Serializer):
    id = serializers.CharField()
    outcome = serializers.ChoiceField(choices=["approved", "held", "denied"])
    code = serializers.CharField(allow_null=True)
    policy_version = serializers.CharField()
    checks = CheckOut(many=True)
    hold_reasons = serializers.ListField(child=serializers.CharField())


class RefundOut(serializers.Serializer):
    id = serializers.CharField()
    status = serializers.CharField()
    amount = serializers.IntegerField()
    currency = serializers.CharField()
    transaction_id = serializers.CharField()
    reason = serializers.CharField()
    estimated_arrival = serializers.DateField(allow_null=True)
    hold_reasons = serializers.ListField(child=serializers.CharField())
    created_at = serializers.DateTimeField()


class ContextOut(serializers.Serializer):
    transaction_remaining_amount = serializers.IntegerField()
    currency = serializers.CharField()
    customer_refunds_today = serializers.IntegerField()
    customer_refund_limit_today = serializers.IntegerField()
    suggested_message = serializers.CharField()


class RefundCreated(serializers.Serializer):
    refund = RefundOut()
    verdict = VerdictOut()
    context = ContextOut()
    deduplicated = serializers.BooleanField()
    status = serializers.CharField(required=False, help_text="'held' on a 202")
    hold_reasons = serializers.ListField(child=serializers.CharField(), required=False)


class RefundCheckOut(serializers.Serializer):
    verdict = VerdictOut()
    would_be = serializers.ChoiceField(choices=["approved", "held", "denied"])
    amount = serializers.IntegerField()
    currency = serializers.CharField()
    message = serializers.CharField(allow_null=True)
    context = ContextOut()


class RefundDetail(RefundOut):
    processor_refund_id = serializers.CharField(allow_null=True)
    failure_code = serializers.CharField(allow_null=True)
    failure_message = serializers.CharField(allow_null=True)
    submitted_at = serializers.DateTimeField(allow_null=True)
    settled_at = serializers.DateTimeField(allow_null=True)
    pending_at_gateway = serializers.BooleanField()
    suggested_message = serializers.CharField()
    transaction_remaining_amount = serializers.IntegerField()


class RefundDetailOut(serializers.Serializer):
    refund = RefundDetail()
    verdict = VerdictOut(allow_null=True)


class ErrorBody(serializers.Serializer):
    code = serializers.ChoiceField(choices=sorted(ERROR_STATUS))
    message = serializers.CharField()
    verdict_id = serializers.CharField(allow_null=True)


class ErrorOut(serializers.Serializer):
    error = ErrorBody()


def errors(*statuses: int) -> dict[int, OpenApiResponse]:
    """Document each status with the contract codes that answer with it."""
    out = {}
    for status in statuses:
        codes = sorted(code for code, s in ERROR_STATUS.items() if s == status)
        out[status] = OpenApiResponse(ErrorOut, description="Codes: " + ", ".join(codes))
    return out
