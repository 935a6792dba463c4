"""Who may approve held refunds, and up to what amount, per currency."""

from __future__ import annotations

from django import forms
from django.contrib import admin

from approvals.models import ApprovalAuthority
from audit.admin import HistoryAdmin
from audit.services import record_audit
from processors.money import format_minor


class ApprovalAuthorityForm(forms.ModelForm):
    class Meta:
        model = ApprovalAuthority
        fields = ["user", "currency", "max_amount_minor", "is_active"]
        help_texts = {"max_amount_minor": "In minor units of the currency: 50000 is 500.00 USD, or 50,000 JPY."}


@admin.register(ApprovalAuthority)
class ApprovalAuthorityAdmin(HistoryAdmin):
    form = ApprovalAuthorityForm
    ordering = ["user__username", "currency"]
    list_display = ["user", "currency", "max_amount", "is_active", "created_at"]
    list_filter = [("currency", admin.AllValuesFieldListFilter), "is_active"]
    search_fields = ["user__username", "user__email"]
    list_select_related = ["user"]
    autocomplete_fields = ["user"]
    fields = ["user", "currency", "max_amount_minor", "is_active", "created_at"]
    readonly_fields = ["created_at"]

    @admin.display(description="up to", ordering="max_amount_minor")
    def max_amount(self, obj: ApprovalAuthority) -> str:
        return format_minor(obj.max_amount_minor, obj.currency)

    def has_delete_permission(self, request, obj=None) -> bool:
        return False  # deactivate instead, so the history keeps who could approve what, when


    def save_model(self, request, obj, form, change):
        super().save_model(request, obj, form, change)  # admin saves run in one transaction
        record_audit(actor=f"user:{request.user.get_username()}",
                     action="authority.changed" if change else "authority.granted",
                     subject_type="approval_authority", subject_id=str(obj.pk),
                     data={"user": obj.user.get_username(), "currency": obj.currency,
                           "max_amount_minor": obj.max_amount_minor, "is_active": obj.is_active,
                           "fields": form.changed_data})
