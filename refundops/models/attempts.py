"""One call to a gateway that may move money, from before it is sent to the gateway's answer.

The row is written and committed before the call, so a worker that dies mid-call leaves a trace:
an attempt whose answer is not known. The money may have moved, so nothing else is decided about
its refund (no new call, no cancel, no failure) until the gateway has been asked what happened.
"""

from __future__ import annotations

from django.db import models
from django.db.models import Q

from audit.ids import new_id


def new_gateway_attempt_id() -> str:
    return new_id("ga")


class GatewayAttempt(models.Model):
    class Outcome(models.TextChoices):
        LIVE = "live", "Call in flight"          # a worker holds the lease and is calling
        SUCCEEDED = "succeeded", "Gateway accepted it"
        DECLINED = "declined", "Gateway refused it"
        UNKNOWN = "unknown", "Answer unknown"    # timeout, crash, lease run out: ask the gateway
        NOT_SENT = "not_sent", "Never sent"      # breaker open: the gateway was not called
        ABSENT = "absent", "Looked up: not at the gateway"

    id = models.CharField(primary_key=True, max_length=40, default=new_gateway_attempt_id, editable=False)
    refund = models.ForeignKey("Refund", on_delete=models.PROTECT, related_name="attempts")
    idempotency_key = models.CharField(max_length=255)
    worker = models.CharField(max_length=200, blank=True)  # who holds (or held) the lease
    outcome = models.CharField(max_length=10, choices=Outcome.choices, default=Outcome.LIVE)
    started_at = models.DateTimeField(auto_now_add=True)
    lease_until = models.DateTimeField()
    finished_at = models.DateTimeField(null=True, blank=True)
    processor_refund_id = models.CharField(max_length=100, blank=True)
    error_code = models.CharField(max_length=60, blank=True)
    error_message = models.TextField(blank=True)

    class Meta:
        ordering = ["started_at"]
        constraints = [
            # At most one call in flight per refund: two workers never ask the gateway at once.
            models.UniqueConstraint(fields=["refund"], condition=Q(outcome="live"),
                                    name="gateway_attempt_one_live_per_refund"),
        ]
        indexes = [models.Index(fields=["outcome", "lease_until"])]

    def __str__(self) -> str:
        return f"{self.id} {self.refund_id} {self.outcome}"

    @property
    def may_have_paid(self) -> bool:
        """Whether the money may have left through this attempt."""
        return self.outcome in (self.Outcome.LIVE, self.Outcome.SUCCEEDED, self.Outcome.UNKNOWN)
