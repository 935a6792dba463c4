"""The reference model of tests/test_model.py: what must be true of the money and the controls,
computed from what the model saw happen (amounts, the clock at each ask, the last approved change of
each field), never from the platform's own sums. Kept simpler than the code it checks."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, time, timedelta
from typing import Any
from zoneinfo import ZoneInfo

QUARTER = timedelta(minutes=15)  # every offset and transition of the zones the model uses is on one


def local_day_start(now: datetime, zone: ZoneInfo) -> datetime:
    """The first instant whose local date is ``now``'s local date: from the date, never by
    ``replace(hour=0)`` on an aware time (a midnight that repeats or never happens)."""
    day = now.astimezone(zone).date()
    at = datetime.combine(day, time(), tzinfo=UTC) - timedelta(hours=15)  # before any zone's midnight
    while at.astimezone(zone).date() < day:
        at += QUARTER
    return at


def transitions(zone: ZoneInfo, year: int) -> list[datetime]:
    """The instants in ``year`` where ``zone``'s offset changes (daylight saving, both ways)."""
    found, at = [], datetime(year, 1, 1, tzinfo=UTC)
    while at.year == year:
        later = at + timedelta(hours=6)
        if at.astimezone(zone).utcoffset() != later.astimezone(zone).utcoffset():
            low = at
            while low.astimezone(zone).utcoffset() == (low + QUARTER).astimezone(zone).utcoffset():
                low += QUARTER
            found.append(low + QUARTER)
        at = later
    return found


@dataclass
class Asked:
    """One refund the model asked for: who, on what, how much, and when (the clock of the ask)."""

    id: str
    payment: str
    customer: str
    currency: str
    amount: int
    agent: str | None  # the agent's id; None for a person
    person: str | None  # the person's user id; None for an agent
    at: datetime
    auto_approved: bool  # approved by the policy at once, with nobody else deciding


@dataclass
class Proposed:
    id: str
    kind: str
    subject: str
    by: str
    before: dict[str, Any]  # the fields it changes, as they were when proposed
    after: dict[str, Any]


@dataclass
class Reference:
    zone: ZoneInfo
    asked: list[Asked] = field(default_factory=list)
    # (kind, subject) -> {field: value}: the last approved change of each field (or its start value)
    in_force: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    proposals: dict[str, Proposed] = field(default_factory=dict)

    # -- money --------------------------------------------------------------------------------
    def windows(self, *, now: datetime, payment: str, customer: str, currency: str, agent: str | None,
                counting: set[str], velocity_hours: int, cumulative_hours: int) -> dict[str, int]:
        """What each limit's window holds now: sums over the refunds still counting (not denied,
        rejected, canceled or failed), by their ask's clock."""
        day, hour = local_day_start(now, self.zone), now - timedelta(hours=1)
        live = [a for a in self.asked if a.id in counting]
        mine = [a for a in live if a.customer == customer and a.currency == currency]
        by_agent = [a for a in live if agent and a.agent == agent and a.currency == currency]
        since = lambda rows, t: [a for a in rows if a.at >= t]  # noqa: E731
        total = lambda rows: sum(a.amount for a in rows)  # noqa: E731
        on_payment = [a for a in live if a.payment == payment]
        return {
            "payment_refund_count": len(on_payment),
            "customer_day_count": len(since(mine, day)), "customer_day_minor": total(since(mine, day)),
            "customer_30d_count": len(since(mine, now - timedelta(days=30))),
            "customer_30d_minor": total(since(mine, now - timedelta(days=30))),
            "customer_velocity_count": len(since(mine, now - timedelta(hours=velocity_hours))),
            "agent_hour_minor": total(since(by_agent, hour)), "agent_day_minor": total(since(by_agent, day)),
            "global_day_minor": total(since([a for a in live if a.currency == currency], day)),
            "agents_payment_minor": total([a for a in on_payment if a.agent]),
            "agents_customer_window_minor": total(
                [a for a in since(mine, now - timedelta(hours=cumulative_hours)) if a.agent]),
        }

    def alone(self, person: str, payment: str, counting: set[str]) -> int:
        """What one person refunded on one payment with nobody else deciding (still counting)."""
        return sum(a.amount for a in self.asked
                   if a.person == person and a.payment == payment and a.auto_approved and a.id in counting)

    # -- four eyes ----------------------------------------------------------------------------
    def propose(self, proposal: Proposed) -> None:
        self.proposals[proposal.id] = proposal

    def is_stale(self, proposal_id: str) -> bool:
        """Refused as stale when any field it changes moved since it was proposed."""
        p = self.proposals[proposal_id]
        now = self.in_force[(p.kind, p.subject)]
        return any(now.get(name) != before for name, before in p.before.items())

    def approved(self, proposal_id: str) -> None:
        """It takes effect: the fields it changes, and only those."""
        p = self.proposals.pop(proposal_id)
        self.in_force[(p.kind, p.subject)].update(p.after)

    def rejected(self, proposal_id: str) -> None:
        self.proposals.pop(proposal_id)

    def authority(self, user_id: str, currency: str) -> dict[str, Any] | None:
        return self.in_force.get(("approval_authority", f"{user_id}:{currency}"))
