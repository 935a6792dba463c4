"""What auditors read: one verdict per agent call, and a keyed, hash-chained append-only log."""

from __future__ import annotations

import uuid

from django.db import models
from django.db.models.fields.json import KeyTransform

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
    # Refund decisions: what the policy read besides the totals (refundops.policy.policy_input), so
    # that a draft policy can be replayed on the request (refundops.services.backtest).
    policy_input = models.JSONField(default=dict, blank=True)
    # Drafts running in shadow beside the active policy: each one's decision on the same input, never
    # enforced: {draft_id: {"kind", "outcome", "code", "hold_reasons", "amount_minor", "agrees"}}.
    shadow = models.JSONField(default=dict, blank=True)
    gateway_response = models.JSONField(default=dict, blank=True)
    # The ``verdicts.chained`` audit entry that records this verdict (audit.chain.chain_verdicts):
    # every verdict is covered by the chain, also one no act's entry records (a dry run, a refusal
    # before any refund row, a replay). None for the seconds until the sealer runs.
    chained_by = models.UUIDField(null=True, blank=True, editable=False)

    # Written after the decision (the worker's gateway response, the sealer's mark), so left out of
    # the digest an audit entry keeps of the verdict; the entry recording the gateway response
    # carries it in its own data, and verify_audit checks the marks against the entries.
    UNSEALED_FIELDS = ("gateway_response", "chained_by")

    class Meta:
        ordering = ["-created_at"]
        indexes = [models.Index(fields=["outcome", "created_at"]),
                   models.Index(fields=["id"], condition=models.Q(chained_by__isnull=True),
                                name="audit_verdict_unchained")]

    def __str__(self) -> str:
        return f"{self.id} {self.operation} {self.outcome}{' ' + self.code if self.code else ''}"


class AuditEntry(models.Model):
    """One audited act. A request appends it with a keyed MAC over its content and the rows it
    records (``mac``), taking no lock; the sealer (``audit.chain``) later gives it its place in the
    chain (``seq``) and links it to the entry before (``prev_hash``, ``hash``). PostgreSQL refuses
    every other UPDATE, and every DELETE and TRUNCATE (migration 0002)."""

    uid = models.UUIDField(unique=True, default=uuid.uuid4, editable=False)  # under the MAC: no replayed copy
    seq = models.BigIntegerField(unique=True, null=True, blank=True)  # None until sealed
    created_at = models.DateTimeField()
    actor = models.CharField(max_length=200)  # "agent:ag_… (key rk_1234…)", "user:alice", "system:worker"
    action = models.CharField(max_length=60, db_index=True)  # "refund.approved", "key.revoked", …
    subject_type = models.CharField(max_length=40)
    subject_id = models.CharField(max_length=60, db_index=True)
    data = models.JSONField(default=dict, blank=True)
    # The verdicts and history rows this entry records: [{"model", "pk", "digest"}].
    records = models.JSONField(default=list, blank=True)
    mac = models.CharField(max_length=64)
    prev_hash = models.CharField(max_length=64, blank=True)
    hash = models.CharField(max_length=64, blank=True)
    sealed_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-id"]
        verbose_name_plural = "audit entries"
        indexes = [models.Index(fields=["id"], condition=models.Q(seq__isnull=True), name="audit_entry_unsealed"),
                   # The admin's search by payment or refund id, which an entry may name only in its data.
                   models.Index(KeyTransform("payment_id", "data"), name="audit_entry_data_payment"),
                   models.Index(KeyTransform("refund_id", "data"), name="audit_entry_data_refund"),
                   # The finance dashboard's decisions by person: people's entries, a few among millions.
                   models.Index(fields=["created_at"], condition=models.Q(actor__startswith="user:"),
                                name="audit_entry_people")]

    def __str__(self) -> str:
        place = f"#{self.seq}" if self.seq is not None else "(unsealed)"
        return f"{place} {self.action} {self.subject_type}:{self.subject_id}"

    def save(self, *args, **kwargs):
        if self.pk is not None:
            raise ValueError("audit entries are append-only")
        super().save(*args, **kwargs)

    def delete(self, *args, **kwargs):
        raise ValueError("audit entries are append-only")


def new_evidence_pack_id() -> str:
    return new_id("ep")


class EvidencePack(models.Model):
    """An auditor's request for the evidence pack of a period (audit.evidence), built by a Celery task
    that reports its progress here; the ZIP lands in ``VAR_DIR/evidence-packs``. Only people with
    ``build_evidencepack`` (the auditor role, superusers) reach these rows."""

    class Status(models.TextChoices):
        QUEUED = "queued", "Queued"
        BUILDING = "building", "Building"
        DONE = "done", "Done"
        FAILED = "failed", "Failed"

    id = models.CharField(primary_key=True, max_length=40, default=new_evidence_pack_id, editable=False)
    requested_by = models.CharField(max_length=150)  # a username: audit stands below auth's users
    requested_at = models.DateTimeField(auto_now_add=True)
    first_day = models.DateField()
    last_day = models.DateField()  # included
    merchant_id = models.CharField(max_length=40, blank=True)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.QUEUED)
    step = models.CharField(max_length=100, blank=True)  # the control being checked now
    steps_done = models.PositiveIntegerField(default=0)
    steps_total = models.PositiveIntegerField(default=0)
    size_bytes = models.BigIntegerField(null=True, blank=True)
    manifest_sha256 = models.CharField(max_length=64, blank=True)
    exception_count = models.PositiveIntegerField(null=True, blank=True)
    error = models.TextField(blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # The worker building it: its claim (a token) and its last sign of life, renewed at every step. A
    # lease, not a database lock: behind PgBouncer in transaction mode no lock outlives a statement.
    builder = models.CharField(max_length=40, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-requested_at"]
        permissions = [("build_evidencepack", "Can build and download auditors' evidence packs")]

    def __str__(self) -> str:
        return f"{self.id} {self.first_day}..{self.last_day} {self.status}"

    @property
    def percent(self) -> int:
        if self.status == self.Status.DONE:
            return 100
        return int(100 * self.steps_done / self.steps_total) if self.steps_total else 0
