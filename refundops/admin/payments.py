"""Finance's pages on payments: customers, payments (and a staff refund from one), voids and
captures, payment links and their templates, disputes and evidence drafts."""

import uuid
from decimal import Decimal, InvalidOperation

from django import forms
from django.contrib import admin, messages
from django.contrib.admin.utils import quote, unquote
from django.core.exceptions import PermissionDenied
from django.db.models import Count
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils.html import format_html

from audit.admin import (
    EstimatedCountPaginator,
    ExactIdSearch,
    HistoryAdmin,
    ReadOnlyHistoryAdmin,
    RecentValuesListFilter,
    money_or_dash,
)
from processors.money import currency_exponent, format_minor
from refundops.callers import Caller
from refundops.inputs import MAX_AMOUNT_MINOR
from refundops.models import (
    Customer,
    Dispute,
    DisputeEvidenceDraft,
    Payment,
    PaymentLink,
    PaymentLinkTemplate,
    PaymentOperation,
    Reason,
    Refund,
    RefundState,
)
from refundops.errors import ApiError
from refundops.services.disputes import submit_dispute_evidence
from refundops.services.order_amounts import confirm_order_amount
from refundops.services.payments import capture_payment
from refundops.services.refunds import request_refund
from proposals.admin import ProposeChangeMixin
from proposals.models import Proposal
from refundops.admin.base import ReadOnlyInline, RowLinks


# -- customers and payments -------------------------------------------------------------------------

@admin.register(Customer)
class CustomerAdmin(ReadOnlyHistoryAdmin):
    ordering = ["-created_at"]
    list_display = ["id", "name", "email", "email_changed_at", "address_changed_at", "payment_count", "created_at"]
    search_fields = ["id", "name", "email"]

    def get_queryset(self, request):
        return super().get_queryset(request).annotate(n_payments=Count("payments"))

    @admin.display(description="payments", ordering="n_payments")
    def payment_count(self, obj: Customer) -> int:
        return obj.n_payments


class RefundInline(RowLinks, ReadOnlyInline, admin.TabularInline):
    model = Refund
    fields = ["id", "amount", "status", "reason", "origin", "hold_reasons", "created_at", "verdict_link"]
    readonly_fields = fields
    ordering = ["-created_at"]


class DisputeInline(RowLinks, ReadOnlyInline, admin.TabularInline):
    model = Dispute
    fields = ["id", "status", "reason", "amount", "evidence_due_by", "created_at"]
    readonly_fields = fields


def minor_units(text: str, currency: str) -> int:
    """``"19.99"`` in ``currency`` as minor units, exactly; a form error for anything else."""
    text = text.strip().replace(",", "")
    try:
        major = Decimal(text)
    except InvalidOperation:
        raise forms.ValidationError("Enter an amount such as 19.99.") from None
    if not major.is_finite():  # Decimal reads "Infinity", "NaN" and "sNaN"; none is money
        raise forms.ValidationError("Enter an amount such as 19.99.")
    exponent = currency_exponent(currency)
    # Judged by its exponent first: scaling 1e999999999 overflows, and 1e-999999999 underflows.
    if major.adjusted() >= len(str(MAX_AMOUNT_MINOR)) - exponent:
        raise forms.ValidationError(f"The amount must be at most {format_minor(MAX_AMOUNT_MINOR, currency)}.")
    if major.as_tuple().exponent < -exponent - 20:  # not even trailing zeros run this long
        raise forms.ValidationError(f"{currency} has {exponent} decimal places.")
    minor = major.scaleb(exponent)
    if minor != minor.to_integral_value():
        raise forms.ValidationError(f"{currency} has {exponent} decimal places.")
    if minor <= 0:
        raise forms.ValidationError("The amount must be more than zero.")
    if minor > MAX_AMOUNT_MINOR:
        raise forms.ValidationError(f"The amount must be at most {format_minor(MAX_AMOUNT_MINOR, currency)}.")
    return int(minor)


class StaffRefundForm(forms.Form):
    """A person asks for a refund; the same policy decides it as for an agent (origin: staff)."""

    amount = forms.CharField(required=False, max_length=30,
                             help_text="In the payment's currency, e.g. 19.99. Leave blank for the whole "
                                       "refundable amount.")
    reason = forms.ChoiceField(choices=Reason.choices)
    note = forms.CharField(required=False, max_length=2000, widget=forms.Textarea(attrs={"rows": 3}))
    # Rendered once per form: a double submit replays the first answer instead of paying twice.
    idempotency_key = forms.CharField(widget=forms.HiddenInput, max_length=255)

    def __init__(self, *args, currency: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.currency = currency

    def clean_amount(self) -> int | None:
        text = self.cleaned_data["amount"].strip()
        return minor_units(text, self.currency) if text else None


class OrderAmountForm(forms.Form):
    """A person confirms the order amount of an authorisation (agents capture up to it)."""

    amount = forms.CharField(max_length=30, help_text="In the payment's currency, e.g. 19.99; at most what "
                                                      "was authorised.")
    note = forms.CharField(required=False, max_length=2000, widget=forms.Textarea(attrs={"rows": 3}))

    def __init__(self, *args, currency: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.currency = currency

    def clean_amount(self) -> int:
        return minor_units(self.cleaned_data["amount"], self.currency)


class StaffCaptureForm(OrderAmountForm):
    """A person captures an authorisation, through the same service and checks as an agent."""

    idempotency_key = forms.CharField(widget=forms.HiddenInput, max_length=255)


@admin.register(Payment)
class PaymentAdmin(ExactIdSearch, ReadOnlyHistoryAdmin):
    ordering = ["-created_at"]
    # Narrow enough for a 1366 px laptop beside the filters: what is pending beside what is refunded,
    # the risks in one column, the gateway under the method.
    list_display = ["id", "customer_name", "captured", "refundable", "refunded", "status", "risks", "method_and_gateway",
                    "captured_at"]
    list_filter = ["status", "processor", "dispute_status", "paid_twice", ("currency", RecentValuesListFilter),
                   ("method_type", RecentValuesListFilter), ("captured_at", admin.DateFieldListFilter)]
    search_fields = ["id", "processor_reference", "order_reference", "customer__email", "customer__name",
                     "=method_last4"]
    list_select_related = ["customer"]
    show_full_result_count = False
    paginator = EstimatedCountPaginator
    exact_search = {"txn": ("id",), "cus": ("customer_id",), "@": ("customer__email__iexact",)}
    inlines = [RefundInline, DisputeInline]
    fieldsets = [
        (None, {"fields": ["id", "customer", "status", "processor", "processor_account", "processor_reference",
                           "authorization_reference", "created_at", "captured_at"]}),
        ("Amounts", {"fields": ["authorized", "captured", "refunded", "pending", "refundable", "order_reference",
                                "order_amount", "owed"]}),
        ("Method (no card data is kept)", {"fields": ["method_type", "method_brand", "method_last4"]}),
        ("Disputes and fraud", {"fields": ["dispute_status", "dispute_reference", "fraud_flags", "paid_twice"]}),
    ]

    @admin.display(description="authorised")
    def authorized(self, obj: Payment) -> str:
        return format_minor(obj.amount_authorized_minor, obj.currency)

    @admin.display(description="captured", ordering="amount_captured_minor")
    def captured(self, obj: Payment) -> str:
        return format_minor(obj.amount_captured_minor, obj.currency)

    @admin.display(description="refunded", ordering="amount_refunded_minor")
    def refunded(self, obj: Payment) -> str:
        refunded = format_minor(obj.amount_refunded_minor, obj.currency)
        if not obj.amount_reserved_minor:
            return refunded
        return format_html("{}<br><small>{} pending</small>", refunded,
                           format_minor(obj.amount_reserved_minor, obj.currency))

    @admin.display(description="customer", ordering="customer__name")
    def customer_name(self, obj: Payment) -> str:
        return obj.customer.name or obj.customer.email  # the id is on the payment's page

    @admin.display(description="risks", ordering="dispute_status")
    def risks(self, obj: Payment) -> str:
        said = [f"dispute {obj.get_dispute_status_display().lower()}" if obj.dispute_status != Payment.Dispute.NONE
                else "", "fraud flags" if obj.fraud_flags else "", "paid twice" if obj.paid_twice else ""]
        return ", ".join(s for s in said if s) or "-"

    @admin.display(description="method, gateway")
    def method_and_gateway(self, obj: Payment) -> str:
        return format_html("{}<br><small>{}</small>", obj.method_display, obj.get_processor_display())

    @admin.display(description="refund pending")
    def pending(self, obj: Payment) -> str:
        return format_minor(obj.amount_reserved_minor, obj.currency)

    @admin.display(description="refundable")
    def refundable(self, obj: Payment) -> str:
        return format_minor(max(obj.refundable_minor, 0), obj.currency)

    @admin.display(description="order amount")
    def order_amount(self, obj: Payment) -> str:
        return money_or_dash(obj.order_amount_minor, obj.currency)

    @admin.display(description="still owed")
    def owed(self, obj: Payment) -> str:
        return format_minor(obj.amount_owed_minor, obj.currency)

    @admin.display(description="method")
    def method(self, obj: Payment) -> str:
        return obj.method_display

    @admin.display(description="fraud flags", boolean=True)
    def fraud(self, obj: Payment) -> bool:
        return bool(obj.fraud_flags)

    def get_urls(self):
        return [path("<path:object_id>/refund/", self.admin_site.admin_view(self.refund_view),
                     name="refundops_payment_refund"),
                path("<path:object_id>/order-amount/", self.admin_site.admin_view(self.order_amount_view),
                     name="refundops_payment_order_amount"),
                path("<path:object_id>/capture/", self.admin_site.admin_view(self.capture_view),
                     name="refundops_payment_capture"),
                *super().get_urls()]

    def change_view(self, request, object_id, form_url="", extra_context=None):
        extra = {"can_refund": request.user.has_perm("refundops.add_refund"),
                 "can_capture": request.user.has_perm("refundops.change_payment"), **(extra_context or {})}
        return super().change_view(request, object_id, form_url, extra)

    def _payment_page(self, request, payment: Payment, *, title: str, form, submit: str, text: str):
        context = {**self.admin_site.each_context(request), "opts": self.opts, "title": title, "payment": payment,
                   "form": form, "submit": submit, "text": text,
                   "authorized": format_minor(payment.amount_authorized_minor, payment.currency),
                   "order_amount": money_or_dash(payment.order_amount_minor, payment.currency)}
        return TemplateResponse(request, "admin/refundops/payment/authorization_form.html", context)

    def order_amount_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        if not request.user.has_perm("refundops.change_payment"):
            raise PermissionDenied
        payment = get_object_or_404(Payment, pk=unquote(object_id))
        form = OrderAmountForm(request.POST or None, currency=payment.currency)
        if request.method == "POST" and form.is_valid():
            try:
                confirm_order_amount(payment_id=payment.pk, amount_minor=form.cleaned_data["amount"],
                                     user=request.user, note=form.cleaned_data["note"])
            except ApiError as refused:
                messages.error(request, f"{refused.code}: {refused.message}")
            else:
                messages.success(request, f"Order amount of {payment.pk} confirmed: "
                                          f"{format_minor(form.cleaned_data['amount'], payment.currency)}.")
                return HttpResponseRedirect(reverse("admin:refundops_payment_change", args=[quote(payment.pk)]))
        return self._payment_page(request, payment, title=f"Order amount of {payment.pk}", form=form,
                                  submit="Confirm order amount",
                                  text="Agents may capture this authorisation up to the order amount you confirm.")

    def capture_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        if not request.user.has_perm("refundops.change_payment"):
            raise PermissionDenied
        payment = get_object_or_404(Payment, pk=unquote(object_id))
        fresh = {"idempotency_key": uuid.uuid4().hex}
        form = StaffCaptureForm(request.POST or None, initial=fresh, currency=payment.currency)
        if request.method == "POST" and form.is_valid():
            answer = capture_payment(caller=Caller.for_user(request.user), txn_id=payment.pk,
                                     data={"amount": form.cleaned_data["amount"], "note": form.cleaned_data["note"]},
                                     idempotency_key=form.cleaned_data["idempotency_key"])
            if answer.ok:
                operation = answer.body["operation"]
                said = messages.warning if operation["status"] == "unknown" else messages.success
                said(request, f"Capture {operation['id']} of "
                              f"{format_minor(operation['amount'], operation['currency'])}: {operation['status']}"
                              + (" (the gateway's answer was lost; it is looked up at the gateway every minute, "
                                 "do not capture again)." if operation["status"] == "unknown" else "."))
                return HttpResponseRedirect(reverse("admin:refundops_payment_change", args=[quote(payment.pk)]))
            error = answer.body["error"]
            messages.error(request, f"{error['code']}: {error['message']}")
            form = StaffCaptureForm(initial={**fresh, "amount": request.POST.get("amount", ""),
                                             "note": request.POST.get("note", "")}, currency=payment.currency)
        return self._payment_page(request, payment, title=f"Capture {payment.pk}", form=form, submit="Capture",
                                  text="Captures at the gateway now, at most the confirmed order amount.")

    def refund_view(self, request: HttpRequest, object_id: str) -> HttpResponse:
        if not request.user.has_perm("refundops.add_refund"):
            raise PermissionDenied
        payment = get_object_or_404(Payment.objects.select_related("customer"), pk=unquote(object_id))
        fresh = {"idempotency_key": uuid.uuid4().hex}
        form = StaffRefundForm(request.POST or None, initial=fresh, currency=payment.currency)
        if request.method == "POST" and form.is_valid():
            data = {"transaction_id": payment.pk, "reason": form.cleaned_data["reason"],
                    "note": form.cleaned_data["note"]}
            if form.cleaned_data["amount"] is not None:
                data["amount"] = form.cleaned_data["amount"]
            answer = request_refund(caller=Caller.for_user(request.user), data=data,
                                    idempotency_key=form.cleaned_data["idempotency_key"])
            if answer.ok:
                refund = answer.body["refund"]
                text = f"Refund {refund['id']} of {format_minor(refund['amount'], refund['currency'])}: {refund['status']}"
                if refund["status"] == RefundState.HELD:
                    messages.warning(request, f"{text}, held for a person ({', '.join(refund['hold_reasons'])}).")
                else:
                    messages.success(request, f"{text}.")
                return HttpResponseRedirect(reverse("admin:refundops_refund_change", args=[quote(refund["id"])]))
            error = answer.body["error"]
            messages.error(request, f"{error['code']}: {error['message']}")
            # A corrected request is a new request: it needs a key of its own.
            typed = {name: request.POST.get(name, "") for name in ("amount", "reason", "note")}
            form = StaffRefundForm(initial={**typed, **fresh}, currency=payment.currency)
        context = {
            **self.admin_site.each_context(request), "opts": self.opts, "title": f"Refund payment {payment.pk}",
            "payment": payment, "form": form,
            "refundable": format_minor(max(payment.refundable_minor, 0), payment.currency),
            "captured": format_minor(payment.amount_captured_minor, payment.currency),
        }
        return TemplateResponse(request, "admin/refundops/payment/refund_form.html", context)


# -- voids and captures, payment links, disputes ----------------------------------------------------

@admin.register(PaymentOperation)
class PaymentOperationAdmin(RowLinks, ReadOnlyHistoryAdmin):
    ordering = ["-created_at"]
    list_display = ["id", "kind", "payment_link", "amount", "status", "agent", "verdict_link", "created_at",
                    "finished_at"]
    list_filter = ["kind", "status"]
    search_fields = ["id", "payment__id", "gateway_reference"]
    list_select_related = ["agent"]


class PaymentLinkTemplateForm(forms.ModelForm):
    class Meta:
        model = PaymentLinkTemplate
        fields = ["name", "message", "active"]


@admin.register(PaymentLinkTemplate)
class PaymentLinkTemplateAdmin(ProposeChangeMixin, HistoryAdmin):
    """Agents send links only from templates a second person approved: a new template or an edit
    is a proposal, and whoever approves it is the template's approver, so what a person approved
    is what customers receive."""

    proposal_kind = Proposal.Kind.LINK_TEMPLATE
    ordering = ["name"]
    form = PaymentLinkTemplateForm
    list_display = ["name", "active", "approved_by", "approved_at", "created_at"]
    list_filter = ["active"]
    search_fields = ["name", "message"]
    list_select_related = ["approved_by"]
    readonly_fields = ["approved_by", "approved_at"]

    def has_delete_permission(self, request, obj=None) -> bool:
        return False  # links sent from a template point at it; retire a template by deactivating it


@admin.register(PaymentLink)
class PaymentLinkAdmin(RowLinks, ReadOnlyHistoryAdmin):
    ordering = ["-sent_at"]
    list_display = ["id", "payment_link", "order_reference", "amount", "status", "template", "agent", "sent_at",
                    "paid_at"]
    list_filter = ["status", "template"]
    search_fields = ["id", "payment__id", "order_reference"]
    list_select_related = ["template", "agent"]


class EvidenceDraftInline(ReadOnlyInline, admin.StackedInline):
    model = DisputeEvidenceDraft
    fields = ["id", "status", "drafted_by", "created_at", *DisputeEvidenceDraft.TEXT_FIELDS, "submitted_by",
              "submitted_at", "gateway_response"]
    readonly_fields = fields


@admin.register(Dispute)
class DisputeAdmin(RowLinks, ReadOnlyHistoryAdmin):
    ordering = ["-created_at"]
    list_display = ["id", "payment_link", "amount", "status", "reason", "refunded", "evidence_due_by",
                    "created_at"]
    list_filter = ["status", "reason"]
    search_fields = ["id", "payment__id", "processor_dispute_id"]
    list_select_related = ["payment"]
    inlines = [EvidenceDraftInline]


    @admin.display(description="refunded on the payment")
    def refunded(self, obj: Dispute) -> str:
        payment = obj.payment
        return format_minor(payment.amount_refunded_minor + payment.amount_reserved_minor, payment.currency)


@admin.register(DisputeEvidenceDraft)
class DisputeEvidenceDraftAdmin(ReadOnlyHistoryAdmin):
    """Agents draft; a person reads the draft and submits it to the gateway with the action."""

    ordering = ["-created_at"]
    list_display = ["id", "dispute", "status", "drafted_by", "created_at", "submitted_by", "submitted_at"]
    list_filter = ["status"]
    search_fields = ["id", "dispute__id"]
    list_select_related = ["dispute", "drafted_by", "submitted_by"]
    actions = ["submit_to_gateway"]

    def has_submit_permission(self, request) -> bool:
        return request.user.has_perm("refundops.change_disputeevidencedraft")

    @admin.action(description="Submit selected drafts to the gateway", permissions=["submit"])
    def submit_to_gateway(self, request, queryset):
        for draft_id in queryset.values_list("pk", flat=True):
            try:
                draft = submit_dispute_evidence(draft_id=draft_id, user=request.user)
            except (ApiError, PermissionDenied) as refused:
                messages.error(request, f"{draft_id}: {getattr(refused, 'message', refused)}")
                continue
            answer = draft.gateway_response
            if draft.status == DisputeEvidenceDraft.Status.SUBMITTED:
                messages.success(request, f"{draft.pk} submitted to {answer['gateway']}: the dispute is "
                                          f"{answer['status']}.")
            elif draft.status == DisputeEvidenceDraft.Status.FAILED:
                messages.error(request, f"{draft.pk}: {answer['gateway']} refused ({answer['error']}) "
                                        f"{answer['message']}")
            else:
                messages.warning(request, f"{draft.pk}: {answer['gateway']} did not answer ({answer['error']}); "
                                          f"nothing changed there yet. Submit it again later.")
