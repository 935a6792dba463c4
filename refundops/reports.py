"""What finance, fraud and auditors measure: the queries behind the admin dashboard.

Plain numbers out (integer minor units per currency, counts); audit.charts draws them. Every
query is one aggregate over an indexed time window, so the page stays cheap as refunds grow.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta

from django.db.models import Count, Exists, Min, OuterRef, Sum
from django.db.models.functions import TruncDate
from django.utils import timezone

from audit.models import AuditEntry, Verdict
from processors.models import SandboxControl
from refundops import breaker
from refundops.errors import ApiError
from refundops.models import COUNTING_STATES, LedgerDiscrepancy, Payment, PlatformState, Refund, RefundState
from refundops.selectors import active_limits, limits_zone, start_of_local_day
from refundops.services.payouts import gateway_backlog

DAYS = 14

# Where a refund that was held ended up, by its state now.
HOLD_OUTCOMES = ("approved", "rejected", "expired", "waiting", "canceled")
_HOLD_OUTCOME_OF = {
    RefundState.HELD: "waiting", RefundState.REJECTED: "rejected", RefundState.EXPIRED: "expired",
    RefundState.CANCELED: "canceled", RefundState.APPROVED: "approved", RefundState.SUBMITTED: "approved",
    RefundState.SETTLED: "approved", RefundState.FAILED: "approved",
}


@dataclass(frozen=True)
class DayTotal:
    day: date
    count: int
    amount_minor: int


@dataclass(frozen=True)
class CurrencyDays:
    currency: str
    days: list[DayTotal]
    global_daily_limit_minor: int | None
    approval_threshold_minor: int | None


@dataclass(frozen=True)
class ReasonTotal:
    reason: str
    label: str
    count: int
    amount_minor: int


@dataclass(frozen=True)
class Switches:
    refunds_paused: bool
    agents_disabled: bool
    breaker: str  # closed, open, half_open, or unknown while Redis is unreachable
    sandbox_mode: str
    changed_by: str
    changed_at: datetime | None


@dataclass(frozen=True)
class LastDrill:
    """The last ``revocation_drill`` (its audit entry): when, whether every call after a revocation was
    refused, and the slowest time from a revocation to its refusal."""
    at: datetime
    passed: bool
    ms_to_refusal: float | None
    entry_seq: int | None


@dataclass
class Dashboard:
    since: datetime
    days: list[date]
    per_currency: list[CurrencyDays]
    held_by_rule: dict[str, dict[str, int]]  # rule code -> outcome -> count
    decisions_by_person: dict[str, dict[str, int]]  # person -> {"approved": n, "rejected": n}
    duplicates_by_day: dict[date, int]
    duplicates_by_agent: dict[str, int]
    reasons: dict[str, list[ReasonTotal]]  # currency -> totals
    held_now: int
    oldest_held_at: datetime | None
    paid_twice: list[Payment]
    paid_twice_count: int
    disputed_with_refunds: int
    switches: Switches
    gateway_backlog: list[dict]  # approved refunds still waiting for their gateway, per gateway
    open_discrepancies: int  # reconciliation: differences between a gateway's books and ours, open
    last_drill: LastDrill | None = None  # None: no drill has ever run
    currencies: list[str] = field(default_factory=list)


def _window(now: datetime, days: int) -> tuple[datetime, list[date]]:
    """The first instant of the first of the last ``days`` local days (the limits' days), and those days."""
    today = timezone.localtime(now, limits_zone()).date()
    dates = [today - timedelta(days=days - 1 - i) for i in range(days)]
    return start_of_local_day(dates[0]), dates


def refunds_per_day(*, since: datetime, days: list[date]) -> list[CurrencyDays]:
    """Value and count of refunds that count against limits, per currency and local day: the day the
    limits counted each on (``counted_at``: the decision's instant, or a resubmission's), not the day
    its row was written."""
    rows = (Refund.objects.filter(status__in=COUNTING_STATES, counted_at__gte=since)
            .annotate(day=TruncDate("counted_at", tzinfo=limits_zone()))
            .values("currency", "day").annotate(n=Count("id"), total=Sum("amount_minor"))
            .order_by())
    by_currency: dict[str, dict[date, tuple[int, int]]] = defaultdict(dict)
    for row in rows:
        by_currency[row["currency"]][row["day"]] = (row["n"], row["total"])
    result = []
    for currency in sorted(by_currency):
        limits = active_limits(currency)
        result.append(CurrencyDays(
            currency=currency,
            days=[DayTotal(d, *by_currency[currency].get(d, (0, 0))) for d in days],
            global_daily_limit_minor=limits.global_daily_amount_minor if limits else None,
            approval_threshold_minor=limits.approval_threshold_minor if limits else None))
    return result


def held_by_rule(*, since: datetime) -> dict[str, dict[str, int]]:
    """For each hold rule that fired, how the refunds it held ended (one refund can fire several)."""
    counts: dict[str, dict[str, int]] = defaultdict(lambda: dict.fromkeys(HOLD_OUTCOMES, 0))
    rows = (Refund.objects.filter(created_at__gte=since).exclude(hold_reasons=[])
            .values("hold_reasons", "status").annotate(n=Count("id")).order_by())
    for row in rows:
        for rule in row["hold_reasons"]:
            counts[rule][_HOLD_OUTCOME_OF.get(row["status"], "waiting")] += row["n"]
    return dict(sorted(counts.items()))


def decisions_by_person(*, since: datetime) -> dict[str, dict[str, int]]:
    """How many held refunds each person approved or rejected, from the audit log. A refund the policy
    approved at the request is logged as refund.approved too, under whoever asked (an agent, or a
    person refunding in the admin), naming its verdict: nobody decided it, so it is left out."""
    result: dict[str, dict[str, int]] = defaultdict(lambda: {"approved": 0, "rejected": 0})
    rows = (AuditEntry.objects.filter(created_at__gte=since, action__in=["refund.approved", "refund.rejected"],
                                      actor__startswith="user:")
            .exclude(data__has_key="verdict_id")
            .values("actor", "action").annotate(n=Count("id")).order_by())
    for row in rows:
        person = row["actor"].removeprefix("user:")
        result[person][row["action"].removeprefix("refund.")] += row["n"]
    return dict(sorted(result.items()))


def duplicates_blocked(*, since: datetime) -> tuple[dict[date, int], dict[str, int]]:
    """Replays answered from an idempotency key's first answer: per day, and per caller."""
    replays = Verdict.objects.filter(deduplicated=True, created_at__gte=since)
    per_day = {row["day"]: row["n"] for row in
               replays.annotate(day=TruncDate("created_at", tzinfo=limits_zone()))
               .values("day").annotate(n=Count("id")).order_by()}
    per_caller = {(row["agent_name"] or f"staff: {row['staff_username']}"): row["n"] for row in
                  replays.values("agent_name", "staff_username").annotate(n=Count("id")).order_by("-n")[:10]}
    return per_day, per_caller


def refunds_by_reason(*, since: datetime) -> dict[str, list[ReasonTotal]]:
    labels = dict(Refund._meta.get_field("reason").choices)
    rows = (Refund.objects.filter(status__in=COUNTING_STATES, created_at__gte=since)
            .values("currency", "reason").annotate(n=Count("id"), total=Sum("amount_minor"))
            .order_by("currency", "-total"))
    result: dict[str, list[ReasonTotal]] = defaultdict(list)
    for row in rows:
        result[row["currency"]].append(
            ReasonTotal(row["reason"], labels.get(row["reason"], row["reason"]), row["n"], row["total"]))
    return dict(result)


def switches(*, now: datetime) -> Switches:
    state = PlatformState.objects.filter(pk=1).first() or PlatformState()
    control = SandboxControl.objects.filter(pk=1).first() or SandboxControl()
    try:
        phase = breaker.status(now=now)
    except ApiError:  # Redis away: money-moving calls fail closed; the page still renders
        phase = "unknown"
    return Switches(refunds_paused=state.refunds_paused, agents_disabled=state.agents_disabled,
                    breaker=phase, sandbox_mode=control.mode,
                    changed_by=state.changed_by, changed_at=state.changed_at if state.pk else None)


def last_drill() -> LastDrill | None:
    entry = (AuditEntry.objects.filter(action="revocation.drill").order_by("-created_at", "-id")
             .values("created_at", "data", "seq").first())
    if entry is None:
        return None
    timed = [step["ms_since_revocation"] for step in entry["data"].get("steps", [])
             if isinstance(step, dict) and step.get("ms_since_revocation") is not None]
    return LastDrill(at=entry["created_at"], passed=bool(entry["data"].get("passed")),
                     ms_to_refusal=max(timed) if timed else None, entry_seq=entry["seq"])


def dashboard(*, now: datetime | None = None, days: int = DAYS) -> Dashboard:
    now = now or timezone.now()
    since, day_list = _window(now, days)
    held = Refund.objects.filter(status=RefundState.HELD).aggregate(n=Count("id"), oldest=Min("created_at"))
    per_day, per_caller = duplicates_blocked(since=since)
    per_currency = refunds_per_day(since=since, days=day_list)
    reasons = refunds_by_reason(since=since)
    paid_twice = Payment.objects.filter(paid_twice=True).select_related("customer").order_by("-created_at")
    return Dashboard(
        since=since, days=day_list, per_currency=per_currency, held_by_rule=held_by_rule(since=since),
        decisions_by_person=decisions_by_person(since=since), duplicates_by_day=per_day,
        duplicates_by_agent=per_caller, reasons=reasons, held_now=held["n"], oldest_held_at=held["oldest"],
        paid_twice=list(paid_twice[:10]), paid_twice_count=paid_twice.count(),
        disputed_with_refunds=Payment.objects.filter(  # the few open disputes (an index), then their refunds
            Exists(Refund.objects.filter(payment=OuterRef("pk"), status__in=COUNTING_STATES)),
            dispute_status=Payment.Dispute.OPEN).count(),
        switches=switches(now=now), gateway_backlog=gateway_backlog(now=now),
        open_discrepancies=LedgerDiscrepancy.objects.filter(status=LedgerDiscrepancy.Status.OPEN).count(),
        last_drill=last_drill(), currencies=sorted({c.currency for c in per_currency} | set(reasons)))
