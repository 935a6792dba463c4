"""Payment links for amounts owed, and disputes with the evidence agents draft for them."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import Q
from simple_history.models import HistoricalRecords

from audit.ids import new_id, new_secret
from processors.money import CURRENCY_CHOICES, Money
from refundops.models.agents import Agent
from refundops.models.payments import Payment


def new_payment_link_id() -> str:
    # The sandbox's payment page (/pay/<id>) asks for nothing else: the id is the link's secret.
    return new_secret("pl")


def new_dispute_id() -> str:
    return new_id("dp")


def new_evidence_draft_id() -> str:
    return new_id("de")


def new_link_template_id() -> str:
    return new_id("tpl")


class PaymentLinkTemplate(models.Model):
    """A message a person approved for payment links. ``$amount``, ``$url``, ``$order_reference``
    and ``$customer_name`` are filled in when a link is sent."""

    id = models.CharField(primary_key=True, max_length=40, default=new_link_template_id, editable=False)
    name = models.CharField(max_length=100, unique=True)
    message = models.TextField()
    approved_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT,
                                    related_name="+")
    approved_at = models.DateTimeField(null=True, blank=True)
    active = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)
    history = HistoricalRecords()

    def __str__(self) -> str:
        return self.name

    @property
    def usable(self) -> bool:
        return self.active and self.approved_at is not None


class PaymentLink(models.Model):
    """A link asking a customer to pay an amount already owed on an order or invoice."""

    class Status(models.TextChoices):
        SENT = "sent", "Sent"
        PAID = "paid", "Paid"
        EXPIRED = "expired", "Expired"
        FAILED = "failed", "The gateway could not create it"

    id = models.CharField(primary_key=True, max_length=40, default=new_payment_link_id, editable=False)
    template = models.ForeignKey(PaymentLinkTemplate, on_delete=models.PROTECT, related_name="links")
    payment = models.ForeignKey(Payment, on_delete=models.PROTECT, related_name="payment_links")
    order_reference = models.CharField(max_length=100, blank=True)
    amount_minor = models.BigIntegerField()
    currency = models.CharField(max_length=3, choices=CURRENCY_CHOICES)
    url = models.CharField(max_length=500, blank=True)
    processor_link_id = models.CharField(max_length=100, blank=True)
    message = models.TextField(blank=True)  # the template as sent, with its blanks filled in
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.SENT)
    agent = models.ForeignKey(Agent, null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    verdict = models.ForeignKey("audit.Verdict", on_delete=models.PROTECT, related_name="+")
    sent_at = models.DateTimeField(auto_now_add=True)
    paid_at = models.DateTimeField(null=True, blank=True)
    history = HistoricalRecords()

    class Meta:
        constraints = [models.CheckConstraint(condition=Q(amount_minor__gt=0), name="payment_link_amount_positive")]

    def __str__(self) -> str:
        return f"{self.id} {Money(self.amount_minor, self.currency)} {self.status}"


class Dispute(models.Model):
    """A chargeback the customer's bank opened against a payment."""

    class Status(models.TextChoices):
        OPEN = "open", "Open"
        WON = "won", "Won"
        LOST = "lost", "Lost"

    id = models.CharField(primary_key=True, max_length=40, default=new_dispute_id, editable=False)
    payment = models.ForeignKey(Payment, on_delete=models.PROTECT, related_name="disputes")
    processor_dispute_id = models.CharField(max_length=100, blank=True)
    reason = models.CharField(max_length=60, blank=True)  # the gateway's reason, e.g. product_not_received
    amount_minor = models.BigIntegerField()
    currency = models.CharField(max_length=3, choices=CURRENCY_CHOICES)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.OPEN)
    evidence_due_by = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    history = HistoricalRecords()

    def __str__(self) -> str:
        return f"{self.id} {self.payment_id} {self.status}"


class DisputeEvidenceDraft(models.Model):
    """Evidence an agent drafted. Only a person submits it to the gateway."""

    class Status(models.TextChoices):
        DRAFT = "draft", "Draft"
        SUBMITTING = "submitting", "Being sent to the gateway"
        SUBMITTED = "submitted", "Submitted by a person"
        FAILED = "failed", "Refused by the gateway"  # a person may submit it again

    TEXT_FIELDS = ("summary", "customer_communication", "refund_policy", "shipping_documentation")

    id = models.CharField(primary_key=True, max_length=40, default=new_evidence_draft_id, editable=False)
    dispute = models.ForeignKey(Dispute, on_delete=models.PROTECT, related_name="evidence_drafts")
    summary = models.TextField(blank=True)
    customer_communication = models.TextField(blank=True)
    refund_policy = models.TextField(blank=True)
    shipping_documentation = models.TextField(blank=True)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.DRAFT)
    drafted_by = models.ForeignKey(Agent, null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    verdict = models.ForeignKey("audit.Verdict", on_delete=models.PROTECT, related_name="+")
    created_at = models.DateTimeField(auto_now_add=True)
    submitted_by = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.PROTECT,
                                     related_name="+")
    submitted_at = models.DateTimeField(null=True, blank=True)
    gateway_response = models.JSONField(default=dict, blank=True)  # the gateway's answer to the last submission
    # Final answers so far: the gateway idempotency key names the attempt, so a submission the
    # gateway never answered is sent again as the same request.
    submit_attempts = models.PositiveIntegerField(default=0)
    history = HistoricalRecords()

    def __str__(self) -> str:
        return f"{self.id} for {self.dispute_id} ({self.status})"
