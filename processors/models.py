"""State the built-in sandbox gateway keeps of its own, as a real gateway would on its side."""

from __future__ import annotations

from django.db import models

from processors.money import CURRENCY_CHOICES


class SandboxControl(models.Model):
    """One row: how the sandbox behaves now. Operators flip it in the admin to rehearse outages."""

    class Mode(models.TextChoices):
        UP = "up", "Up: answers normally"
        DOWN = "down", "Down: every call fails as unreachable"
        DECLINE = "decline", "Declines every refund"

    mode = models.CharField(max_length=10, choices=Mode.choices, default=Mode.UP)
    settle_delay_seconds = models.PositiveIntegerField(
        default=5, help_text="Seconds before a sandbox refund reports success.")
    updated_at = models.DateTimeField(auto_now=True)

    class Meta:
        verbose_name = "sandbox gateway control"

    def __str__(self) -> str:
        return f"sandbox: {self.mode}, settles after {self.settle_delay_seconds}s"

    @classmethod
    def current(cls) -> SandboxControl:
        control, _ = cls.objects.get_or_create(pk=1)
        return control


class SandboxCharge(models.Model):
    reference = models.CharField(max_length=64, unique=True)  # sbch_…
    currency = models.CharField(max_length=3, choices=CURRENCY_CHOICES)
    authorized_minor = models.BigIntegerField()
    captured_minor = models.BigIntegerField(default=0)
    refunded_minor = models.BigIntegerField(default=0)
    voided = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [
            models.CheckConstraint(condition=models.Q(refunded_minor__lte=models.F("captured_minor")),
                                   name="sandbox_refunded_within_captured"),
        ]

    def __str__(self) -> str:
        return self.reference


class SandboxRefund(models.Model):
    reference = models.CharField(max_length=64, unique=True)  # sbre_…
    charge = models.ForeignKey(SandboxCharge, on_delete=models.PROTECT, related_name="refunds")
    amount_minor = models.BigIntegerField()
    currency = models.CharField(max_length=3, choices=CURRENCY_CHOICES)
    idempotency_key = models.CharField(max_length=255, unique=True)
    metadata = models.JSONField(default=dict)
    status = models.CharField(max_length=12, default="pending")  # pending, succeeded, failed
    settles_at = models.DateTimeField()
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self) -> str:
        return self.reference


class InboundEvent(models.Model):
    """One webhook delivery as received, verified or not. A verified event's id is unique per
    gateway, so a redelivery finds the first row; an unverified one is only a record (its id is
    the sender's claim, and must not stop the genuine event with that id from being applied)."""

    processor = models.CharField(max_length=20)
    account = models.CharField(max_length=40, blank=True)  # the configured account that verified it
    event_id = models.CharField(max_length=255, blank=True)
    type = models.CharField(max_length=100, blank=True)
    object_id = models.CharField(max_length=255, blank=True)
    verified = models.BooleanField(default=False)
    verification_error = models.TextField(blank=True)  # why the signature check failed
    headers = models.JSONField(default=dict, blank=True)
    # The bytes as received, for the record: whole when verified (the gateway signed them), a
    # prefix of UNVERIFIED_PAYLOAD_PREFIX bytes when not (anyone can send them); with the size and
    # SHA-256 of all of them either way.
    payload = models.TextField(blank=True)
    payload_bytes = models.PositiveIntegerField(default=0)
    payload_sha256 = models.CharField(max_length=64, blank=True)
    received_at = models.DateTimeField(auto_now_add=True, db_index=True)
    deliveries = models.PositiveIntegerField(default=1)  # how often the gateway sent it
    applied_at = models.DateTimeField(null=True, blank=True)
    outcome = models.TextField(blank=True)  # what applying it did, in words
    error = models.TextField(blank=True)  # why applying it has not succeeded yet

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["processor", "event_id"], condition=models.Q(verified=True),
                                    name="inbound_event_once_per_gateway"),
        ]
        indexes = [models.Index(fields=["processor", "object_id"])]

    def __str__(self) -> str:
        return f"{self.processor} {self.event_id or '?'} {self.type or '?'}"
