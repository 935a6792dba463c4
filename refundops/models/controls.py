"""The bounds that finance (limits) and fraud (hold rules) own, and the platform's switches."""

from __future__ import annotations

from django.db import models
from simple_history.models import HistoricalRecords

from processors.money import CURRENCY_CHOICES


class PlatformState(models.Model):
    """One row: the switches that stop every agent at once. A switch waits for the refund decisions
    under way and every later one sees it (refundops.locks.lock_platform)."""

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


class RefundLimits(models.Model):
    """Finance's bounds for one currency. Rows are never edited: a change writes a new version."""

    currency = models.CharField(max_length=3, choices=CURRENCY_CHOICES)
    version = models.PositiveIntegerField()
    approval_threshold_minor = models.BigIntegerField(
        help_text="Per refund: above this amount a person must approve")
    reason_thresholds = models.JSONField(
        default=dict, blank=True,
        help_text='Per-reason approval thresholds overriding the one above, e.g. {"fraudulent": 2000}')
    cumulative_window_hours = models.PositiveIntegerField(
        default=24, help_text="The approval threshold also applies to what agents refunded to the same "
                              "customer within this many hours (and on the same payment, ever), plus the new amount")
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


def new_policy_draft_id() -> str:
    from audit.ids import new_id

    return new_id("pd")


class PolicyDraft(models.Model):
    """A version of refund limits (one currency) or hold rules that does not bind yet: finance or
    fraud backtest it on recorded requests, may run it in shadow beside the active version, then
    promote it (a proposal a second person approves: ``proposals``) or drop it."""

    class Kind(models.TextChoices):
        LIMITS = "limits", "Refund limits"
        RULES = "rules", "Hold rules"

    class Status(models.TextChoices):
        DRAFT = "draft", "Draft"
        PROPOSED = "proposed", "Proposed (waiting for a second person)"
        PROMOTED = "promoted", "Promoted (now a version)"
        DROPPED = "dropped", "Dropped"

    id = models.CharField(primary_key=True, max_length=40, default=new_policy_draft_id, editable=False)
    kind = models.CharField(max_length=10, choices=Kind.choices)
    currency = models.CharField(max_length=3, choices=CURRENCY_CHOICES, blank=True, help_text="Limits only")
    values = models.JSONField(help_text="The version's fields, as on a limits or hold-rules row")
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.DRAFT)
    shadow = models.BooleanField(default=False, help_text="Evaluated on every live request beside the active "
                                                          "version and recorded on the verdict; never enforced")
    proposal_id = models.CharField(max_length=40, blank=True, help_text="The proposal that promotes it")
    note = models.CharField(max_length=300, blank=True)
    created_by = models.CharField(max_length=150, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["-created_at"]
        constraints = [
            models.CheckConstraint(condition=models.Q(kind="rules", currency="") | ~models.Q(kind="rules")
                                   & ~models.Q(currency=""), name="policy_draft_currency_for_limits"),
            # One shadow per series: a verdict records one shadow decision.
            models.UniqueConstraint(fields=["kind", "currency"], condition=models.Q(shadow=True),
                                    name="policy_draft_one_shadow_per_series"),
        ]

    def __str__(self) -> str:
        series = f"{self.currency} limits" if self.kind == self.Kind.LIMITS else "hold rules"
        return f"draft {series} {self.pk}"

    def as_version(self) -> RefundLimits | HoldRules:
        """The draft as an unsaved version row, for the pure policy: each value as a saved row reads it
        back (a draft written before drafts.create_draft refused a float limit still replays as ints)."""
        model = RefundLimits if self.kind == self.Kind.LIMITS else HoldRules
        values = {k: model._meta.get_field(k).to_python(v) for k, v in self.values.items()}
        if self.kind == self.Kind.LIMITS:
            return RefundLimits(currency=self.currency, version=0, **values)
        return HoldRules(version=0, **values)



def new_backtest_run_id() -> str:
    from audit.ids import new_id

    return new_id("bt")


class BacktestRun(models.Model):
    """A backtest asked for in the admin, run by the worker (a year of requests takes longer than
    a request should): its progress, which the draft's page polls, then its result."""

    class Status(models.TextChoices):
        QUEUED = "queued", "Queued"
        RUNNING = "running", "Running"
        DONE = "done", "Done"
        FAILED = "failed", "Failed"

    id = models.CharField(primary_key=True, max_length=40, default=new_backtest_run_id, editable=False)
    draft = models.ForeignKey(PolicyDraft, on_delete=models.CASCADE, related_name="backtest_runs")
    days = models.PositiveIntegerField()
    status = models.CharField(max_length=10, choices=Status.choices, default=Status.QUEUED)
    replayed = models.PositiveIntegerField(default=0)  # requests replayed so far
    total = models.PositiveIntegerField(null=True, blank=True)  # requests to replay, once counted
    # Backtest.as_json(), its changes cut to the first ``BACKTEST_CHANGES_KEPT`` (``changed`` counts them all).
    result = models.JSONField(null=True, blank=True)
    error = models.TextField(blank=True)
    # When the worker last wrote progress: a running run silent for long has lost its worker.
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    requested_by = models.CharField(max_length=150, blank=True)
    created_at = models.DateTimeField(auto_now_add=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self) -> str:
        return f"backtest {self.pk} of {self.draft_id} over {self.days} days ({self.status})"
