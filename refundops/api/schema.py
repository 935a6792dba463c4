"""Serializers that describe the API for the OpenAPI document. Validation itself lives in
refundops.inputs, shared with MCP, so these only document shapes."""

from __future__ import annotations

from collections import defaultdict

from drf_spectacular.extensions import OpenApiAuthenticationExtension
from drf_spectacular.types import OpenApiTypes
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse
from rest_framework import serializers

from refundops.errors import ERROR_STATUS
from refundops.inputs import MAX_AMOUNT_MINOR
from refundops.models import Reason



class AgentKeyScheme(OpenApiAuthenticationExtension):
    """Documents ``Authorization: Bearer rk_…`` for every operation."""

    target_class = "refundops.api.auth.AgentKeyAuthentication"
    name = "agentKey"

    def get_security_definition(self, auto_schema):
        return {"type": "http", "scheme": "bearer", "bearerFormat": "rk_…",
                "description": "An agent key (rk_…), shown once when an operator creates it."}


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
    verdict_id = serializers.CharField(allow_null=True, help_text="vd_… that recorded the refusal; null "
                                                                  "when no caller is known (a bad key)")
    field = serializers.CharField(required=False, help_text="VALIDATION_ERROR: the field at fault")
    deduplicated = serializers.BooleanField(required=False, help_text="A replay of the key's first answer")
    retry_after = serializers.IntegerField(required=False, help_text="Seconds, also in Retry-After")
    scope = serializers.CharField(required=False, help_text="RATE_LIMITED: agent, session or global")
    capability = serializers.CharField(required=False, help_text="CAPABILITY_NOT_GRANTED: the one needed")
    refund_id = serializers.CharField(required=False, help_text="A refused refund's id (status denied)")
    operation_id = serializers.CharField(required=False, help_text="GATEWAY_*: the void or capture (op_…)")
    payment_link_id = serializers.CharField(required=False, help_text="GATEWAY_*: the link (pl_…)")
    gateway_code = serializers.CharField(required=False, help_text="GATEWAY_*: the gateway's own code")


class ErrorOut(serializers.Serializer):
    error = ErrorBody()


# Every call may be refused by its key, its capability or the rate limits; a POST also needs its
# body, its Idempotency-Key, and the rate-limit store (calls that change anything fail closed).
# IDEMPOTENCY_KEY_REUSED is every POST's but the dry run's, which claims no key.
KEY_CHECKS = ("UNAUTHENTICATED", "CAPABILITY_NOT_GRANTED", "RATE_LIMITED")
POST_CHECKS = (*KEY_CHECKS, "SERVICE_UNAVAILABLE", "VALIDATION_ERROR", "IDEMPOTENCY_KEY_REQUIRED",
               "PAYLOAD_TOO_LARGE")


def errors(*codes: str) -> dict[int, OpenApiResponse]:
    """Document each status with exactly the codes this operation answers with."""
    by_status: dict[int, list[str]] = defaultdict(list)
    for code in codes:
        by_status[ERROR_STATUS[code]].append(code)
    return {status: OpenApiResponse(ErrorOut, description="Codes: " + ", ".join(sorted(found)))
            for status, found in sorted(by_status.items())}


# -- voids, captures, payment links, dispute drafts --------------------------------------------------

class VoidIn(serializers.Serializer):
    note = serializers.CharField(required=False, max_length=2000)
    agent = AgentContextIn(required=False)


class CaptureIn(VoidIn):
    amount = serializers.IntegerField(min_value=1, help_text="Minor units as a JSON integer, at most the "
                                                             "confirmed order amount (order_amount).")


class OperationOut(serializers.Serializer):
    id = serializers.CharField(help_text="op_…")
    kind = serializers.ChoiceField(choices=["void", "capture"])
    status = serializers.ChoiceField(choices=["pending", "succeeded", "failed", "unknown"],
                                     help_text="unknown: sent, the answer lost; looked up at the gateway on a retry "
                                               "with the same Idempotency-Key and by a periodic job")
    amount = serializers.IntegerField(allow_null=True)
    currency = serializers.CharField()
    gateway_reference = serializers.CharField(allow_null=True)
    finished_at = serializers.DateTimeField(allow_null=True)


class OperationDone(serializers.Serializer):
    payment = PaymentOut()
    operation = OperationOut()
    verdict = VerdictOut()
    deduplicated = serializers.BooleanField()


class PaymentLinkIn(serializers.Serializer):
    transaction_id = serializers.CharField(required=False, max_length=40,
                                           help_text="The payment (txn_…); or send order_reference instead")
    order_reference = serializers.CharField(required=False, max_length=100)
    template = serializers.CharField(max_length=40, help_text="An approved template's id (tpl_…)")
    amount = serializers.IntegerField(min_value=1, help_text="Minor units as a JSON integer; at most what is "
                                                             "still owed on the order (amount_owed)")
    agent = AgentContextIn(required=False)


class PaymentLinkOut(serializers.Serializer):
    id = serializers.CharField(help_text="pl_…")
    status = serializers.ChoiceField(choices=["sent", "paid", "expired", "failed"])
    url = serializers.CharField(allow_null=True)
    amount = serializers.IntegerField()
    currency = serializers.CharField()
    transaction_id = serializers.CharField()
    order_reference = serializers.CharField(allow_null=True)
    template = serializers.CharField()
    message = serializers.CharField(allow_null=True, help_text="The template's text with the link filled in")
    sent_at = serializers.DateTimeField()
    paid_at = serializers.DateTimeField(allow_null=True)


class PaymentLinkSent(serializers.Serializer):
    payment_link = PaymentLinkOut()
    verdict = VerdictOut()
    deduplicated = serializers.BooleanField()


class EvidenceDraftIn(serializers.Serializer):
    summary = serializers.CharField(required=False, max_length=20000)
    customer_communication = serializers.CharField(required=False, max_length=20000)
    refund_policy = serializers.CharField(required=False, max_length=20000)
    shipping_documentation = serializers.CharField(required=False, max_length=20000)
    agent = AgentContextIn(required=False)


class EvidenceDraftOut(serializers.Serializer):
    id = serializers.CharField(help_text="de_…")
    dispute_id = serializers.CharField()
    status = serializers.ChoiceField(choices=["draft"])
    summary = serializers.CharField()
    customer_communication = serializers.CharField()
    refund_policy = serializers.CharField()
    shipping_documentation = serializers.CharField()
    created_at = serializers.DateTimeField()


class DisputeOut(serializers.Serializer):
    id = serializers.CharField()
    transaction_id = serializers.CharField()
    status = serializers.ChoiceField(choices=["open", "won", "lost"])
    reason = serializers.CharField()
    amount = serializers.IntegerField()
    currency = serializers.CharField()
    evidence_due_by = serializers.DateTimeField(allow_null=True)


class EvidenceDraftCreated(serializers.Serializer):
    draft = EvidenceDraftOut()
    dispute = DisputeOut()
    verdict = VerdictOut()
    deduplicated = serializers.BooleanField()



# -- the request schemas as strict as the services ---------------------------------------------------

NO_NUL = "^[^\\x00]*$"  # PostgreSQL text holds no U+0000: such text is a VALIDATION_ERROR
# Required texts are stripped (str.strip()), then must not be empty. A JSON Schema \s (ECMA-262) lacks
# U+001C-U+001F and U+0085, which strip() removes: they are spelled out.
NOT_BLANK = "^[^\\x00]*[^\\x00\\s\\x1c-\\x1f\\x85][^\\x00]*$"
ONE_OF = {  # fields of which the service takes exactly one / at least one
    "PaymentLinkInRequest": {"oneOf": [{"required": ["transaction_id"]}, {"required": ["order_reference"]}]},
    "EvidenceDraftInRequest": {"anyOf": [{"required": [name], "properties": {name: {"pattern": NOT_BLANK}}}
                                         for name in ("summary", "customer_communication", "refund_policy",
                                                      "shipping_documentation")]},
}


def strict_requests(result, generator, request, public):
    """drf-spectacular post-processing: what the document says a request may hold is what the
    services accept (unknown fields, U+0000, blank required texts, amounts over the cap and over-long
    Idempotency-Keys are each a VALIDATION_ERROR or IDEMPOTENCY_KEY_REQUIRED), so a generated
    request that fits the document reaches a decision."""
    for name, component in result.get("components", {}).get("schemas", {}).items():
        if not name.endswith("InRequest"):
            continue
        component["additionalProperties"] = False
        component.update(ONE_OF.get(name, {}))
        for field, prop in component.get("properties", {}).items():
            if prop.get("type") == "string" and "enum" not in prop:
                prop["pattern"] = NOT_BLANK if field in component.get("required", []) else NO_NUL
            if prop.get("type") == "integer":
                prop["maximum"] = MAX_AMOUNT_MINOR
    for methods in result.get("paths", {}).values():
        for operation in methods.values():
            body = operation.get("requestBody")
            if body and operation.get("operationId") != "void_authorization":  # a void may have no body
                body["required"] = True
            for parameter in operation.get("parameters", []):
                if parameter["name"] == "Idempotency-Key":
                    parameter["schema"] = {"type": "string", "minLength": 1, "maxLength": 255, "pattern": NOT_BLANK}
                elif parameter["in"] == "path":  # ids are ours: letters, digits and _.:- (refundops.inputs)
                    parameter["schema"] = {"type": "string", "minLength": 1, "maxLength": 40,
                                           "pattern": "^[A-Za-z0-9_.:-]+$"}
    return result
