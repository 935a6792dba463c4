"""REST faces: authenticate, check the capability and the rate limits, call one service, render
its answer. The responses documented for each operation are exactly those it can give."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiResponse, extend_schema
from rest_framework.exceptions import NotAcceptable, ParseError
from rest_framework.negotiation import DefaultContentNegotiation
from rest_framework.parsers import JSONParser
from rest_framework.renderers import JSONRenderer
from rest_framework.response import Response
from rest_framework.views import APIView

from processors.bodies import BodyTooLarge
from refundops.answers import Answer
from refundops.api import schema
from refundops.api.schema import KEY_CHECKS, POST_CHECKS
from refundops.callers import Caller
from refundops.errors import ApiError
from refundops.inputs import MAX_BODY_BYTES, load_json_body, unstorable
from refundops.models import Capability
from refundops.ratelimit import AgentRateThrottle
from refundops.services import disputes, payments, refunds

GATEWAY = ("GATEWAY_DECLINED", "GATEWAY_UNAVAILABLE")
IN_FLIGHT = OpenApiResponse(
    schema.OperationDone,
    description="Not final. operation.status 'pending': a replay (deduplicated: true) of a request whose "
                "gateway call is still in flight. operation.status 'unknown': the gateway may have acted but "
                "its answer was lost (a timeout after sending) and it could not be asked yet; the payment takes "
                "no other void or capture meanwhile. Send the same request with the same Idempotency-Key to "
                "learn the outcome (it is looked up at the gateway first); never a new key.")


def render(answer: Answer) -> Response:
    if answer.encoded is not None:
        return EncodedResponse(answer.body, encoded=answer.encoded, status=answer.status, headers=answer.headers)
    return Response(answer.body, status=answer.status, headers=answer.headers)


class EncodedResponse(Response):
    """A Response whose body is already encoded as DRF's JSONRenderer renders it for a plain
    ``application/json`` (``answers.encoded``: the stored first answer's text): those bytes are
    sent, not rendered again. Any other rendering (``indent=`` asked for) goes DRF's way."""

    def __init__(self, data, *, encoded: bytes, **kwargs) -> None:
        super().__init__(data, **kwargs)
        self.encoded = encoded

    @property
    def rendered_content(self):
        renderer = getattr(self, "accepted_renderer", None)
        if (type(renderer) is JSONRenderer and self.content_type is None
                and getattr(self, "accepted_media_type", None) == renderer.media_type):
            self["Content-Type"] = renderer.media_type  # as Response.rendered_content: JSON has no charset
            return self.encoded
        return super().rendered_content


class JSONBodyParser(JSONParser):
    """JSON whose text PostgreSQL can store: a U+0000 anywhere is a VALIDATION_ERROR, not a 500
    when the verdict is written."""

    def parse(self, stream, media_type=None, parser_context=None):
        raw = stream.read(MAX_BODY_BYTES + 1) if stream is not None else b""
        try:
            data = load_json_body(raw)
        except BodyTooLarge as exc:
            raise ApiError("PAYLOAD_TOO_LARGE", f"body: {exc}; send a smaller request.", field="body") from None
        except ValueError as exc:
            raise ParseError(f"JSON parse error - {exc}") from None
        problem = unstorable(data)
        if problem:
            raise ParseError(problem)
        return data


class JSONNegotiation(DefaultContentNegotiation):
    """The answer is JSON, the one renderer. A request that takes it as it is (no Accept, ``*/*``
    or ``application/json``; no query string, so no ``?format=``) gets it without DRF parsing the
    header and the query string; any other goes DRF's way (``indent=``, quality lists). One whose
    Accept names no JSON gets JSON too, as RFC 9110 (12.5.1) allows: DRF's NotAcceptable reached no
    handler of ours and answered 500, and a 406 is not in the contract."""

    def select_renderer(self, request, renderers, format_suffix=None):
        default = renderers[0], renderers[0].media_type
        if (len(renderers) == 1 and not format_suffix and not request.META.get("QUERY_STRING")
                and request.META.get("HTTP_ACCEPT", "*/*") in ("*/*", default[1])):
            return default
        try:
            return super().select_renderer(request, renderers, format_suffix)
        except NotAcceptable:
            return default


class AgentView(APIView):
    """Key (authentication), capability (permission), rate limits (throttle), in the contract's order."""

    required_capability: str
    throttle_classes = [AgentRateThrottle]
    parser_classes = [JSONBodyParser]
    content_negotiation_class = JSONNegotiation

    def caller(self, request) -> Caller:
        return Caller.for_key(request.auth)

    @staticmethod
    def idempotency_key(request) -> str:
        return request.META.get("HTTP_IDEMPOTENCY_KEY", "").strip()  # request.headers would copy every header


class PaymentDetailView(AgentView):
    required_capability = Capability.PAYMENTS_READ

    @extend_schema(operation_id="lookup_payment", summary="Look up a payment",
                   responses={200: schema.PaymentOut, **schema.errors(*KEY_CHECKS, "PAYMENT_NOT_FOUND")})
    def get(self, request, txn_id: str):
        return Response(payments.lookup_payment(txn_id=txn_id, caller=self.caller(request)))


class RefundCreateView(AgentView):
    required_capability = Capability.REFUNDS_CREATE

    @extend_schema(operation_id="create_refund", summary="Request a refund to the original method",
                   request=schema.RefundIn, parameters=[schema.IDEMPOTENCY_KEY],
                   responses={201: schema.RefundCreated,
                              202: OpenApiResponse(schema.RefundCreated, description="Held for a person"),
                              **schema.errors(*POST_CHECKS, "IDEMPOTENCY_KEY_REUSED", "PAYMENT_NOT_FOUND",
                                              "PAYMENT_NOT_REFUNDABLE", "DESTINATION_NOT_ALLOWED",
                                              "REASON_NOT_ALLOWED", "REFUND_WINDOW_EXPIRED",
                                              "AMOUNT_EXCEEDS_REFUNDABLE", "MAX_REFUNDS_REACHED",
                                              "CIRCUIT_OPEN", "DAILY_LIMIT_REACHED")})
    def post(self, request):
        return render(refunds.request_refund(caller=self.caller(request), data=request.data,
                                             idempotency_key=self.idempotency_key(request)))


class RefundCheckView(AgentView):
    required_capability = Capability.REFUNDS_CREATE

    @extend_schema(operation_id="check_refund_eligibility", summary="Dry run: the verdict a refund would get",
                   request=schema.RefundIn, parameters=[schema.IDEMPOTENCY_KEY],
                   responses={200: schema.RefundCheckOut, **schema.errors(*POST_CHECKS, "PAYMENT_NOT_FOUND")})
    def post(self, request):
        return render(refunds.check_refund(caller=self.caller(request), data=request.data,
                                           idempotency_key=self.idempotency_key(request)))


class RefundDetailView(AgentView):
    required_capability = Capability.REFUNDS_CREATE

    @extend_schema(operation_id="get_refund", summary="A refund's state, verdict and estimated arrival",
                   responses={200: schema.RefundDetailOut, **schema.errors(*KEY_CHECKS, "REFUND_NOT_FOUND")})
    def get(self, request, rf_id: str):
        return Response(refunds.refund_detail(refund_id=rf_id, caller=self.caller(request)))


class VoidView(AgentView):
    required_capability = Capability.AUTHORIZATIONS_VOID

    @extend_schema(operation_id="void_authorization", summary="Void an uncaptured authorisation",
                   request=schema.VoidIn, parameters=[schema.IDEMPOTENCY_KEY],
                   responses={200: schema.OperationDone, 202: IN_FLIGHT,
                              **schema.errors(*POST_CHECKS, "IDEMPOTENCY_KEY_REUSED", "PAYMENT_NOT_FOUND",
                                              "PAYMENT_NOT_VOIDABLE", *GATEWAY)})
    def post(self, request, txn_id: str):
        return render(payments.void_authorization(caller=self.caller(request), txn_id=txn_id, data=request.data,
                                                  idempotency_key=self.idempotency_key(request)))


class CaptureView(AgentView):
    required_capability = Capability.PAYMENTS_CAPTURE

    @extend_schema(operation_id="capture_payment", summary="Capture up to the confirmed order amount",
                   request=schema.CaptureIn, parameters=[schema.IDEMPOTENCY_KEY],
                   responses={200: schema.OperationDone, 202: IN_FLIGHT,
                              **schema.errors(*POST_CHECKS, "IDEMPOTENCY_KEY_REUSED", "PAYMENT_NOT_FOUND",
                                              "PAYMENT_NOT_CAPTURABLE", "AMOUNT_EXCEEDS_ORDER", *GATEWAY)})
    def post(self, request, txn_id: str):
        return render(payments.capture_payment(caller=self.caller(request), txn_id=txn_id, data=request.data,
                                               idempotency_key=self.idempotency_key(request)))


class PaymentLinkView(AgentView):
    required_capability = Capability.PAYMENT_LINKS_SEND

    @extend_schema(operation_id="send_payment_link",
                   summary="Send a payment link from an approved template for an amount owed",
                   request=schema.PaymentLinkIn, parameters=[schema.IDEMPOTENCY_KEY],
                   responses={201: schema.PaymentLinkSent, 202: IN_FLIGHT,
                              **schema.errors(*POST_CHECKS, "IDEMPOTENCY_KEY_REUSED", "PAYMENT_NOT_FOUND",
                                              "ORDER_NOT_FOUND", "TEMPLATE_NOT_APPROVED", "AMOUNT_NOT_OWED",
                                              "PAYMENT_LINKS_UNSUPPORTED", *GATEWAY)})
    def post(self, request):
        return render(payments.send_payment_link(caller=self.caller(request), data=request.data,
                                                 idempotency_key=self.idempotency_key(request)))


class EvidenceDraftView(AgentView):
    required_capability = Capability.DISPUTES_DRAFT

    @extend_schema(operation_id="draft_dispute_evidence", summary="Draft dispute evidence for a person to submit",
                   request=schema.EvidenceDraftIn, parameters=[schema.IDEMPOTENCY_KEY],
                   responses={201: schema.EvidenceDraftCreated,
                              **schema.errors(*POST_CHECKS, "IDEMPOTENCY_KEY_REUSED", "DISPUTE_NOT_FOUND",
                                              "DISPUTE_NOT_OPEN")})
    def post(self, request, dp_id: str):
        return render(disputes.draft_dispute_evidence(caller=self.caller(request), dp_id=dp_id, data=request.data,
                                                      idempotency_key=self.idempotency_key(request)))
