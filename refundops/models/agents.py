"""Agents, the named callers with restricted keys and capabilities from the contract."""

from __future__ import annotations

from django.db import models
from simple_history.models import HistoricalRecords

from audit.ids import new_id
from refundops.models.merchants import DEFAULT_MERCHANT_ID


def new_agent_id() -> str:
    return new_id("ag")


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
    merchant = models.ForeignKey("refundops.Merchant", on_delete=models.PROTECT, default=DEFAULT_MERCHANT_ID,
                                 related_name="agents")
    owner = models.CharField(max_length=200, blank=True, help_text="Team or person responsible")
    capabilities = models.JSONField(default=list, blank=True)
    is_active = models.BooleanField(default=True)
    created_at = models.DateTimeField(auto_now_add=True)
    history = HistoricalRecords()

    class Meta:
        constraints = [
            # Ids start "ag_" (new_agent_id); a name that did could be taken for another agent's id.
            models.CheckConstraint(condition=~models.Q(name__istartswith="ag_"), name="agent_name_not_an_id",
                                   violation_error_message="An agent name cannot start with 'ag_': agent ids do."),
        ]

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
