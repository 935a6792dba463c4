"""Where a gateway's books and ours disagree about a payment: each difference stays open before a
person until they resolve it with a note. While one is open, the payment takes no agent refund
without a person (hold reason ``LEDGER_MISMATCH``)."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import Q

from audit.ids import new_id


def new_discrepancy_id() -> str:
    return new_id("ld")


class LedgerDiscrepancy(models.Model):
    class Kind(models.TextChoices):
        PAID_NOT_SETTLED = "paid_not_settled", "Paid at the gateway, not settled here"
        SETTLED_NOT_PAID = "settled_not_paid", "Settled here, not paid at the gateway"
        AMOUNT_MISMATCH = "amount_mismatch", "Amounts differ"
        UNKNOWN_REFUND = "unknown_refund", "A refund at the gateway we never made or recorded"
        CAPTURE_MISMATCH = "capture_mismatch", "The captured amount differs"
        # The gateway's book cannot list every refund, and one of ours may be there unseen.
        UNVERIFIABLE = "unverifiable", "Could not be checked: the gateway cannot list its refunds"
        SUBMITTED_OVERDUE = "submitted_overdue", "Submitted here past the gateway's settlement time"

    class Status(models.TextChoices):
        OPEN = "open", "Open"
        RESOLVED = "resolved", "Resolved by a person"

    id = models.CharField(primary_key=True, max_length=40, default=new_discrepancy_id, editable=False)
    payment = models.ForeignKey("Payment", on_delete=models.PROTECT, related_name="discrepancies")
    refund = models.ForeignKey("Refund", null=True, blank=True, on_delete=models.PROTECT,
                               related_name="discrepancies")
    kind = models.CharField(max_length=20, choices=Kind.choices)
    gateway = models.CharField(max_length=20)
    account = models.CharField(max_length=40, default="default")
    gateway_reference = models.CharField(max_length=100, blank=True)  # the gateway's refund or capture id
    ours = models.JSONField(default=dict, blank=True)  # what our ledger says
    theirs = models.JSONField(default=dict, blank=True)  # what the gateway says
    detail = models.TextField(blank=True)  # in words, for the person who resolves it
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.OPEN)
    detected_at = models.DateTimeField(auto_now_add=True)
    last_seen_at = models.DateTimeField(auto_now=True)
    resolved_at = models.DateTimeField(null=True, blank=True)
    resolved_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT,
                                    related_name="+")
    resolution_note = models.TextField(blank=True)

    class Meta:
        verbose_name = "ledger discrepancy"
        verbose_name_plural = "reconciliation"
        constraints = [
            # Found again and again by every run, it is one open difference until a person resolves it.
            models.UniqueConstraint(fields=["payment", "kind", "gateway_reference"], condition=Q(status="open"),
                                    name="discrepancy_open_once"),
        ]
        indexes = [models.Index(fields=["status", "detected_at"])]
        permissions = [("resolve_discrepancy", "Can resolve a ledger discrepancy, with a note")]

    def __str__(self) -> str:
        return f"{self.id} {self.kind} on {self.payment_id} ({self.status})"
