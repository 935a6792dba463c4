"""The sandbox gateway's controls (operators rehearse outages) and its own ledger, read-only."""

from __future__ import annotations

from django.contrib import admin

from audit.admin import ReadOnlyAdmin
from audit.services import record_audit
from processors import sandbox
from processors.models import InboundEvent, SandboxCharge, SandboxControl, SandboxRefund
from processors.money import format_minor


@admin.register(SandboxControl)
class SandboxControlAdmin(admin.ModelAdmin):
    list_display = ["__str__", "mode", "settle_delay_seconds", "updated_at"]
    fields = ["mode", "settle_delay_seconds", "updated_at"]
    readonly_fields = ["updated_at"]

    def changelist_view(self, request, extra_context=None):
        SandboxControl.current()  # one row, always there to edit
        return super().changelist_view(request, extra_context)

    def has_add_permission(self, request) -> bool:
        return False

    def has_delete_permission(self, request, obj=None) -> bool:
        return False

    def save_model(self, request, obj, form, change):
        control = sandbox.set_mode(obj.mode, settle_delay_seconds=obj.settle_delay_seconds)
        record_audit(actor=f"user:{request.user.get_username()}", action="sandbox.changed",
                     subject_type="sandbox_control", subject_id=str(control.pk),
                     data={"mode": control.mode, "settle_delay_seconds": control.settle_delay_seconds})


@admin.register(SandboxCharge)
class SandboxChargeAdmin(ReadOnlyAdmin):
    ordering = ["-created_at"]
    list_display = ["reference", "authorized", "captured", "refunded", "voided", "created_at"]
    list_filter = [("currency", admin.AllValuesFieldListFilter), "voided"]
    search_fields = ["reference"]

    @admin.display(description="authorised")
    def authorized(self, obj: SandboxCharge) -> str:
        return format_minor(obj.authorized_minor, obj.currency)

    @admin.display(description="captured")
    def captured(self, obj: SandboxCharge) -> str:
        return format_minor(obj.captured_minor, obj.currency)

    @admin.display(description="refunded")
    def refunded(self, obj: SandboxCharge) -> str:
        return format_minor(obj.refunded_minor, obj.currency)


@admin.register(SandboxRefund)
class SandboxRefundAdmin(ReadOnlyAdmin):
    ordering = ["-created_at"]
    list_display = ["reference", "charge", "amount", "status", "settles_at", "created_at"]
    list_filter = ["status", ("currency", admin.AllValuesFieldListFilter)]
    search_fields = ["reference", "charge__reference", "idempotency_key"]
    list_select_related = ["charge"]

    @admin.display(description="amount")
    def amount(self, obj: SandboxRefund) -> str:
        return format_minor(obj.amount_minor, obj.currency)


@admin.register(InboundEvent)
class InboundEventAdmin(ReadOnlyAdmin):
    """Every event a gateway sent, verified or not, and what applying it did."""

    list_display = ("received_at", "processor", "account", "type", "event_id", "verified", "deliveries",
                    "applied_at", "outcome_short")
    list_filter = ("verified", "processor", "type")
    search_fields = ("event_id", "object_id")
    date_hierarchy = "received_at"

    @admin.display(description="outcome")
    def outcome_short(self, obj: InboundEvent) -> str:
        text = obj.error or obj.verification_error or obj.outcome
        return text[:80] + ("…" if len(text) > 80 else "")
