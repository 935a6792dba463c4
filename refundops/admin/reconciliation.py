"""Finance's Reconciliation page: each difference between a gateway's books and ours, both sides
side by side, resolved by a person with a note (``resolve_discrepancy``, audited)."""

from typing import Any

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.utils import quote, unquote
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html

from audit.admin import ReadOnlyAdmin, admin_link
from processors.money import format_minor
from refundops.errors import ApiError
from refundops.models import LedgerDiscrepancy
from refundops.services.reconciliation import resolve_discrepancy

RESOLVE_PERMISSION = "refundops.resolve_discrepancy"


def book_side(side: dict[str, Any]) -> str:
    """One side of a difference in words: ``settled 25.00 USD (rf_…)``, ``captured 60.00 USD``, or
    what that side lacks."""
    if not side or all(value is None for value in side.values()):
        what = next(iter(side), "record")
        return f"no such {what}"
    currency = side.get("currency", "")
    words = [str(side["status"])] if side.get("status") else []
    amount = side.get("amount_minor", side.get("amount"))  # the worker's records say "amount"
    if isinstance(amount, int) and currency:
        words.append(format_minor(amount, currency))
    if side.get("captured_minor") is not None:
        words.append(f"captured {format_minor(side['captured_minor'], currency)}")
    if side.get("refunded_minor") is not None:
        words.append(f"refunded {format_minor(side['refunded_minor'], currency)}")
    ids = [str(side[key]) for key in ("refund_id", "processor_refund_id", "our_refund_id") if side.get(key)]
    if side.get("error"):
        words.append(str(side["error"]))
    return " ".join(words) + (f" ({', '.join(ids)})" if ids else "")


class ResolveForm(forms.Form):
    note = forms.CharField(max_length=2000, widget=forms.Textarea(attrs={"rows": 4}),
                           help_text="What was done about it (refunded by hand, corrected at the gateway, "
                                     "recorded here, …). Kept with the discrepancy and in the audit log.")


@admin.register(LedgerDiscrepancy)
class LedgerDiscrepancyAdmin(ReadOnlyAdmin):
    """Written by the reconciler (and the worker and the webhook path); closed only by a person."""

    ordering = ["-detected_at"]
    # Narrow enough to read beside the admin's navigation: the rest is on each row's page.
    list_display = ["id", "kind", "payment_link", "our_books", "their_books", "resolve_link"]
    list_filter = ["status", "kind", "gateway", "detected_at"]
    search_fields = ["id", "payment__id", "refund__id", "gateway_reference"]
    list_select_related = ["resolved_by"]
    fields = ["id", "status", "kind", "payment_link", "refund_link", "gateway", "account", "gateway_reference",
              "our_books", "their_books", "detail", "ours", "theirs", "detected_at", "last_seen_at",
              "resolved_at", "resolved_by", "resolution_note", "resolve_link"]

    @admin.display(description="payment", ordering="payment_id")
    def payment_link(self, obj: LedgerDiscrepancy) -> str:
        return admin_link("admin:refundops_payment_change", obj.payment_id)

    @admin.display(description="refund")
    def refund_link(self, obj: LedgerDiscrepancy) -> str:
        return admin_link("admin:refundops_refund_change", obj.refund_id)

    @admin.display(description="our ledger")
    def our_books(self, obj: LedgerDiscrepancy) -> str:
        return book_side(obj.ours)

    @admin.display(description="the gateway")
    def their_books(self, obj: LedgerDiscrepancy) -> str:
        return book_side(obj.theirs)

    @admin.display(description="status")
    def resolve_link(self, obj: LedgerDiscrepancy) -> str:
        if obj.status != LedgerDiscrepancy.Status.OPEN:
            return f"resolved by {obj.resolved_by}" if obj.resolved_by else "-"
        url = reverse("admin:refundops_ledgerdiscrepancy_resolve", args=[quote(obj.pk)])
        return format_html('<a class="button" href="{}">Resolve…</a>', url)

    def get_urls(self):
        return [path("<path:object_id>/resolve/", self.admin_site.admin_view(self.resolve_view),
                     name="refundops_ledgerdiscrepancy_resolve"),
                *super().get_urls()]

    def resolve_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        if not request.user.has_perm(RESOLVE_PERMISSION):
            raise PermissionDenied
        discrepancy = get_object_or_404(LedgerDiscrepancy, pk=unquote(object_id))
        form = ResolveForm(request.POST or None)
        if request.method == "POST" and form.is_valid():
            try:
                resolve_discrepancy(discrepancy_id=discrepancy.pk, user=request.user, note=form.cleaned_data["note"])
            except ApiError as refused:
                messages.error(request, f"{refused.code}: {refused.message}")
            else:
                messages.success(request, f"Resolved {discrepancy.pk}: {form.cleaned_data['note']}")
                return HttpResponseRedirect(reverse("admin:refundops_ledgerdiscrepancy_changelist"))
        context = {**self.admin_site.each_context(request), "opts": self.opts, "form": form,
                   "title": f"Resolve {discrepancy.pk}", "discrepancy": discrepancy,
                   "ours": book_side(discrepancy.ours), "theirs": book_side(discrepancy.theirs)}
        return TemplateResponse(request, "admin/refundops/ledgerdiscrepancy/resolve_form.html", context)
