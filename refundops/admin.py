from refundops import admin_policy  # noqa: F401  (finance's limits and fraud's rules)

# The admin for finance, fraud, operators and auditors. Everything that moves money or access goes
# through the services (request_refund, approve_refund, reject_refund, the agent switches), so the
# admin writes the same verdicts, history and audit entries as the API. Rows those services own are
# read-only here, and history never reverts.

import uuid
from collections.abc import Callable
from datetime import timedelta
from decimal import Decimal, InvalidOperation

from django import forms
from django.conf import settings
from django.contrib import admin, messages
from django.contrib.admin.utils import quote, unquote
from django.core.exceptions import PermissionDenied
from django.db import models
from django.db.models import Count, Q
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.shortcuts import get_object_or_404
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.http import url_has_allowed_host_and_scheme
from django.utils.safestring import SafeString
from django.views.decorators.http import require_POST

from approvals.models import ApprovalAuthority
from approvals.services import approve_refund, reject_refund, resubmit_refund
from audit import charts
from audit.admin import HistoryAdmin, ReadOnlyAdmin, ReadOnlyHistoryAdmin, admin_link, checks_table, money_or_dash
from audit.services import record_audit
from processors.money import currency_exponent, format_minor
from refundops import outbound, reports
from refundops.callers import Caller
from refundops.errors import ApiError
from refundops.models import (
    Agent,
    AgentKey,
    Capability,
    Customer,
    Dispute,
    DisputeEvidenceDraft,
    GatewayCustomer,
    IdempotencyRecord,
    MerchantEndpoint,
    Payment,
    PaymentLink,
    PaymentLinkTemplate,
    PaymentOperation,
    PlatformState,
    Reason,
    Refund,
    RefundState,
    WebhookDelivery,
)
from refundops.services import agents
from refundops.services.refunds import request_refund


def _safe_next(request: HttpRequest, default: str) -> str:
    target = request.POST.get("next") or request.GET.get("next") or ""
    if url_has_allowed_host_and_scheme(target, allowed_hosts={request.get_host()},
                                       require_https=request.is_secure()):
        return target
    return default


class ReadOnlyInline:
    """Rows shown beside their parent, written only by services: look, follow the link, never edit."""

    extra = 0
    can_delete = False
    show_change_link = True

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_change_permission(self, request, obj=None) -> bool:
        return False


class RowLinks:
    """Columns most money rows share: the amount as money, and links to the payment and the verdict."""

    @admin.display(description="amount", ordering="amount_minor")
    def amount(self, obj) -> str:
        return money_or_dash(obj.amount_minor, obj.currency)

    @admin.display(description="payment")
    def payment_link(self, obj) -> str:
        return admin_link("admin:refundops_payment_change", obj.payment_id)

    @admin.display(description="verdict")
    def verdict_link(self, obj) -> str:
        return admin_link("admin:audit_verdict_change", obj.verdict_id)


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
        text = self.cleaned_data["amount"].strip().replace(",", "")
        if not text:
            return None
        try:
            major = Decimal(text)
        except InvalidOperation:
            raise forms.ValidationError("Enter an amount such as 19.99.") from None
        exponent = currency_exponent(self.currency)
        minor = major.scaleb(exponent)
        if minor != minor.to_integral_value():
            raise forms.ValidationError(f"{self.currency} has {exponent} decimal places.")
        if minor <= 0:
            raise forms.ValidationError("The amount must be more than zero.")
        return int(minor)


@admin.register(Payment)
class PaymentAdmin(ReadOnlyHistoryAdmin):
    ordering = ["-created_at"]
    list_display = ["id", "captured", "refundable", "refunded", "pending", "status", "dispute_status", "fraud",
                    "paid_twice", "method", "customer", "processor", "captured_at"]
    list_filter = ["status", "processor", "dispute_status", "paid_twice",
                   ("currency", admin.AllValuesFieldListFilter), "method_type"]
    search_fields = ["id", "processor_reference", "order_reference", "customer__email", "customer__name",
                     "=method_last4"]
    list_select_related = ["customer"]
    date_hierarchy = "captured_at"
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
        return format_minor(obj.amount_refunded_minor, obj.currency)

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
                     name="refundops_payment_refund"), *super().get_urls()]

    def change_view(self, request, object_id, form_url="", extra_context=None):
        extra = {"can_refund": request.user.has_perm("refundops.add_refund"), **(extra_context or {})}
        return super().change_view(request, object_id, form_url, extra)

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


# -- refunds, the held queue and the dashboard ------------------------------------------------------

def _history_table(refund: Refund) -> SafeString:
    rows = format_html_join(
        "", "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
        ((timezone.localtime(h.history_date).strftime("%Y-%m-%d %H:%M:%S"), h.status,
          h.history_user.get_username() if h.history_user else "system / agent",
          h.history_change_reason or "") for h in
         refund.history.select_related("history_user").order_by("history_date", "history_id")))
    return format_html('<table class="checks-table"><thead><tr><th>When</th><th>State</th><th>By</th>'
                       '<th>Why</th></tr></thead><tbody>{}</tbody></table>', rows)


def _requester(refund: Refund) -> str:
    if refund.agent_id:
        return f"agent {refund.agent.name}"
    if refund.requested_by_id:
        return f"staff {refund.requested_by.get_username()}"
    return refund.get_origin_display()


def _authority_note(refund: Refund, user, authorities: dict[str, int]) -> str:
    """What the approver may do with this refund. The service checks again when they act."""
    if refund.agent_id is None and refund.requested_by_id == user.pk:
        return "your own request: someone else decides"
    limit = authorities.get(refund.currency)
    if limit is None:
        return f"no authority in {refund.currency}"
    if refund.amount_minor > limit:
        return f"above your authority of {format_minor(limit, refund.currency)}"
    return "within your authority"


@admin.register(Refund)
class RefundAdmin(RowLinks, ReadOnlyHistoryAdmin):
    ordering = ["-created_at"]
    list_display = ["id", "amount", "status", "reason", "origin", "requester", "hold_reasons", "payment_link",
                    "customer", "verdict_link", "created_at"]
    # Currencies in use, not all forty the platform accepts.
    list_filter = ["status", "origin", "reason", ("agent", admin.RelatedOnlyFieldListFilter),
                   ("currency", admin.AllValuesFieldListFilter), "payment__processor"]
    search_fields = ["id", "payment__id", "idempotency_key", "agent_session_id", "processor_refund_id",
                     "payment__customer__email"]
    list_select_related = ["payment__customer", "agent", "requested_by"]
    date_hierarchy = "created_at"
    show_full_result_count = False
    actions = ["approve_selected", "reject_selected", "resubmit_selected"]
    fieldsets = [
        (None, {"fields": ["id", "payment", "amount", "status", "origin", "reason", "note", "created_at",
                           "updated_at"]}),
        ("Decision", {"fields": ["verdict", "hold_reasons", "failure_code", "failure_message"]}),
        ("Who asked", {"fields": ["agent", "key_prefix", "requested_by", "agent_session_id", "agent_model",
                                  "agent_reasoning", "conversation_context", "idempotency_key"]}),
        ("Gateway", {"fields": ["processor_refund_id", "submit_attempts", "submitted_at", "settled_at",
                                "estimated_arrival"]}),
        ("Verdict checks", {"fields": ["verdict_checks"]}),
        ("State history", {"fields": ["state_history"]}),
    ]

    # -- columns and fields ------------------------------------------------------------------------
    @admin.display(description="payment", ordering="payment_id")
    def payment_link(self, obj: Refund) -> str:
        return admin_link("admin:refundops_payment_change", obj.payment_id)

    @admin.display(description="customer")
    def customer(self, obj: Refund) -> str:
        return obj.payment.customer.name or obj.payment.customer.email


    @admin.display(description="requested by")
    def requester(self, obj: Refund) -> str:
        return _requester(obj)


    @admin.display(description="key")
    def key_prefix(self, obj: Refund) -> str:
        return f"{obj.agent_key.prefix}…" if obj.agent_key_id else "-"

    @admin.display(description="checks")
    def verdict_checks(self, obj: Refund) -> SafeString:
        return checks_table(obj.verdict.checks if obj.verdict_id else [], currency=obj.currency)

    @admin.display(description="who or what moved it, and why")
    def state_history(self, obj: Refund) -> SafeString:
        return _history_table(obj)

    # -- approving and rejecting ------------------------------------------------------------------
    def has_approve_permission(self, request) -> bool:
        return request.user.has_perm("refundops.approve_refund")

    def _decide(self, request, refund_ids, decide: Callable[..., Refund], verb: str, note: str = "") -> None:
        done = []
        for refund_id in refund_ids:
            try:
                refund = decide(refund_id=refund_id, approver=request.user, note=note)
            except ApiError as refused:
                messages.error(request, f"{refund_id}: {refused.message}")
            else:
                done.append(f"{refund.pk} ({refund.money})")
        if done:
            messages.success(request, f"{verb} {len(done)}: {', '.join(done)}.")

    @admin.action(description="Approve selected held refunds", permissions=["approve"])
    def approve_selected(self, request, queryset):
        self._decide(request, queryset.order_by("created_at").values_list("pk", flat=True), approve_refund,
                     "Approved")

    @admin.action(description="Reject selected held refunds", permissions=["approve"])
    def reject_selected(self, request, queryset):
        self._decide(request, queryset.order_by("created_at").values_list("pk", flat=True), reject_refund,
                     "Rejected", note="rejected from the refund list")

    @admin.action(description="Send selected failed refunds to the gateway again", permissions=["approve"])
    def resubmit_selected(self, request, queryset):
        self._decide(request, queryset.order_by("created_at").values_list("pk", flat=True), resubmit_refund,
                     "Sent again", note="resubmitted from the refund list")

    def get_urls(self):
        view = self.admin_site.admin_view
        return [
            path("held/", view(self.held_queue_view), name="refundops_refund_held"),
            path("dashboard/", view(self.dashboard_view), name="refundops_dashboard"),
            path("<path:object_id>/approve/", view(require_POST(self.approve_view)), name="refundops_refund_approve"),
            path("<path:object_id>/reject/", view(require_POST(self.reject_view)), name="refundops_refund_reject"),
            *super().get_urls(),
        ]

    def _decide_one(self, request, object_id: str, decide: Callable[..., Refund], verb: str) -> HttpResponse:
        if not self.has_approve_permission(request):
            raise PermissionDenied
        refund_id = unquote(object_id)
        self._decide(request, [refund_id], decide, verb, note=request.POST.get("note", "").strip()[:2000])
        return HttpResponseRedirect(_safe_next(request, reverse("admin:refundops_refund_change", args=[quote(refund_id)])))

    def approve_view(self, request, object_id: str) -> HttpResponse:
        return self._decide_one(request, object_id, approve_refund, "Approved")

    def reject_view(self, request, object_id: str) -> HttpResponse:
        return self._decide_one(request, object_id, reject_refund, "Rejected")

    def change_view(self, request, object_id, form_url="", extra_context=None):
        held = Refund.objects.filter(pk=unquote(object_id), status=RefundState.HELD).exists()
        extra = {"can_decide": held and self.has_approve_permission(request), **(extra_context or {})}
        return super().change_view(request, object_id, form_url, extra)

    def held_queue_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        held = list(Refund.objects.filter(status=RefundState.HELD)
                    .select_related("payment__customer", "agent", "requested_by").order_by("created_at"))
        authorities = dict(ApprovalAuthority.objects.filter(user=request.user, is_active=True)
                           .values_list("currency", "max_amount_minor"))
        expiry = timedelta(hours=settings.HELD_REFUND_EXPIRY_HOURS)
        rows = [{"refund": r, "amount": format_minor(r.amount_minor, r.currency), "requester": _requester(r),
                 "authority": _authority_note(r, request.user, authorities), "expires_at": r.created_at + expiry}
                for r in held]
        context = {
            **self.admin_site.each_context(request), "opts": self.opts, "title": "Held refunds",
            "rows": rows, "can_decide": self.has_approve_permission(request),
            "authorities": [format_minor(v, c) for c, v in sorted(authorities.items())],
            "expiry_hours": settings.HELD_REFUND_EXPIRY_HOURS,
        }
        return TemplateResponse(request, "admin/refundops/refund/held_queue.html", context)

    def dashboard_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        data = reports.dashboard()
        context = {**self.admin_site.each_context(request), "opts": self.opts, "title": "Finance dashboard",
                   "data": data, **dashboard_charts(data)}
        return TemplateResponse(request, "admin/refundops/dashboard.html", context)


def dashboard_charts(data: reports.Dashboard) -> dict:
    """Turn the report's numbers into inline SVG charts, one set per currency for money."""
    def money_fmt(currency: str) -> Callable[[int], str]:
        return lambda minor: format_minor(minor, currency)

    def exact_fmt(currency: str) -> Callable[[int], str]:
        return lambda minor: format_minor(minor, currency).removesuffix(f" {currency}")

    def axis_fmt(currency: str) -> Callable[[int], str]:
        """Compact axis ticks in major units (20k, 1.5M); exact figures are in the tooltips."""
        exponent = currency_exponent(currency)

        def fmt(minor: int) -> str:
            major = Decimal(minor).scaleb(-exponent)
            for size, suffix in ((10**9, "bn"), (10**6, "M"), (10**3, "k")):
                if major >= size:
                    return f"{(major / size).normalize():f}{suffix}"
            return f"{major.normalize():f}"
        return fmt

    def day_label(i: int, day) -> str:
        return f"{day:%d %b}" if i == 0 or day.day == 1 else str(day.day)

    span = f"{data.days[0]:%d %b} to {data.days[-1]:%d %b %Y}"
    daily = []
    for cur in data.per_currency:
        fmt = money_fmt(cur.currency)
        value_bars = [charts.Bar(day_label(i, d.day), d.amount_minor,
                                 f"{d.day:%a %d %b}: {fmt(d.amount_minor)} in {d.count} refunds")
                      for i, d in enumerate(cur.days)]
        count_bars = [charts.Bar(day_label(i, d.day), d.count, f"{d.day:%a %d %b}: {d.count} refunds, "
                                 f"{fmt(d.amount_minor)}") for i, d in enumerate(cur.days)]
        limit = cur.global_daily_limit_minor
        today = cur.days[-1].amount_minor
        daily.append({
            "currency": cur.currency,
            "today": fmt(today),
            "limit": fmt(limit) if limit else None,
            "share": f"{today * 100 / limit:.1f}%" if limit else None,
            "value": charts.column_chart(
                title=f"Refund value per day in {cur.currency}, against the global daily limit",
                description=f"Value of refunds that count against limits, per day, {span}."
                            + (f" The dashed line is the global daily limit of {fmt(limit)}." if limit else ""),
                bars=value_bars, x_label="day", y_label=f"refunded ({cur.currency})", fmt=fmt,
                tick_fmt=axis_fmt(cur.currency), value_fmt=exact_fmt(cur.currency), show_values=True,
                limit=limit, limit_label="global daily limit"),
            "count": charts.column_chart(
                title=f"Number of refunds per day in {cur.currency}",
                description=f"Refunds that count against limits, per day, {span}.",
                bars=count_bars, x_label="day", y_label="refunds", show_values=True),
        })
    outcome_labels = ["approved by a person", "rejected", "expired", "still waiting", "canceled"]
    held = charts.stacked_bar_chart(
        title="Held refunds by hold rule, and how they ended",
        description=f"Refunds held for a person since {data.days[0]:%d %b}, per rule that fired.",
        series=outcome_labels, x_label="held refunds",
        rows=[charts.StackedRow(rule, [outcomes[o] for o in reports.HOLD_OUTCOMES])
              for rule, outcomes in data.held_by_rule.items()])
    people = charts.stacked_bar_chart(
        title="Held refunds decided, per person",
        description=f"Approvals and rejections by each person since {data.days[0]:%d %b}.",
        series=["approved", "rejected"], x_label="decisions",
        rows=[charts.StackedRow(person, [d["approved"], d["rejected"]])
              for person, d in data.decisions_by_person.items()])
    duplicates = charts.column_chart(
        title="Duplicate attempts blocked by idempotency, per day",
        description="Requests that repeated an idempotency key and were answered with the first answer "
                    "instead of acting twice. Many suggest timeouts or a looping agent.",
        bars=[charts.Bar(day_label(i, d), data.duplicates_by_day.get(d, 0),
                         f"{d:%a %d %b}: {data.duplicates_by_day.get(d, 0)} replays") for i, d in enumerate(data.days)],
        x_label="day", y_label="replays", show_values=True)
    duplicate_callers = charts.bar_chart(
        title="Duplicate attempts by caller", description="Which agents (or staff) repeated keys most.",
        x_label="replays", bars=[charts.Bar(caller, n, f"{caller}: {n} replays")
                                 for caller, n in data.duplicates_by_agent.items()])
    reasons = []
    for currency, totals in sorted(data.reasons.items()):
        fmt = money_fmt(currency)
        reasons.append(charts.bar_chart(
            title=f"Refunds by reason code in {currency}",
            description=f"Value of refunds per reason since {data.days[0]:%d %b}; the count is in brackets.",
            x_label=f"refunded ({currency})", fmt=fmt, tick_fmt=axis_fmt(currency),
            bars=[charts.Bar(f"{t.label} ({t.count})", t.amount_minor,
                             f"{t.label}: {t.count} refunds, {fmt(t.amount_minor)}") for t in totals]))
    paid_twice = [{"payment": p, "captured": format_minor(p.amount_captured_minor, p.currency),
                   "refunded": format_minor(p.amount_refunded_minor, p.currency)} for p in data.paid_twice]
    return {"paid_twice_rows": paid_twice, "daily_charts": daily, "held_chart": held, "people_chart": people,
            "duplicates_chart": duplicates, "duplicate_callers_chart": duplicate_callers, "reason_charts": reasons}


admin.site.site_header = "RefundOps administration"
admin.site.site_title = "RefundOps"
admin.site.index_title = "Refunds, approvals and audit"


# -- agents, keys and the platform switches ---------------------------------------------------------

class AgentKeyInline(ReadOnlyInline, admin.TabularInline):
    model = AgentKey
    fields = ["prefix", "created_at", "last_used_at", "expires_at", "revoked_at"]
    readonly_fields = fields


class AgentCapabilitiesForm(forms.ModelForm):
    capabilities = forms.MultipleChoiceField(choices=Capability.choices, required=False,
                                             widget=forms.CheckboxSelectMultiple)

    class Meta:
        model = Agent
        fields = ["capabilities"]


@admin.register(Agent)
class AgentAdmin(HistoryAdmin):
    """Agents are created by ``manage.py create_agent`` (the key is shown once, there). Here an
    operator grants or revokes capabilities, each through the audited service."""

    form = AgentCapabilitiesForm
    ordering = ["name"]
    list_display = ["name", "id", "owner", "capability_list", "is_active", "live_keys", "created_at"]
    list_filter = ["is_active"]
    search_fields = ["name", "id", "owner"]
    fields = ["id", "name", "owner", "capabilities", "is_active", "created_at"]
    readonly_fields = ["id", "name", "owner", "is_active", "created_at"]
    inlines = [AgentKeyInline]

    def has_add_permission(self, request, obj=None) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False

    def save_model(self, request, obj, form, change):
        held = set(Agent.objects.values_list("capabilities", flat=True).get(pk=obj.pk))
        wanted = set(form.cleaned_data["capabilities"])
        for capability in sorted(wanted - held):
            agents.grant_capability(agent_name_or_id=obj.pk, capability=capability, actor=request.user)
        for capability in sorted(held - wanted):
            agents.revoke_capability(agent_name_or_id=obj.pk, capability=capability, actor=request.user)

    def get_queryset(self, request):
        live = Q(keys__revoked_at__isnull=True) & (Q(keys__expires_at__isnull=True)
                                                   | Q(keys__expires_at__gt=timezone.now()))
        return super().get_queryset(request).annotate(n_live_keys=Count("keys", filter=live))

    @admin.display(description="capabilities")
    def capability_list(self, obj: Agent) -> str:
        return ", ".join(obj.capabilities) or "none"

    @admin.display(description="live keys", ordering="n_live_keys")
    def live_keys(self, obj: Agent) -> int:
        return obj.n_live_keys


@admin.register(AgentKey)
class AgentKeyAdmin(ReadOnlyHistoryAdmin):
    """Keys by prefix only: the hash is never shown, the key itself was shown once at creation."""

    ordering = ["-created_at"]

    list_display = ["prefix", "agent", "created_at", "last_used_at", "expires_at", "revoked_at", "state"]
    list_filter = [("revoked_at", admin.EmptyFieldListFilter), ("agent", admin.RelatedOnlyFieldListFilter)]
    search_fields = ["prefix", "agent__name"]
    list_select_related = ["agent"]
    fields = ["prefix", "agent", "created_at", "last_used_at", "expires_at", "revoked_at", "state"]
    actions = ["revoke_selected"]

    @admin.display(description="state")
    def state(self, obj: AgentKey) -> str:
        if obj.revoked_at:
            return "revoked"
        if obj.expires_at and obj.expires_at <= timezone.now():
            return "expired"
        return "live"

    def has_revoke_permission(self, request) -> bool:
        return request.user.has_perm("refundops.change_agentkey")

    @admin.action(description="Revoke selected keys", permissions=["revoke"])
    def revoke_selected(self, request, queryset):
        prefixes = list(queryset.filter(revoked_at__isnull=True).values_list("prefix", flat=True))
        for prefix in prefixes:
            agents.revoke_key(prefix=prefix, actor=request.user)
        messages.success(request, f"Revoked {len(prefixes)} key(s): {', '.join(prefixes) or 'none were live'}.")


@admin.register(PlatformState)
class PlatformStateAdmin(ReadOnlyHistoryAdmin):
    """The switches that stop every agent at once. Only the actions below change them, through
    the same audited services as ``manage.py killswitch``."""

    list_display = ["__str__", "refunds_paused", "agents_disabled", "changed_by", "changed_at"]
    fields = ["refunds_paused", "agents_disabled", "changed_by", "changed_at"]
    actions = ["killswitch_on", "killswitch_off", "agents_off", "agents_on"]

    def changelist_view(self, request, extra_context=None):
        PlatformState.current()  # the one row exists, so the actions always have it to act on
        return super().changelist_view(request, extra_context)

    def has_switch_permission(self, request) -> bool:
        return request.user.has_perm("refundops.change_platformstate")

    def _report(self, request, state: PlatformState) -> None:
        messages.success(request, f"Now: {state}.")

    @admin.action(description="Kill switch ON: pause agent refunds", permissions=["switch"])
    def killswitch_on(self, request, queryset):
        self._report(request, agents.set_killswitch(on=True, actor=request.user))

    @admin.action(description="Kill switch off: resume agent refunds", permissions=["switch"])
    def killswitch_off(self, request, queryset):
        self._report(request, agents.set_killswitch(on=False, actor=request.user))

    @admin.action(description="Disable all agent access", permissions=["switch"])
    def agents_off(self, request, queryset):
        self._report(request, agents.set_agents_disabled(disabled=True, actor=request.user))

    @admin.action(description="Enable agent access", permissions=["switch"])
    def agents_on(self, request, queryset):
        self._report(request, agents.set_agents_disabled(disabled=False, actor=request.user))


@admin.register(IdempotencyRecord)
class IdempotencyRecordAdmin(ReadOnlyAdmin):
    ordering = ["-created_at"]
    list_display = ["key", "scope", "operation", "response_status", "created_at"]
    list_filter = ["operation", "response_status"]
    search_fields = ["key", "scope"]
    date_hierarchy = "created_at"
    show_full_result_count = False


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
class PaymentLinkTemplateAdmin(HistoryAdmin):
    ordering = ["name"]
    """Agents send links only from templates a person approved; an edited message needs approval
    again, so what a person approved is what customers receive."""

    form = PaymentLinkTemplateForm
    list_display = ["name", "active", "approved_by", "approved_at", "created_at"]
    list_filter = ["active"]
    search_fields = ["name", "message"]
    list_select_related = ["approved_by"]
    readonly_fields = ["approved_by", "approved_at"]
    actions = ["approve_selected"]

    def has_delete_permission(self, request, obj=None) -> bool:
        return False  # links sent from a template point at it; retire a template by deactivating it

    def save_model(self, request, obj, form, change):
        if "message" in form.changed_data:
            obj.approved_by, obj.approved_at = None, None
        super().save_model(request, obj, form, change)
        record_audit(actor=Caller.for_user(request.user).label,
                     action="link_template.changed" if change else "link_template.created",
                     subject_type="payment_link_template", subject_id=str(obj.pk),
                     data={"name": obj.name, "active": obj.active, "fields": form.changed_data})

    def has_approve_permission(self, request) -> bool:
        return request.user.has_perm("refundops.change_paymentlinktemplate")

    @admin.action(description="Approve selected templates", permissions=["approve"])
    def approve_selected(self, request, queryset):
        now = timezone.now()
        for template in queryset.filter(approved_at__isnull=True):
            template.approved_by, template.approved_at = request.user, now
            template._history_user, template._change_reason = request.user, "approved"
            template.save()
            record_audit(actor=Caller.for_user(request.user).label, action="link_template.approved",
                         subject_type="payment_link_template", subject_id=str(template.pk),
                         data={"name": template.name})
        messages.success(request, "Approved.")


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
              "submitted_at"]
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
    ordering = ["-created_at"]
    list_display = ["id", "dispute", "status", "drafted_by", "created_at", "submitted_by", "submitted_at"]
    list_filter = ["status"]
    search_fields = ["id", "dispute__id"]
    list_select_related = ["dispute", "drafted_by", "submitted_by"]


# -- merchant webhooks out --------------------------------------------------------------------------

@admin.register(MerchantEndpoint)
class MerchantEndpointAdmin(admin.ModelAdmin):
    """Where merchants hear of refund state changes. The signing secret is shown once, on creation."""

    list_display = ("id", "url", "active", "event_types", "description", "created_at")
    list_filter = ("active",)
    formfield_overrides = {models.URLField: {"assume_scheme": "https"}}  # a bare host means https
    fields = ("url", "active", "event_types", "description", "secret_hint")
    readonly_fields = ("secret_hint",)

    @admin.display(description="signing secret")
    def secret_hint(self, obj: MerchantEndpoint) -> str:
        return f"{obj.secret[:10]}…" if obj.pk else "generated when you save"

    def response_add(self, request, obj, post_url_continue=None):
        messages.warning(request, f"Signing secret for {obj.url} (shown once; verify RefundOps-Signature "
                                  f"with it): {obj.secret}")
        return super().response_add(request, obj, post_url_continue)


@admin.register(WebhookDelivery)
class WebhookDeliveryAdmin(ReadOnlyAdmin):
    list_display = ("created_at", "event_type", "endpoint", "status", "attempts", "response_code",
                    "delivered_at", "next_attempt_at")
    list_filter = ("status", "event_type")
    list_select_related = ("endpoint",)
    search_fields = ("event_id", "id")
    actions = ("redeliver_selected",)

    @admin.action(description="Redeliver the selected events")
    def redeliver_selected(self, request, queryset):
        actor = f"user:{request.user.get_username()}"
        for delivery_id in queryset.values_list("pk", flat=True):
            outbound.redeliver(delivery_id, actor=actor)
        messages.success(request, f"Queued {queryset.count()} deliveries again.")

    def has_change_permission(self, request, obj=None) -> bool:
        return request.user.has_perm("refundops.change_webhookdelivery")  # needed by the action only

    def get_actions(self, request):
        actions = super().get_actions(request)
        if not request.user.has_perm("refundops.change_webhookdelivery"):
            actions.pop("redeliver_selected", None)
        return actions


@admin.register(GatewayCustomer)
class GatewayCustomerAdmin(ReadOnlyAdmin):
    list_display = ("processor", "account", "reference", "customer")
    list_select_related = ("customer",)
    search_fields = ("reference", "customer__email")
