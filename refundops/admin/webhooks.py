"""Merchant endpoints and deliveries of our webhooks, and gateway customers learned from imports."""


from django.contrib import admin, messages
from django.db import models

from audit.admin import ReadOnlyAdmin
from proposals.admin import ProposeChangeMixin
from proposals.models import Proposal
from refundops import outbound
from refundops.models import (
    GatewayCustomer,
    MerchantEndpoint,
    WebhookDelivery,
)


# -- merchant webhooks out --------------------------------------------------------------------------

@admin.register(MerchantEndpoint)
class MerchantEndpointAdmin(ProposeChangeMixin, admin.ModelAdmin):
    """Where merchants hear of refund state changes. Adding or changing one is a proposal; the
    signing secret is shown once, to the person who approves a new endpoint."""

    proposal_kind = Proposal.Kind.MERCHANT_ENDPOINT
    list_display = ("id", "url", "active", "event_types", "description", "created_at")
    list_filter = ("active",)
    formfield_overrides = {models.URLField: {"assume_scheme": "https"}}  # a bare host means https
    fields = ("url", "active", "event_types", "description", "secret_hint")
    readonly_fields = ("secret_hint",)

    @admin.display(description="signing secret")
    def secret_hint(self, obj: MerchantEndpoint) -> str:
        return f"{obj.secret[:10]}…" if obj.pk else "generated when a second person approves it"

    def has_delete_permission(self, request, obj=None) -> bool:
        return False  # deactivate instead: deliveries point at it


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
        # Needed by the list's action only: a delivery itself is never edited.
        return obj is None and request.user.has_perm("refundops.change_webhookdelivery")

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
