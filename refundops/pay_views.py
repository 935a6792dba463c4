"""The sandbox's hosted payment page: what a customer sees when they open a sandbox payment link.
Real gateways host their own page; this one lets the demo show a link being paid."""

from __future__ import annotations

from django.http import Http404
from django.shortcuts import render
from django.views.decorators.http import require_http_methods

from processors.money import format_minor
from refundops.models import PaymentLink
from refundops.services.payments import mark_payment_link_paid


@require_http_methods(["GET", "POST"])
def sandbox_payment_page(request, link_id: str):
    link = PaymentLink.objects.select_related("payment").filter(pk=link_id, payment__processor="sandbox").first()
    if link is None:
        raise Http404("No such payment link")
    if request.method == "POST" and link.status == PaymentLink.Status.SENT:
        link = mark_payment_link_paid(link_id=link.pk, actor="customer:sandbox-page")
    return render(request, "pay/link.html", {
        "link": link, "amount": format_minor(link.amount_minor, link.currency),
        "payable": link.status == PaymentLink.Status.SENT})
