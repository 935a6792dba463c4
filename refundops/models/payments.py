"""Customers, the payments they made through a gateway, and the voids and captures of them."""

from __future__ import annotations

from django.db import models
from django.db.models import Q
from django.db.models.functions import Upper

from simple_history.models import HistoricalRecords

from audit.ids import new_id
from refundops.models.merchants import DEFAULT_MERCHANT_ID
from processors.money import CURRENCY_CHOICES, Money


def new_customer_id() -> str:
    return new_id("cus")


def new_payment_id() -> str:
    return new_id("txn")


def new_payment_operation_id() -> str:
    return new_id("op")


class Customer(models.Model):
    id = models.CharField(primary_key=True, max_length=40, default=new_customer_id, editable=False)
    merchant = models.ForeignKey("refundops.Merchant", on_delete=models.PROTECT, default=DEFAULT_MERCHANT_ID,
                                 related_name="customers")
    name = models.CharField(max_length=200, blank=True)
    email = models.EmailField()
    email_changed_at = models.DateTimeField(null=True, blank=True)
    address = models.TextField(blank=True)
    address_changed_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    history = HistoricalRecords()

    class Meta:
        # The admin looks a customer's payments and refunds up by email, in any case (iexact).
        indexes = [models.Index(Upper("email"), name="customer_email_ci")]

    def __str__(self) -> str:
        return f"{self.name or self.email} ({self.id})"


class Payment(models.Model):
    """Money a customer paid through one gateway. Never card data: method type and last four."""

    class Processor(models.TextChoices):
        SANDBOX = "sandbox", "Sandbox"
        STRIPE = "stripe", "Stripe"
        PAYPAL = "paypal", "PayPal"

    class Status(models.TextChoices):
        AUTHORIZED = "authorized", "Authorised, not captured"
        CAPTURED = "captured", "Captured"
        VOIDED = "voided", "Voided"

    class Dispute(models.TextChoices):
        NONE = "none", "No dispute"
        OPEN = "open", "Open"
        WON = "won", "Won"
        LOST = "lost", "Lost"

    id = models.CharField(primary_key=True, max_length=40, default=new_payment_id, editable=False)
    customer = models.ForeignKey(Customer, on_delete=models.PROTECT, related_name="payments")
    merchant = models.ForeignKey("refundops.Merchant", on_delete=models.PROTECT, default=DEFAULT_MERCHANT_ID,
                                 related_name="payments")
    processor = models.CharField(max_length=20, choices=Processor.choices)
    processor_account = models.CharField(max_length=40, default="default")
    processor_reference = models.CharField(max_length=100)
    authorization_reference = models.CharField(max_length=100, blank=True)
    status = models.CharField(max_length=12, choices=Status.choices, default=Status.CAPTURED)
    currency = models.CharField(max_length=3, choices=CURRENCY_CHOICES)
    amount_authorized_minor = models.BigIntegerField()
    amount_captured_minor = models.BigIntegerField(default=0)
    # Kept by the refund services under the payment's row lock, from the refunds themselves:
    # settled back to the customer, and reserved by refunds still on their way.
    amount_refunded_minor = models.BigIntegerField(default=0)
    amount_reserved_minor = models.BigIntegerField(default=0)
    method_type = models.CharField(max_length=20, default="card")  # card, paypal, bank_transfer, wallet
    method_brand = models.CharField(max_length=20, blank=True)  # visa, mastercard, …
    method_last4 = models.CharField(max_length=4, blank=True)
    order_reference = models.CharField(max_length=100, blank=True)
    order_amount_minor = models.BigIntegerField(null=True, blank=True)  # the confirmed order amount
    amount_owed_minor = models.BigIntegerField(default=0)  # still owed on the order or invoice
    dispute_status = models.CharField(max_length=10, choices=Dispute.choices, default=Dispute.NONE)
    dispute_reference = models.CharField(max_length=100, blank=True)
    fraud_flags = models.JSONField(default=list, blank=True)  # ["velocity", "stolen_card", …]
    paid_twice = models.BooleanField(default=False, help_text="Refunded and also lost a dispute")
    captured_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    history = HistoricalRecords()

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["processor", "processor_account", "processor_reference"],
                                    name="payment_unique_gateway_reference"),
            models.CheckConstraint(condition=Q(amount_captured_minor__lte=models.F("amount_authorized_minor")),
                                   name="payment_captured_within_authorized"),
            # The invariant: refunds never exceed what was captured.
            models.CheckConstraint(
                condition=Q(amount_refunded_minor__gte=0) & Q(amount_reserved_minor__gte=0)
                & Q(amount_refunded_minor__lte=models.F("amount_captured_minor")
                    - models.F("amount_reserved_minor")),
                name="payment_refunds_within_captured"),
            models.CheckConstraint(condition=Q(method_last4="") | Q(method_last4__regex=r"^[0-9]{4}$"),
                                   name="payment_last4_is_four_digits"),
        ]
        # The admin's list, newest first (its ordering, and -pk Django adds): read along it, not sorted.
        indexes = [models.Index(fields=["created_at", "id"], name="payment_created_order"),
                   # The finance dashboard's few payments paid twice, or disputed, out of millions.
                   models.Index(fields=["created_at"], condition=Q(paid_twice=True), name="payment_paid_twice"),
                   models.Index(fields=["id"], condition=Q(dispute_status="open"), name="payment_dispute_open")]

    def __str__(self) -> str:
        return f"{self.id} {self.captured}"

    @property
    def captured(self) -> Money:
        return Money(self.amount_captured_minor, self.currency)

    @property
    def refundable_minor(self) -> int:
        return self.amount_captured_minor - self.amount_refunded_minor - self.amount_reserved_minor

    @property
    def is_disputed(self) -> bool:
        """Open (the money is at stake) or lost (a chargeback paid the customer back): either way a
        refund could pay them twice. Won is settled in the merchant's favour."""
        return self.dispute_status in (self.Dispute.OPEN, self.Dispute.LOST)

    @property
    def method_display(self) -> str:
        brand = self.method_brand.title() if self.method_brand else self.method_type.replace("_", " ")
        return f"{brand} ending {self.method_last4}" if self.method_last4 else brand


class GatewayCustomer(models.Model):
    """Which of our customers a gateway's customer is, so an import creates each one once."""

    processor = models.CharField(max_length=20)
    account = models.CharField(max_length=40, default="default")
    reference = models.CharField(max_length=100)  # e.g. Stripe cus_…
    customer = models.ForeignKey(Customer, on_delete=models.PROTECT, related_name="gateway_ids")

    class Meta:
        constraints = [models.UniqueConstraint(fields=["processor", "account", "reference"],
                                               name="gateway_customer_once")]

    def __str__(self) -> str:
        return f"{self.processor}:{self.reference} → {self.customer_id}"


class PaymentOperation(models.Model):
    """One void or capture of a payment, from the decision to the gateway's answer. Decided and
    committed before the gateway is called; at most one per payment is in flight or done."""

    class Kind(models.TextChoices):
        VOID = "void", "Void"
        CAPTURE = "capture", "Capture"

    class Status(models.TextChoices):
        PENDING = "pending", "Sent to the gateway"
        SUCCEEDED = "succeeded", "Done"
        FAILED = "failed", "Refused or not reached"
        # Sent, and the answer lost (a timeout after the gateway may have acted, a worker gone past
        # its lease): resolved only by looking the payment up at the gateway.
        UNKNOWN = "unknown", "Sent; answer unknown"

    id = models.CharField(primary_key=True, max_length=40, default=new_payment_operation_id, editable=False)
    payment = models.ForeignKey(Payment, on_delete=models.PROTECT, related_name="operations")
    kind = models.CharField(max_length=10, choices=Kind.choices)
    amount_minor = models.BigIntegerField(null=True, blank=True)  # captures only
    currency = models.CharField(max_length=3, choices=CURRENCY_CHOICES)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.PENDING)
    agent = models.ForeignKey("Agent", null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    verdict = models.ForeignKey("audit.Verdict", on_delete=models.PROTECT, related_name="+")
    gateway_reference = models.CharField(max_length=100, blank=True)
    failure_code = models.CharField(max_length=60, blank=True)
    failure_message = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    # The call is the decider's until then (longer than the gateway client's timeout); a pending
    # operation past it was left by a process that died mid-call, and is resolved by look-up.
    lease_until = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    history = HistoricalRecords()

    LIVE_STATUSES = ("pending", "succeeded", "unknown")  # the gateway did, is doing, or may have done it

    class Meta:
        constraints = [
            # A void and a capture exclude each other, and neither happens twice; one whose answer
            # is unknown may have happened, so it excludes the next until it is resolved.
            models.UniqueConstraint(fields=["payment"], condition=Q(status__in=["pending", "succeeded", "unknown"]),
                                    name="payment_one_live_operation"),
            models.CheckConstraint(condition=Q(amount_minor__isnull=True) | Q(amount_minor__gt=0),
                                   name="payment_operation_amount_positive"),
        ]

    def __str__(self) -> str:
        return f"{self.id} {self.kind} {self.payment_id} {self.status}"
