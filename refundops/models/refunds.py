"""Refunds and their state machine, and the idempotency record that makes one key one effect."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import F, Q
from django.utils import timezone
from django_fsm import ConcurrentTransitionMixin, FSMField, transition
from simple_history.models import HistoricalRecords

from audit.ids import new_id
from processors.money import CURRENCY_CHOICES, Money
from refundops.models.payments import Payment


def new_refund_id() -> str:
    return new_id("rf")


class Reason(models.TextChoices):
    CUSTOMER_REQUEST = "customer_request", "Customer request"
    DUPLICATE = "duplicate", "Duplicate charge"
    FRAUDULENT = "fraudulent", "Fraudulent"
    PRODUCT_ISSUE = "product_issue", "Product issue"


class RefundState(models.TextChoices):
    REQUESTED = "requested", "Requested"
    HELD = "held", "Held for approval"
    APPROVED = "approved", "Approved"
    SUBMITTED = "submitted", "Submitted to gateway"
    SETTLED = "settled", "Settled"
    DENIED = "denied", "Denied by a check"
    REJECTED = "rejected", "Rejected by a person"
    EXPIRED = "expired", "Expired while held"
    FAILED = "failed", "Failed at the gateway"
    CANCELED = "canceled", "Canceled"


# A refund in one of these states holds its amount against the payment and the running totals.
RESERVING_STATES = (RefundState.REQUESTED, RefundState.HELD, RefundState.APPROVED, RefundState.SUBMITTED)
COUNTING_STATES = (*RESERVING_STATES, RefundState.SETTLED)


class Refund(ConcurrentTransitionMixin, models.Model):
    """New money sent back to the payment's original method. Only the state machine moves it."""

    class Origin(models.TextChoices):
        AGENT = "agent", "Agent"
        STAFF = "staff", "Staff in the admin"
        EXTERNAL = "external", "Made on the gateway directly"

    id = models.CharField(primary_key=True, max_length=40, default=new_refund_id, editable=False)
    payment = models.ForeignKey(Payment, on_delete=models.PROTECT, related_name="refunds")
    amount_minor = models.BigIntegerField()
    currency = models.CharField(max_length=3, choices=CURRENCY_CHOICES)
    reason = models.CharField(max_length=20, choices=Reason.choices)
    note = models.TextField(blank=True)
    status = FSMField(default=RefundState.REQUESTED, choices=RefundState.choices, protected=True)
    origin = models.CharField(max_length=10, choices=Origin.choices, default=Origin.AGENT)
    agent = models.ForeignKey("Agent", null=True, blank=True, on_delete=models.PROTECT, related_name="refunds")
    agent_key = models.ForeignKey("AgentKey", null=True, blank=True, on_delete=models.PROTECT,
                                  related_name="refunds")
    requested_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                                     on_delete=models.PROTECT, related_name="+")
    agent_session_id = models.CharField(max_length=200, blank=True, db_index=True)
    agent_model = models.CharField(max_length=200, blank=True)
    agent_reasoning = models.TextField(blank=True)
    conversation_context = models.TextField(blank=True)
    idempotency_key = models.CharField(max_length=255, blank=True)
    verdict = models.ForeignKey("audit.Verdict", null=True, blank=True, on_delete=models.PROTECT,
                                related_name="refunds")
    hold_reasons = models.JSONField(default=list, blank=True)
    processor_refund_id = models.CharField(max_length=100, blank=True)
    estimated_arrival = models.DateField(null=True, blank=True)
    failure_code = models.CharField(max_length=60, blank=True)
    failure_message = models.TextField(blank=True)
    # Moves when a person resubmits a failed refund: a new gateway idempotency key. Each gateway
    # call itself is a GatewayAttempt (refundops.models.attempts).
    submit_attempts = models.PositiveIntegerField(default=0)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    # When the running totals count it: when it was asked for, or last resubmitted by a person
    # (a resubmission is a new ask today). External refunds: when the gateway made them.
    counted_at = models.DateTimeField(default=timezone.now, db_index=True)
    updated_at = models.DateTimeField(auto_now=True)
    submitted_at = models.DateTimeField(null=True, blank=True)
    # When the periodic sync last took it to ask its gateway (null: never): the sweep takes the
    # submitted refunds asked least recently first, so every one is reached in turn.
    synced_at = models.DateTimeField(null=True, blank=True)
    settled_at = models.DateTimeField(null=True, blank=True)
    history = HistoricalRecords()

    class Meta:
        constraints = [
            models.CheckConstraint(condition=Q(amount_minor__gt=0), name="refund_amount_positive"),
            # One gateway refund is ours at most once: a retry can never record a second one.
            models.UniqueConstraint(fields=["payment", "processor_refund_id"],
                                    condition=~Q(processor_refund_id=""),
                                    name="refund_unique_processor_refund"),
        ]
        indexes = [models.Index(fields=["status", "created_at"]),
                   # The admin's list sorted by amount (and -pk, which Django adds), read along it.
                   models.Index(fields=["amount_minor", "id"], name="refund_amount_order"),
                   models.Index(F("synced_at").asc(nulls_first=True), "submitted_at",
                                condition=Q(status="submitted"), name="refund_submitted_sync_order")]
        permissions = [("approve_refund", "Can approve or reject held refunds")]

    def __str__(self) -> str:
        return f"{self.id} {self.money} {self.status}"

    @property
    def money(self) -> Money:
        return Money(self.amount_minor, self.currency)

    # -- the state machine: transitions only change fields; services save them in atomic() ------
    @transition(field=status, source=RefundState.REQUESTED, target=RefundState.APPROVED)
    def approve_automatically(self) -> None:
        """Every check passed: no person needed."""

    @transition(field=status, source=RefundState.REQUESTED, target=RefundState.HELD)
    def hold(self, *, reasons: list[str]) -> None:
        self.hold_reasons = list(reasons)

    @transition(field=status, source=RefundState.REQUESTED, target=RefundState.DENIED)
    def deny(self, *, code: str, message: str) -> None:
        self.failure_code, self.failure_message = code, message

    @transition(field=status, source=RefundState.HELD, target=RefundState.APPROVED,
                permission="refundops.approve_refund")
    def approve(self) -> None:
        """A person with the authority said yes."""

    @transition(field=status, source=RefundState.HELD, target=RefundState.REJECTED,
                permission="refundops.approve_refund")
    def reject(self, *, message: str = "") -> None:
        self.failure_code, self.failure_message = "REJECTED", message

    @transition(field=status, source=RefundState.HELD, target=RefundState.EXPIRED)
    def expire(self) -> None:
        self.failure_code = "EXPIRED"

    @transition(field=status, source=RefundState.APPROVED, target=RefundState.SUBMITTED)
    def submit(self, *, processor_refund_id: str, at) -> None:
        self.processor_refund_id = processor_refund_id
        self.submitted_at = at

    @transition(field=status, source=RefundState.SUBMITTED, target=RefundState.SETTLED)
    def settle(self, *, at) -> None:
        self.settled_at = at

    @transition(field=status, source=[RefundState.APPROVED, RefundState.SUBMITTED, RefundState.SETTLED],
                target=RefundState.FAILED)
    def fail(self, *, code: str, message: str) -> None:
        """The gateway refused it, or failed it after reporting success."""
        self.failure_code, self.failure_message = code, message

    @transition(field=status, source=RefundState.FAILED, target=RefundState.APPROVED,
                permission="refundops.approve_refund")
    def resubmit(self, *, at) -> None:
        self._new_attempt(at)

    @transition(field=status, source=RefundState.FAILED, target=RefundState.HELD,
                permission="refundops.approve_refund")
    def resubmit_for_decision(self, *, at, reasons: list[str]) -> None:
        """Resubmitted, but the policy holds it now (a risk that arose since): a person decides."""
        self._new_attempt(at)
        self.hold_reasons = list(reasons)

    def _new_attempt(self, at) -> None:
        self.failure_code, self.failure_message, self.processor_refund_id = "", "", ""
        self.submit_attempts += 1  # a new gateway idempotency key: this is a new attempt on purpose
        self.counted_at = at  # counted in today's totals, as a new ask would be

    @transition(field=status, source=[RefundState.FAILED, RefundState.CANCELED], target=RefundState.SUBMITTED)
    def reinstate(self, *, processor_refund_id: str, at) -> None:
        """The gateway paid it after all (a late answer, a duplicate's decline taken for the answer):
        its money left, so it counts again. Only the gateway's word moves a refund this way."""
        self.failure_code, self.failure_message = "", ""
        self.processor_refund_id, self.submitted_at = processor_refund_id, at

    @transition(field=status, source=[RefundState.REQUESTED, RefundState.HELD, RefundState.APPROVED,
                                      RefundState.SUBMITTED], target=RefundState.CANCELED)
    def cancel(self, *, message: str = "") -> None:
        self.failure_code, self.failure_message = "CANCELED", message


class IdempotencyRecord(models.Model):
    """The first answer to one key. The unique constraint makes one key one effect under races."""

    scope = models.CharField(max_length=60)  # the agent's id (or "user:NAME"): keys are per caller
    key = models.CharField(max_length=255)
    operation = models.CharField(max_length=40)
    request_hash = models.CharField(max_length=64)
    response_status = models.PositiveSmallIntegerField()
    response_body = models.JSONField()
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        constraints = [models.UniqueConstraint(fields=["scope", "key"], name="idempotency_one_key_one_effect")]
        # The admin's list, newest first (and -pk, which Django adds), read along it.
        indexes = [models.Index(fields=["created_at", "id"], name="idempotency_created_order")]
