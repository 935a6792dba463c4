"""Merchants: who owns payments, customers, agents and endpoints. An agent acts only within its
merchant; staff see every merchant. Rows made before merchants existed belong to the default one."""

from __future__ import annotations

from django.db import models
from simple_history.models import HistoricalRecords

from audit.ids import new_id

DEFAULT_MERCHANT_ID = "mer_default"


def new_merchant_id() -> str:
    return new_id("mer")


class Merchant(models.Model):
    """An account on one or more gateways, and the agents that work for it."""

    id = models.CharField(primary_key=True, max_length=40, default=new_merchant_id, editable=False)
    name = models.CharField(max_length=200, unique=True)
    require_session_id = models.BooleanField(
        default=False, help_text="Refunds by this merchant's agents must name agent.session_id; when not "
                                 "required, a refund without one counts as one session per key and hour.")
    created_at = models.DateTimeField(auto_now_add=True)
    history = HistoricalRecords()

    def __str__(self) -> str:
        return self.name


class AgentRead(models.Model):
    """An agent looked at a payment or a refund: who, with which key, when. One INSERT per read,
    no foreign keys (nothing to lock, nothing to check)."""

    agent_id = models.CharField(max_length=40)
    key_prefix = models.CharField(max_length=16)
    operation = models.CharField(max_length=40)  # "payment.lookup", "refund.get"
    payment_id = models.CharField(max_length=40, blank=True)
    refund_id = models.CharField(max_length=40, blank=True)
    read_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        indexes = [models.Index(fields=["payment_id", "read_at"]), models.Index(fields=["agent_id", "read_at"])]

    def __str__(self) -> str:
        return f"{self.agent_id} {self.operation} {self.payment_id or self.refund_id}"
