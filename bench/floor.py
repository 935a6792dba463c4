"""The floor: the least a correct refund write does. Lock the payment row, sum its refunds, insert
one, commit. No key, no policy, no verdict, no audit, no idempotency, no queue."""

from __future__ import annotations

from django.db import transaction
from django.db.models import Sum
from django.urls import re_path
from rest_framework.response import Response
from rest_framework.views import APIView

from refundops.models import Payment, Refund, RefundState


class FloorRefundView(APIView):
    authentication_classes: list = []
    permission_classes: list = []
    throttle_classes: list = []

    def post(self, request):
        amount = int(request.data["amount"])
        with transaction.atomic():
            payment = Payment.objects.select_for_update().get(pk=request.data["transaction_id"])
            refunded = Refund.objects.filter(payment=payment).aggregate(s=Sum("amount_minor", default=0))["s"]
            if refunded + amount > payment.amount_captured_minor:
                return Response({"error": "exceeds captured"}, status=422)
            refund = Refund.objects.create(payment=payment, amount_minor=amount, currency=payment.currency,
                                           reason=request.data["reason"], status=RefundState.APPROVED)
        return Response({"id": refund.pk}, status=201)


urlpatterns = [re_path(r"^api/v1/refunds/?$", FloorRefundView.as_view())]
