"""Merchant endpoints that receive our signed refund events, and each delivery to them."""

from __future__ import annotations

from django.db import models
from simple_history.models import HistoricalRecords

from audit.ids import new_id, new_secret
from refundops.models.merchants import DEFAULT_MERCHANT_ID


def new_endpoint_id() -> str:
    return new_id("we")


def new_delivery_id() -> str:
    return new_id("whd")


def new_webhook_secret() -> str:
    return new_secret("whsec")


class MerchantEndpoint(models.Model):
    """A merchant URL that receives signed refund events (``RefundOps-Signature``)."""

    id = models.CharField(primary_key=True, max_length=40, default=new_endpoint_id, editable=False)
    url = models.URLField(max_length=500)
    merchant = models.ForeignKey("refundops.Merchant", on_delete=models.PROTECT, default=DEFAULT_MERCHANT_ID,
                                 related_name="endpoints")
    secret = models.CharField(max_length=100, default=new_webhook_secret,
                              help_text="Shared secret the merchant verifies signatures with")
    active = models.BooleanField(default=True)
    event_types = models.JSONField(default=list, blank=True,
                                   help_text='e.g. ["refund.settled", "refund.failed"]; empty: every event')
    description = models.CharField(max_length=200, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    history = HistoricalRecords(excluded_fields=["secret"])

    def __str__(self) -> str:
        return f"{self.url}{'' if self.active else ' (inactive)'}"

    def wants(self, event_type: str) -> bool:
        return not self.event_types or event_type in self.event_types


class WebhookDelivery(models.Model):
    """One event for one endpoint, and every attempt to deliver it. Written in the same
    transaction as the refund change it reports, so no change goes unannounced."""

    class Status(models.TextChoices):
        PENDING = "pending", "Pending"
        DELIVERED = "delivered", "Delivered"
        FAILED = "failed", "Gave up"

    id = models.CharField(primary_key=True, max_length=40, default=new_delivery_id, editable=False)
    endpoint = models.ForeignKey(MerchantEndpoint, on_delete=models.PROTECT, related_name="deliveries")
    event_id = models.CharField(max_length=40, db_index=True)  # evt_…, the same on every redelivery
    event_type = models.CharField(max_length=60)
    payload = models.JSONField()
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.PENDING)
    attempts = models.PositiveIntegerField(default=0)
    response_code = models.PositiveSmallIntegerField(null=True, blank=True)
    last_error = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    next_attempt_at = models.DateTimeField(null=True, blank=True)
    delivered_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        verbose_name_plural = "webhook deliveries"
        indexes = [models.Index(fields=["status", "next_attempt_at"])]

    def __str__(self) -> str:
        return f"{self.id} {self.event_type} → {self.endpoint_id} ({self.status})"
