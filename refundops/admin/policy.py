"""Admin for finance's refund limits and fraud's hold rules.

Both are versioned: every verdict names the version it was decided under, so a version is never
edited or deleted. Saving a change to the current version proposes a new row (version + 1), written
when a second person with the same right approves it (``proposals``); older versions are shown
read-only. Finance holds ``change_refundlimits``, fraud ``change_holdrules``.
"""

from __future__ import annotations

from typing import Any

from django import forms
from django.contrib import admin
from django.db.models import Model, OuterRef, Subquery

from audit.admin import MoneyAsMoneyAdmin
from processors.money import format_minor
from proposals.admin import ProposeChangeMixin
from proposals.models import Proposal
from refundops.models import HoldRules, Reason, RefundLimits

AMOUNT_FIELDS = ("approval_threshold_minor", "customer_daily_amount_minor", "customer_30d_amount_minor",
                 "agent_hourly_amount_minor", "agent_daily_amount_minor", "session_amount_minor",
                 "global_daily_amount_minor")


class RefundLimitsForm(forms.ModelForm):
    allowed_reasons = forms.MultipleChoiceField(choices=Reason.choices, required=False,
                                                widget=forms.CheckboxSelectMultiple,
                                                help_text="Reasons an agent may use")

    class Meta:
        model = RefundLimits
        fields = "__all__"
        help_texts = {name: "Minor units of the currency (1999 = 19.99 USD, 1999 = 1,999 JPY)"
                      for name in AMOUNT_FIELDS}

    def clean_reason_thresholds(self) -> dict[str, int]:
        value = self.cleaned_data.get("reason_thresholds") or {}
        if not isinstance(value, dict):
            raise forms.ValidationError('Give a JSON object, e.g. {"fraudulent": 2000}.')
        for reason, threshold in value.items():
            if reason not in Reason.values:
                raise forms.ValidationError(f"{reason!r} is not a reason; reasons are {', '.join(Reason.values)}.")
            if type(threshold) is not int or threshold < 0:
                raise forms.ValidationError(f"The threshold for {reason} must be a whole number of minor "
                                            f"units, zero or more.")
        return value

    def clean(self) -> dict[str, Any]:
        data = super().clean()
        for name in AMOUNT_FIELDS:
            if data.get(name) is not None and data[name] < 0:
                self.add_error(name, "Must be zero or more.")
        return data


class VersionedAdmin(ProposeChangeMixin, MoneyAsMoneyAdmin, admin.ModelAdmin):
    """A change never updates a row: it proposes the next version of the series, written when a
    second person approves it."""

    series_fields: tuple[str, ...] = ()  # what names one series of versions, besides the model
    always_readonly = ("version", "created_by", "created_at")
    save_as = False

    def series(self, obj: Model):
        return type(obj).objects.filter(**{f: getattr(obj, f) for f in self.series_fields})

    def get_queryset(self, request):
        # The series' latest version beside each row: one query for the whole changelist.
        queryset = super().get_queryset(request)
        latest = (queryset.model.objects.filter(**{f: OuterRef(f) for f in self.series_fields})
                  .order_by("-version").values("version")[:1])
        return queryset.annotate(latest_version=Subquery(latest))

    def is_current(self, obj: Model) -> bool:
        latest = getattr(obj, "latest_version", None)
        if latest is None:
            return not self.series(obj).filter(version__gt=obj.version).exists()
        return obj.version >= latest

    @admin.display(boolean=True, description="current")
    def current(self, obj: Model) -> bool:
        return self.is_current(obj)

    def get_readonly_fields(self, request, obj=None):
        # The series a row belongs to is fixed once it exists.
        return self.always_readonly + (self.series_fields if obj is not None else ())

    def has_change_permission(self, request, obj=None) -> bool:
        return super().has_change_permission(request, obj) and (obj is None or self.is_current(obj))

    def has_delete_permission(self, request, obj=None) -> bool:
        return False

    def proposal_subject(self, obj: Model, change: bool) -> str:
        return getattr(obj, "currency", "")  # limits: one series per currency; hold rules: one series


@admin.register(RefundLimits)
class RefundLimitsAdmin(VersionedAdmin):
    form = RefundLimitsForm
    series_fields = ("currency",)
    proposal_kind = Proposal.Kind.REFUND_LIMITS
    list_display = ("__str__", "currency", "version", "current", "approval_threshold",
                    "customer_daily", "global_daily", "created_by", "created_at")
    list_filter = ("currency",)
    fieldsets = (
        (None, {"fields": ("currency", "version", "note", "created_by", "created_at")}),
        ("Per refund", {"fields": ("approval_threshold_minor", "reason_thresholds", "cumulative_window_hours",
                                   "allowed_reasons", "refund_window_days", "max_refunds_per_payment")}),
        ("Running totals", {"fields": ("customer_daily_count", "customer_daily_amount_minor",
                                       "customer_30d_count", "customer_30d_amount_minor",
                                       "agent_hourly_amount_minor", "agent_daily_amount_minor",
                                       "session_amount_minor", "global_daily_amount_minor")}),
    )

    @admin.display(description="approval threshold")
    def approval_threshold(self, obj: RefundLimits) -> str:
        return format_minor(obj.approval_threshold_minor, obj.currency)

    @admin.display(description="customer per day")
    def customer_daily(self, obj: RefundLimits) -> str:
        return f"{obj.customer_daily_count} / {format_minor(obj.customer_daily_amount_minor, obj.currency)}"

    @admin.display(description="global per day")
    def global_daily(self, obj: RefundLimits) -> str:
        return format_minor(obj.global_daily_amount_minor, obj.currency)


@admin.register(HoldRules)
class HoldRulesAdmin(VersionedAdmin):
    proposal_kind = Proposal.Kind.HOLD_RULES
    list_display = ("__str__", "version", "current", "hold_disputed", "hold_flagged",
                    "hold_recent_contact_change", "contact_change_days", "hold_customer_velocity",
                    "velocity_max_refunds", "velocity_window_hours", "created_by", "created_at")
    fields = ("version", "note", "hold_disputed", "hold_flagged", "hold_recent_contact_change",
              "contact_change_days", "hold_customer_velocity", "velocity_max_refunds",
              "velocity_window_hours", "created_by", "created_at")
