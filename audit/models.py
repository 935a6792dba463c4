"""What auditors read: one verdict per agent call, and a hash-chained append-only log."""

from __future__ import annotations

import hashlib
import json

from django.db import models

from audit.ids import new_id


def new_verdict_id() -> str:
    return new_id("vd")


class Verdict(models.Model):
    """The recorded decision on one call: every check with its inputs and result, the running
    totals it saw, the policy version, the outcome. Refusals are recorded too."""

    class Outcome(models.TextChoices):
        APPROVED = "approved", "Approved"
        HELD = "held", "Held for a person"
        DENIED = "denied", "Denied"

    id = models.CharField(primary_key=True, max_length=40, default=new_verdict_id, editable=False)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    operation = models.CharField(max_length=40)  # refund.create, refund.check, payment.void, …
    dry_run = models.BooleanField(default=False)
    deduplicated = models.BooleanField(default=False, help_text="A replay of an idempotency key's first answer")
    outcome = models.CharField(max_length=10, choices=Outcome.choices)
    code = models.CharField(max_length=40, blank=True, db_index=True)  # the contract code when refused
    message = models.TextField(blank=True)
    # Who asked, by id: an agent and its key, or a staff user.
    agent_id = models.CharField(max_length=40, blank=True, db_index=True)
    agent_name = models.CharField(max_length=100, blank=True)
    key_prefix = models.CharField(max_length=20, blank=True)
    staff_username = models.CharField(max_length=150, blank=True)
    idempotency_key = models.CharField(max_length=255, blank=True)
    payment_id = models.CharField(max_length=40, blank=True, db_index=True)
    refund_id = models.CharField(max_length=40, blank=True, db_index=True)
    amount_minor = models.BigIntegerField(null=True, blank=True)
    currency = models.CharField(max_length=3, blank=True)
    request = models.JSONField(default=dict, blank=True)  # the body as received, agent context included
    checks = models.JSONField(default=list, blank=True)  # [{name, result, code, inputs, limit, observed}]
    totals = models.JSONField(default=dict, blank=True)  # running totals seen when deciding
    hold_reasons = models.JSONField(default=list, blank=True)
    policy_version = models.CharField(max_length=40, blank=True)  # "limits v3 / rules v2"
    gateway_response = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["outcome", "created_at"])]

    def __str__(self) -> str:
        return f"{self.id} {self.operation} {self.outcome}{' ' + self.code if self.code else ''}"


class AuditEntry(models.Model):
    """Append-only; each entry's hash covers its content and the previous entry's hash, so an
    edited or deleted row breaks the chain (``manage.py verify_audit``)."""

    seq = models.BigIntegerField(unique=True)
    created_at = models.DateTimeField()
    actor = models.CharField(max_length=200)  # "agent:ag_… (key rk_1234…)", "user:alice", "system:worker"
    action = models.CharField(max_length=60, db_index=True)  # "refund.approved", "key.revoked", …
    subject_type = models.CharField(max_length=40)
    subject_id = models.CharField(max_length=60, db_index=True)
    data = models.JSONField(default=dict, blank=True)
    prev_hash = models.CharField(max_length=64)
    hash = models.CharField(max_length=64)

    class Meta:
        ordering = ["-seq"]
        verbose_name_plural = "audit entries"

    def __str__(self) -> str:
        return f"#{self.seq} {self.action} {self.subject_type}:{self.subject_id}"

    def compute_hash(self) -> str:
        body = json.dumps(
            {"seq": self.seq, "created_at": self.created_at.isoformat(), "actor": self.actor,
             "action": self.action, "subject_type": self.subject_type, "subject_id": self.subject_id,
             "data": self.data, "prev_hash": self.prev_hash},
            sort_keys=True, separators=(",", ":"), default=str)
        return hashlib.sha256(body.encode()).hexdigest()

    def save(self, *args, **kwargs):
        if self.pk is not None:
            raise ValueError("audit entries are append-only")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise ValueError("audit entries are append-only")
