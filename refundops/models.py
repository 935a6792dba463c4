"""The core domain: customers, payments, refunds and their state machine, agents and their keys,
and the versioned bounds that finance (limits) and fraud (hold rules) own."""

from __future__ import annotations

from django.conf import settings
from django.db import models
from django.db.models import Q
from django.db.models.signals import post_save
from django.dispatch import receiver
from django_fsm import ConcurrentTransitionMixin, FSMField, transition
from django_fsm.signals import post_transition
from simple_history.models import HistoricalRecords

from audit.ids import new_id
from processors.money import CURRENCY_CHOICES, Money


def new_customer_id() -> str:
    return new_id("cus")


def new_payment_id() -> str:
    return new_id("txn")


def new_refund_id() -> str:
    return new_id("rf")


def new_agent_id() -> str:
    return new_id("ag")


class Reason(models.TextChoices):
    CUSTOMER_REQUEST = "customer_request", "Customer request"
    DUPLICATE = "duplicate", "Duplicate charge"
    FRAUDULENT = "fraudulent", "Fraudulent"
    PRODUCT_ISSUE = "product_issue", "Product issue"


class Customer(models.Model):
    id = models.CharField(primary_key=True, max_length=40, default=new_customer_id, editable=False)
    name = models.CharField(max_length=200, blank=True)
    email = models.EmailField()
    email_changed_at = models.DateTimeField(null=True, blank=True)
    address = models.TextField(blank=True)
    address_changed_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    history = HistoricalRecords()

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
        return self.dispute_status == self.Dispute.OPEN

    @property
    def method_display(self) -> str:
        brand = self.method_brand.title() if self.method_brand else self.method_type.replace("_", " ")
        return f"{brand} ending {self.method_last4}" if self.method_last4 else brand


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
    submit_attempts = models.PositiveIntegerField(default=0)
    # Set before the first gateway call of an attempt: from then on the money may have left, so
    # only the gateway's answer (never a guess of ours) may end this refund.
    gateway_called_at = models.DateTimeField(null=True, blank=True)
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    updated_at = models.DateTimeField(auto_now=True)
    submitted_at = models.DateTimeField(null=True, blank=True)
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
        indexes = [models.Index(fields=["status", "created_at"])]
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
    def resubmit(self) -> None:
        self.failure_code, self.failure_message, self.processor_refund_id = "", "", ""
        self.gateway_called_at = None
        self.submit_attempts += 1  # a new gateway idempotency key: this is a new attempt on purpose

    @transition(field=status, source=[RefundState.REQUESTED, RefundState.HELD, RefundState.APPROVED,
                                      RefundState.SUBMITTED], target=RefundState.CANCELED)
    def cancel(self, *, message: str = "") -> None:
        self.failure_code, self.failure_message = "CANCELED", message


class Capability(models.TextChoices):
    PAYMENTS_READ = "payments.read", "Look up payments"
    DISPUTES_DRAFT = "disputes.draft", "Draft dispute evidence"
    PAYMENT_LINKS_SEND = "payment_links.send", "Send payment links from templates"
    AUTHORIZATIONS_VOID = "authorizations.void", "Void uncaptured authorisations"
    PAYMENTS_CAPTURE = "payments.capture", "Capture up to the order amount"
    REFUNDS_CREATE = "refunds.create", "Refund to the original method within limits"


class Agent(models.Model):
    """A named caller with restricted keys and a set of capabilities from the contract."""

    id = models.CharField(primary_key=True, max_length=40, default=new_agent_id, editable=False)
    name = models.CharField(max_length=100, unique=True)
    owner = models.CharField(max_length=200, blank=True, help_text="Team or person responsible")
    capabilities = models.JSONField(default=list, blank=True)
    is_active = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)
    history = HistoricalRecords()

    def __str__(self) -> str:
        return self.name

    def has_capability(self, capability: str) -> bool:
        return capability in self.capabilities


class AgentKey(models.Model):
    """A restricted key (``rk_…``). Only its SHA-256 is stored; the key is shown once."""

    agent = models.ForeignKey(Agent, on_delete=models.CASCADE, related_name="keys")
    prefix = models.CharField(max_length=16, unique=True)  # "rk_" and 8 more characters, shown to people
    key_hash = models.CharField(max_length=64)
    created_at = models.DateTimeField(auto_now_add=True)
    expires_at = models.DateTimeField(null=True, blank=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)
    history = HistoricalRecords(excluded_fields=["last_used_at"])

    def __str__(self) -> str:
        return f"{self.prefix}… ({self.agent.name})"


class PlatformState(models.Model):
    """One row: the switches that stop every agent at once. Its row lock also serialises the
    global running totals, so racing agents can never pass a global limit together."""

    refunds_paused = models.BooleanField(default=False, help_text="Kill switch: pause agent refunds")
    agents_disabled = models.BooleanField(default=False, help_text="Revoke all agent access")
    changed_by = models.CharField(max_length=150, blank=True)
    changed_at = models.DateTimeField(auto_now=True)
    history = HistoricalRecords()

    class Meta:
        verbose_name = "platform switches"
        verbose_name_plural = "platform switches"

    def __str__(self) -> str:
        return f"kill switch {'ON' if self.refunds_paused else 'off'}; agents {'disabled' if self.agents_disabled else 'enabled'}"

    @classmethod
    def current(cls) -> PlatformState:
        state, _ = cls.objects.get_or_create(pk=1)
        return state


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


class RefundLimits(models.Model):
    """Finance's bounds for one currency. Rows are never edited: a change writes a new version."""

    currency = models.CharField(max_length=3, choices=CURRENCY_CHOICES)
    version = models.PositiveIntegerField()
    approval_threshold_minor = models.BigIntegerField(
        help_text="Per refund: above this amount a person must approve")
    reason_thresholds = models.JSONField(
        default=dict, blank=True,
        help_text='Per-reason approval thresholds overriding the one above, e.g. {"fraudulent": 2000}')
    allowed_reasons = models.JSONField(default=list, help_text="Reasons an agent may use")
    refund_window_days = models.PositiveIntegerField(default=90)
    max_refunds_per_payment = models.PositiveIntegerField(default=5)
    customer_daily_count = models.PositiveIntegerField()
    customer_daily_amount_minor = models.BigIntegerField()
    customer_30d_count = models.PositiveIntegerField()
    customer_30d_amount_minor = models.BigIntegerField()
    agent_hourly_amount_minor = models.BigIntegerField()
    agent_daily_amount_minor = models.BigIntegerField()
    session_amount_minor = models.BigIntegerField(help_text="Per agent session (one conversation)")
    global_daily_amount_minor = models.BigIntegerField(help_text="Across all agents and people, per day")
    note = models.CharField(max_length=300, blank=True)
    created_by = models.CharField(max_length=150, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        verbose_name_plural = "refund limits"
        ordering = ["currency", "-version"]
        constraints = [models.UniqueConstraint(fields=["currency", "version"], name="limits_one_version")]

    def __str__(self) -> str:
        return f"{self.currency} limits v{self.version}"


class HoldRules(models.Model):
    """Fraud's rules that hold a refund for a person. Versioned like the limits."""

    version = models.PositiveIntegerField(unique=True)
    hold_disputed = models.BooleanField(default=True)
    hold_flagged = models.BooleanField(default=True)
    hold_recent_contact_change = models.BooleanField(default=True)
    contact_change_days = models.PositiveIntegerField(default=7)
    hold_customer_velocity = models.BooleanField(default=True)
    velocity_max_refunds = models.PositiveIntegerField(default=3, help_text="More than this many refunds…")
    velocity_window_hours = models.PositiveIntegerField(default=24, help_text="…within this many hours")
    note = models.CharField(max_length=300, blank=True)
    created_by = models.CharField(max_length=150, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        verbose_name_plural = "hold rules"
        ordering = ["-version"]

    def __str__(self) -> str:
        return f"hold rules v{self.version}"


# -- payment links, disputes, and the gateway writes agents may make besides refunds ----------------

def new_payment_link_id() -> str:
    return new_id("pl")


def new_dispute_id() -> str:
    return new_id("dp")


def new_evidence_draft_id() -> str:
    return new_id("de")


def new_payment_operation_id() -> str:
    return new_id("op")


def new_link_template_id() -> str:
    return new_id("tpl")


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

    id = models.CharField(primary_key=True, max_length=40, default=new_payment_operation_id, editable=False)
    payment = models.ForeignKey(Payment, on_delete=models.PROTECT, related_name="operations")
    kind = models.CharField(max_length=10, choices=Kind.choices)
    amount_minor = models.BigIntegerField(null=True, blank=True)  # captures only
    currency = models.CharField(max_length=3, choices=CURRENCY_CHOICES)
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.PENDING)
    agent = models.ForeignKey(Agent, null=True, blank=True, on_delete=models.PROTECT, related_name="+")
    verdict = models.ForeignKey("audit.Verdict", on_delete=models.PROTECT, related_name="+")
    gateway_reference = models.CharField(max_length=100, blank=True)
    failure_code = models.CharField(max_length=60, blank=True)
    failure_message = models.TextField(blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    history = HistoricalRecords()

    class Meta:
        constraints = [
            # A void and a capture exclude each other, and neither happens twice.
            models.UniqueConstraint(fields=["payment"], condition=Q(status__in=["pending", "succeeded"]),
                                    name="payment_one_live_operation"),
            models.CheckConstraint(condition=Q(amount_minor__isnull=True) | Q(amount_minor__gt=0),
                                   name="payment_operation_amount_positive"),
        ]

    def __str__(self) -> str:
        return f"{self.id} {self.kind} {self.payment_id} {self.status}"


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
    """Evidence an agent drafted. Only a person submits it."""

    class Status(models.TextChoices):
        DRAFT = "draft", "Draft"
        SUBMITTED = "submitted", "Submitted by a person"

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
    history = HistoricalRecords()

    def __str__(self) -> str:
        return f"{self.id} for {self.dispute_id} ({self.status})"


# -- merchant webhooks out, and customers learned from a gateway -----------------------------------

def new_endpoint_id() -> str:
    return new_id("we")


def new_delivery_id() -> str:
    return new_id("whd")


def new_webhook_secret() -> str:
    return new_id("whsec")


class MerchantEndpoint(models.Model):
    """A merchant URL that receives signed refund events (``RefundOps-Signature``)."""

    id = models.CharField(primary_key=True, max_length=40, default=new_endpoint_id, editable=False)
    url = models.URLField(max_length=500)
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


# Every refund state change is announced to merchants (refundops.outbound). Transitions note
# their moves on the instance; the save that persists them queues the events in its transaction.
# Hooked here rather than in each service so no writer (services, approvals, admin) can forget.
@receiver(post_transition, sender=Refund)
def _note_refund_move(sender, instance: Refund, source: str, target: str, **kwargs) -> None:
    instance.__dict__.setdefault("_state_moves", []).append((source, target))


@receiver(post_save, sender=Refund)
def _announce_refund_moves(sender, instance: Refund, created: bool, raw: bool = False, **kwargs) -> None:
    if raw:  # loaddata: history, not news
        return
    from refundops.outbound import announce_refund_changes  # outbound imports this module

    announce_refund_changes(instance, created=created)
