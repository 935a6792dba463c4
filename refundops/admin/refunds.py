"""Finance's pages on refunds: the refund list and page, the held queue, the dashboard."""

from collections.abc import Callable
from datetime import timedelta
from decimal import Decimal

from django.conf import settings
from django.contrib import admin, messages
from django.contrib.admin.utils import quote, unquote
from django.core.exceptions import PermissionDenied
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString
from django.views.decorators.http import require_POST

from approvals.models import ApprovalAuthority
from approvals.services import approve_refund, reject_refund, resubmit_refund
from audit import charts
from audit.admin import (
    EstimatedCountPaginator,
    ExactIdSearch,
    ReadOnlyHistoryAdmin,
    RecentValuesListFilter,
    admin_link,
    checks_table,
)
from processors.money import currency_exponent, format_minor
from refundops import reports
from refundops.errors import ApiError
from refundops.holds import hold_reason_sentences
from refundops.models import (
    GatewayAttempt,
    Refund,
    RefundState,
)
from refundops.admin.base import ReadOnlyInline, RowLinks, _safe_next


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


def _short_duration(span: timedelta) -> str:
    """"5 min", "3 h 12 min", "2 d 5 h": how long, on one short line (the exact times are in a title)."""
    minutes = max(int(span.total_seconds() // 60), 0)
    days, hours, minutes = minutes // 1440, minutes // 60 % 24, minutes % 60
    if days:
        return f"{days} d {hours} h" if hours else f"{days} d"
    if hours:
        return f"{hours} h {minutes} min" if minutes else f"{hours} h"
    return f"{minutes} min"


class GatewayAttemptInline(ReadOnlyInline, admin.TabularInline):
    """Each call to the gateway for this refund: who held it, how it ended, what the gateway said."""

    model = GatewayAttempt
    fields = readonly_fields = ["started_at", "outcome", "worker", "lease_until", "finished_at",
                                "processor_refund_id", "error_code", "error_message", "idempotency_key"]
    show_change_link = False
    verbose_name_plural = "gateway attempts"


class RefundStatusFilter(admin.SimpleListFilter):
    """By default the list shows refunds: requests a check denied never became one (they are in
    the verdicts, and here under "Denied by a check" or "Every request, denied too")."""

    title = "status"
    parameter_name = "status__exact"  # the admin's own name for it: links and exports keep working
    EVERY = "all"

    def lookups(self, request, model_admin):
        return [*RefundState.choices, (self.EVERY, "Every request, denied too")]

    def queryset(self, request, queryset):
        if self.value() is None:
            return queryset.exclude(status=RefundState.DENIED)
        if self.value() == self.EVERY:
            return queryset
        return queryset.filter(status=self.value())

    def choices(self, changelist):
        choices = super().choices(changelist)  # with the admin's counts when "Show counts" is on
        yield {**next(choices), "display": "Refunds (not denied requests)"}  # the admin's "All", renamed
        yield from choices


@admin.register(Refund)
class RefundAdmin(ExactIdSearch, RowLinks, ReadOnlyHistoryAdmin):
    inlines = [GatewayAttemptInline]
    ordering = ["-created_at"]
    # Narrow enough for a 1366 px laptop beside the filters: the origin is in the requester, the
    # customer under the payment, the verdict one click away on the refund's page.
    list_display = ["id", "amount", "status_and_reason", "requester", "held_because", "payment_and_customer",
                    "created_at"]
    # Currencies in use, not all forty the platform accepts; every agent (a short table), not the ones
    # a DISTINCT over every refund finds; dates as ranges, not a drill-down of DISTINCT years.
    list_filter = [RefundStatusFilter, "origin", "reason", ("agent", admin.RelatedFieldListFilter),
                   ("currency", RecentValuesListFilter), "payment__processor",
                   ("created_at", admin.DateFieldListFilter)]
    search_fields = ["id", "payment__id", "idempotency_key", "agent_session_id", "processor_refund_id",
                     "payment__customer__email"]
    list_select_related = ["payment__customer", "agent", "requested_by"]
    show_full_result_count = False
    paginator = EstimatedCountPaginator
    exact_search = {"rf": ("id",), "txn": ("payment_id",), "cus": ("payment__customer_id",), "vd": ("verdict_id",),
                    "@": ("payment__customer__email__iexact",)}
    actions = ["approve_selected", "reject_selected", "resubmit_selected"]
    fieldsets = [
        (None, {"fields": ["id", "payment", "amount", "status", "origin", "reason", "note", "created_at",
                           "updated_at"]}),
        ("Decision", {"fields": ["verdict", "held_because", "failure_code", "failure_message"]}),
        ("Who asked", {"fields": ["agent", "key_prefix", "requested_by", "agent_session_id", "agent_model",
                                  "agent_reasoning", "conversation_context", "idempotency_key"]}),
        ("Gateway", {"fields": ["processor_refund_id", "resubmissions", "submitted_at", "settled_at",
                                "estimated_arrival"]}),
        ("Verdict checks", {"fields": ["verdict_checks"]}),
        ("State history", {"fields": ["state_history"]}),
    ]

    # -- columns and fields ------------------------------------------------------------------------
    @admin.display(description="payment", ordering="payment_id")
    def payment_link(self, obj: Refund) -> str:
        return admin_link("admin:refundops_payment_change", obj.payment_id)

    @admin.display(description="payment, customer", ordering="payment_id")
    def payment_and_customer(self, obj: Refund) -> str:
        return format_html('<span class="long-id" title="{}">{}</span><br><small>{}</small>', obj.payment_id,
                           admin_link("admin:refundops_payment_change", obj.payment_id),
                           obj.payment.customer.name or obj.payment.customer.email)

    @admin.display(description="status, reason", ordering="status")
    def status_and_reason(self, obj: Refund) -> str:
        return format_html("{}<br><small>{}</small>", obj.get_status_display(), obj.get_reason_display())

    @admin.display(description="held because")
    def held_because(self, obj: Refund) -> str:
        sentences = hold_reason_sentences(obj.hold_reasons)
        if not sentences:
            return "-"
        return format_html('<ul class="hold-reasons">{}</ul>', format_html_join(
            "", '<li title="{}">{}</li>', zip(obj.hold_reasons, sentences)))

    @admin.display(description="sent again by a person")
    def resubmissions(self, obj: Refund) -> str:
        # submit_attempts moves only when a person resubmits a failed refund (a new gateway
        # idempotency key); each call to the gateway is a row under "gateway attempts".
        n = obj.submit_attempts
        return "never" if n == 0 else f"{n} time{'s' if n > 1 else ''}"


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
        # None when the refund is not held (or not there): one query, as the plain exists() was.
        reasons = (Refund.objects.filter(pk=unquote(object_id), status=RefundState.HELD)
                   .values_list("hold_reasons", flat=True).first())
        extra = {"can_decide": reasons is not None and self.has_approve_permission(request),
                 "hold_reason_sentences": hold_reason_sentences(reasons), **(extra_context or {})}
        return super().change_view(request, object_id, form_url, extra)

    def held_queue_view(self, request: HttpRequest) -> HttpResponse:
        if not self.has_view_permission(request):
            raise PermissionDenied
        # A page at a time, oldest first: the whole queue at once was a megabyte of HTML.
        page = Paginator(Refund.objects.filter(status=RefundState.HELD)
                         .select_related("payment__customer", "agent", "requested_by").order_by("created_at", "id"),
                         self.list_per_page).get_page(request.GET.get("p"))
        held = page.object_list
        authorities = dict(ApprovalAuthority.objects.filter(user=request.user, is_active=True)
                           .values_list("currency", "max_amount_minor"))
        expiry = timedelta(hours=settings.HELD_REFUND_EXPIRY_HOURS)
        now = timezone.now()
        rows = [{"refund": r, "amount": format_minor(r.amount_minor, r.currency), "requester": _requester(r),
                 "authority": _authority_note(r, request.user, authorities), "expires_at": r.counted_at + expiry,
                 "waited": _short_duration(now - r.created_at),
                 "expires_in": _short_duration(r.counted_at + expiry - now),
                 "hold_reasons": hold_reason_sentences(r.hold_reasons)}
                for r in held]
        context = {
            **self.admin_site.each_context(request), "opts": self.opts, "title": "Held refunds",
            "rows": rows, "page": page, "can_decide": self.has_approve_permission(request),
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
