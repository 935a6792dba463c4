"""A proposed change to a control, waiting for a second person."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import F, Q

from audit.ids import new_id


def new_proposal_id() -> str:
    return new_id("pp")


class Proposal(models.Model):
    class Kind(models.TextChoices):
        REFUND_LIMITS = "refund_limits", "Refund limits"
        HOLD_RULES = "hold_rules", "Hold rules"
        APPROVAL_AUTHORITY = "approval_authority", "Approval authority"
        LINK_TEMPLATE = "link_template", "Payment link template"
        AGENT_CAPABILITIES = "agent_capabilities", "Agent capabilities"
        MERCHANT_ENDPOINT = "merchant_endpoint", "Merchant endpoint"
        MERCHANT = "merchant", "Merchant settings"

    class Status(models.TextChoices):
        PENDING = "pending", "Waiting for a second person"
        APPROVED = "approved", "Approved and in effect"
        REJECTED = "rejected", "Rejected"

    id = models.CharField(primary_key=True, max_length=40, default=new_proposal_id, editable=False)
    kind = models.CharField(max_length=30, choices=Kind.choices)
    subject_id = models.CharField(max_length=100, blank=True, help_text="What it changes; empty for a new one")
    summary = models.CharField(max_length=200)
    changes = models.JSONField(help_text="The proposed values")
    diff = models.JSONField(help_text="{field: [before, after]} when it was proposed")
    note = models.CharField(max_length=500, blank=True)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.PENDING)
    proposed_by = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.PROTECT, related_name="+")
    proposed_at = models.DateTimeField(auto_now_add=True)
    decided_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT,
                                   related_name="+")
    decided_at = models.DateTimeField(null=True, blank=True)
    decision_note = models.CharField(max_length=500, blank=True)
    result_id = models.CharField(max_length=100, blank=True, help_text="The row the approved change wrote")

    class Meta:
        ordering = ["-proposed_at"]
        constraints = [
            # Four eyes, also for a writer who skips the service: nobody decides their own proposal.
            models.CheckConstraint(condition=~Q(decided_by=F("proposed_by")), name="proposal_decided_by_another"),
            models.CheckConstraint(condition=Q(status="pending") | Q(decided_by__isnull=False),
                                   name="proposal_decided_by_someone"),
        ]

    def __str__(self) -> str:
        return f"{self.get_kind_display()}: {self.summary} ({self.status})"
