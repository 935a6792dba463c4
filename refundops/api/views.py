"""REST faces: authenticate, check the capability, call one service, render its answer."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.response import Response
from rest_framework.views import APIView

from refundops.answers import Answer
from refundops.api import schema
from refundops.callers import Caller
from refundops.errors import ApiError
from refundops.models import Capability, Payment
from refundops.selectors import payment_json
from refundops.services import refunds


def render(answer: Answer) -> Response:
    return Response(answer.body, status=answer.status, headers=answer.headers)


class AgentView(APIView):
    required_capability: str

    def caller(self, request) -> Caller:
        return Caller.for_key(request.auth)

    @staticmethod
    def idempotency_key(request) -> str:
        return request.headers.get("Idempotency-Key", "").strip()


class PaymentDetailView(AgentView):
    required_capability = Capability.PAYMENTS_READ

    @extend_schema(operation_id="lookup_payment", summary="Look up a payment",
                   responses={200: schema.PaymentOut, **schema.errors(401, 403, 404, 429)})
    def get(self, request, txn_id: str):
        payment = Payment.objects.filter(pk=txn_id).first()
        if payment is None:
            raise ApiError("PAYMENT_NOT_FOUND", f"No payment {txn_id!r}; payment ids start with 'txn_'.")
        return Response(payment_json(payment))


class RefundCreateView(AgentView):
    required_capability = Capability.REFUNDS_CREATE

    @extend_schema(operation_id="create_refund", summary="Request a refund to the original method",
                   request=schema.RefundIn, parameters=[schema.IDEMPOTENCY_KEY],
                   responses={201: schema.RefundCreated,
                              202: OpenApiResponse(schema.RefundCreated, description="Held for a person"),
                              **schema.errors(400, 401, 403, 404, 409, 422, 429, 503)})
    def post(self, request):
        return render(refunds.request_refund(caller=self.caller(request), data=request.data,
                                             idempotency_key=self.idempotency_key(request)))


class RefundCheckView(AgentView):
    required_capability = Capability.REFUNDS_CREATE

    @extend_schema(operation_id="check_refund_eligibility", summary="Dry run: the verdict a refund would get",
                   request=schema.RefundIn, parameters=[schema.IDEMPOTENCY_KEY],
                   responses={200: schema.RefundCheckOut, **schema.errors(400, 401, 403, 404, 429)})
    def post(self, request):
        return render(refunds.check_refund(caller=self.caller(request), data=request.data,
                                           idempotency_key=self.idempotency_key(request)))


class RefundDetailView(AgentView):
    required_capability = Capability.REFUNDS_CREATE

    @extend_schema(operation_id="get_refund", summary="A refund's state, verdict and estimated arrival",
                   responses={200: schema.RefundDetailOut, **schema.errors(401, 403, 404, 429)})
    def get(self, request, rf_id: str):
        return Response(refunds.refund_detail(refund_id=rf_id))
