"""Who is asking: an agent through one of its keys, or a staff user in the admin."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from refundops.models import Agent, AgentKey


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

    def verdict_fields(self) -> dict[str, str]:
        return {
            "agent_id": self.agent.id if self.agent else "",
            "agent_name": self.agent.name if self.agent else "",
            "key_prefix": self.key.prefix if self.key else "",
            "staff_username": self.user.get_username() if self.user is not None else "",
        }


SYSTEM = Caller()
