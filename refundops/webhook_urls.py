"""Inbound gateway webhooks, mounted at ``webhooks/``: the gateways' view, wired to our services."""

from django.conf import settings
from django.urls import path

from processors.webhooks import GatewayWebhookView
from refundops.ratelimit import webhook_retry_after
from refundops.services.gateway_events import apply_event

view = {"apply_event": apply_event, "retry_after": webhook_retry_after}

urlpatterns = [
    route
    for gateway in ("stripe", "paypal", *(("sandbox",) if settings.SANDBOX_ENABLED else ()))
    for route in (
        path(f"{gateway}/", GatewayWebhookView.as_view(gateway=gateway, **view),
             name=f"webhook-{gateway}"),
        path(f"{gateway}/<str:account>/", GatewayWebhookView.as_view(gateway=gateway, **view),
             name=f"webhook-{gateway}-account"),
    )
]
