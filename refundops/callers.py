"""Who is asking: an agent through one of its keys, or a staff user in the admin."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from refundops.models import Agent, AgentKey, AgentRead


@dataclass(frozen=True)
class Caller:
    agent: Agent | None = None
    key: AgentKey | None = None
    user: Any = None  # a staff django.contrib.auth User

    @classmethod
    def for_key(cls, key: AgentKey) -> Caller:
        return cls(agent=key.agent, key=key)

    @classmethod
    def for_user(cls, user: Any) -> Caller:
        return cls(user=user)

    @property
    def is_agent(self) -> bool:
        return self.agent is not None

    @property
    def merchant_id(self) -> str | None:
        """The one merchant an agent acts for; None for staff and the system, who see every one."""
        return self.agent.merchant_id if self.agent else None

    @property
    def idempotency_scope(self) -> str:
        return self.agent.id if self.agent else f"user:{self.user.pk}"

    @property
    def label(self) -> str:
        """How the audit log names the actor."""
        if self.agent:
            return f"agent:{self.agent.id} ({self.agent.name}, key {self.key.prefix if self.key else '?'})"
        if self.user is not None:
            return f"user:{self.user.get_username()}"
        return "system"

    def refund_authority(self, currency: str) -> int | None:
        """For a person: the largest refund they may approve in ``currency`` (0 with no authority),
        so a refund they ask for above it waits for someone else. None for an agent or the system."""
        if self.user is None:
            return None
        amounts = self.user.refund_authorities.filter(currency=currency, is_active=True)
        return max(amounts.values_list("max_amount_minor", flat=True), default=0)

    def session_id_for(self, session_id: str, now: datetime) -> str:
        """The agent's session for limits: the one it named, or, when it named none, one session
        per key and UTC hour (omitting or rotating session ids must not skip session limits)."""
        if session_id or self.agent is None:
            return session_id
        return f"key:{self.key.prefix if self.key else self.agent.id}:{now.astimezone(UTC):%Y-%m-%dT%H}"

    def record_read(self, operation: str, *, payment_id: str = "", refund_id: str = "") -> None:
        """One INSERT: which agent (and key) looked at what. A read that found nothing is kept
        too (probing ids leaves a trace). Staff reads are not agents' reads: nothing here."""
        if self.agent is not None:
            AgentRead.objects.create(agent_id=self.agent.id, key_prefix=self.key.prefix if self.key else "",
                                     operation=operation, payment_id=payment_id[:40], refund_id=refund_id[:40])

    def verdict_fields(self) -> dict[str, str]:
        return {
            "agent_id": self.agent.id if self.agent else "",
            "agent_name": self.agent.name if self.agent else "",
            "key_prefix": self.key.prefix if self.key else "",
            "staff_username": self.user.get_username() if self.user is not None else "",
        }


SYSTEM = Caller()
