"""Who may approve held refunds, and up to what amount, per currency."""

from __future__ import annotations

from django import forms
from django.contrib import admin

from approvals.models import ApprovalAuthority
from audit.admin import HistoryAdmin
from processors.money import format_minor
from proposals.admin import ProposeChangeMixin
from proposals.models import Proposal


class ApprovalAuthorityForm(forms.ModelForm):
    class Meta:
        model = ApprovalAuthority
        fields = ["user", "currency", "max_amount_minor", "is_active"]
        help_texts = {"max_amount_minor": "In minor units of the currency: 50000 is 500.00 USD, or 50,000 JPY."}


@admin.register(ApprovalAuthority)
class ApprovalAuthorityAdmin(ProposeChangeMixin, HistoryAdmin):
    """A change is a proposal: it takes effect when a second person approves it, never the
    person whose authority it is."""

    proposal_kind = Proposal.Kind.APPROVAL_AUTHORITY
    form = ApprovalAuthorityForm
    ordering = ["user__username", "currency"]
    list_display = ["user", "currency", "max_amount", "is_active", "created_at"]
    list_filter = [("currency", admin.AllValuesFieldListFilter), "is_active"]
    search_fields = ["user__username", "user__email"]
    list_select_related = ["user"]
    autocomplete_fields = ["user"]
    fields = ["user", "currency", "max_amount_minor", "is_active", "created_at"]

    @admin.display(description="up to", ordering="max_amount_minor")
    def max_amount(self, obj: ApprovalAuthority) -> str:
        return format_minor(obj.max_amount_minor, obj.currency)

    def has_delete_permission(self, request, obj=None) -> bool:
        return False  # deactivate instead, so the history keeps who could approve what, when

    def get_readonly_fields(self, request, obj=None):
        return ["created_at", *(["user", "currency"] if obj is not None else [])]

    def proposal_subject(self, obj: ApprovalAuthority, change: bool) -> str:
        return f"{obj.user_id}:{obj.currency}"
