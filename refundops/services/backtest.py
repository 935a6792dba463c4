"""Backtest: what a draft limits or hold-rules version would have decided on the recorded requests
of the last N days, beside what was decided.

Each refund request's verdict keeps what the pure policy read (``Verdict.policy_input``) and the
running totals it saw (``Verdict.totals``); the replay runs ``evaluate_refund`` again on exactly
those, with the draft in place of its series' version and the other series as it was then. The
totals are the ones recorded: a refund the draft would have refused still counts in the totals of
the requests after it, as it did (the replay answers "what would the draft say to these requests",
not "what would the books look like").

Only requests that reached the policy are replayed (``refund.create`` verdicts with a policy
input); a request refused before it (bad key, bad body, unknown payment) would be refused by any
policy. Requests recorded before verdicts kept their policy input are counted as ``skipped``.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from django.db import transaction
from django.db.models import Q
from django.utils import timezone

from audit.models import Verdict
from refundops import outbox
from refundops.models import BacktestRun, HoldRules, PolicyDraft, RefundLimits
from refundops.policy import evaluate_refund, replay_input

log = logging.getLogger(__name__)
OUTCOMES = ("approved", "held", "denied")
PROGRESS_EVERY = 5_000  # requests replayed between two progress reports
# A running run that wrote no progress for this long lost its worker (a replay writes every
# PROGRESS_EVERY requests, seconds apart; the count before it is one query).
BACKTEST_STALL_SECONDS = 15 * 60
BACKTEST_CHANGES_KEPT = 200  # the changes a run kept for the admin keeps (the command lists every one)


@dataclass
class Tally:
    count: int = 0
    value: dict[str, int] = field(default_factory=lambda: defaultdict(int))  # currency -> minor units

    def add(self, amount: int, currency: str) -> None:
        self.count += 1
        self.value[currency] += amount

    def as_json(self) -> dict[str, Any]:
        return {"count": self.count, "value": dict(sorted(self.value.items()))}


@dataclass
class Side:
    """One policy's decisions: per outcome, per hold reason, per refusal code."""

    outcomes: dict[str, Tally] = field(default_factory=lambda: {o: Tally() for o in OUTCOMES})
    reasons: dict[str, Tally] = field(default_factory=lambda: defaultdict(Tally))
    codes: dict[str, Tally] = field(default_factory=lambda: defaultdict(Tally))

    def add(self, outcome: str, code: str, reasons: list[str], amount: int, currency: str) -> None:
        self.outcomes[outcome].add(amount, currency)
        for reason in reasons:
            self.reasons[reason].add(amount, currency)
        if code:
            self.codes[code].add(amount, currency)

    def as_json(self) -> dict[str, Any]:
        return {"outcomes": {k: v.as_json() for k, v in self.outcomes.items()},
                "hold_reasons": {k: v.as_json() for k, v in sorted(self.reasons.items())},
                "codes": {k: v.as_json() for k, v in sorted(self.codes.items())}}


@dataclass(frozen=True)
class Change:
    """A request whose outcome the draft changes."""

    verdict_id: str
    refund_id: str
    payment_id: str
    at: datetime
    amount_minor: int
    currency: str
    before: tuple[str, str, tuple[str, ...]]  # outcome, code, hold reasons
    after: tuple[str, str, tuple[str, ...]]

    def as_json(self) -> dict[str, Any]:
        def side(outcome, code, reasons):
            return {"outcome": outcome, "code": code or None, "hold_reasons": list(reasons)}
        return {"verdict_id": self.verdict_id, "refund_id": self.refund_id or None, "payment_id": self.payment_id,
                "at": self.at.isoformat(), "amount": self.amount_minor, "currency": self.currency,
                "active": side(*self.before), "draft": side(*self.after)}


@dataclass
class Backtest:
    draft: PolicyDraft
    days: int
    since: datetime
    requests: int = 0
    skipped: int = 0
    active: Side = field(default_factory=Side)
    drafted: Side = field(default_factory=Side)
    changes: list[Change] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {"draft_id": self.draft.pk, "kind": self.draft.kind, "currency": self.draft.currency or None,
                "days": self.days, "since": self.since.isoformat(), "requests": self.requests,
                "skipped": self.skipped, "changed": len(self.changes),
                "active": self.active.as_json(), "draft": self.drafted.as_json(),
                "changes": [c.as_json() for c in self.changes]}


_COLUMNS = ("id", "refund_id", "payment_id", "created_at", "currency", "outcome", "code", "hold_reasons",
            "amount_minor", "policy_input", "totals")


def recorded_requests(*, days: int, currency: str = "", now: datetime | None = None):
    """The refund requests that reached the policy in the last ``days`` days, oldest first."""
    since = (now or timezone.now()) - timedelta(days=days)
    verdicts = Verdict.objects.filter(operation="refund.create", dry_run=False, deduplicated=False,
                                      created_at__gte=since)
    if currency:
        verdicts = verdicts.filter(currency=currency)
    return since, verdicts


def run_backtest(*, draft: PolicyDraft, days: int, now: datetime | None = None,
                 progress: Callable[[int], None] | None = None) -> Backtest:
    """Replay; ``progress``, if given, hears the number replayed every ``PROGRESS_EVERY`` requests."""
    since, verdicts = recorded_requests(days=days, currency=draft.currency, now=now)
    result = Backtest(draft=draft, days=days, since=since)
    result.skipped = verdicts.filter(policy_input={}).exclude(code__in=_BEFORE_THE_POLICY).count()
    version = draft.as_version()
    limits = {row.pk: row for row in RefundLimits.objects.all()}
    rules = {row.pk: row for row in HoldRules.objects.all()}
    is_limits = draft.kind == PolicyDraft.Kind.LIMITS
    rows = verdicts.exclude(policy_input={}).order_by("created_at").values_list(*_COLUMNS)
    for (verdict_id, refund_id, payment_id, at, currency, outcome, code, reasons, amount, recorded,
         totals) in rows.iterator(chunk_size=5_000):
        replay = replay_input(recorded, totals)
        decision = evaluate_refund(
            payment=replay.payment, ask=replay.ask, totals=replay.totals, now=replay.now, paused=replay.paused,
            breaker_open=replay.breaker_open, ledger_mismatch=replay.ledger_mismatch,
            limits=version if is_limits else limits.get(replay.limits_id),
            rules=rules.get(replay.rules_id) if is_limits else version)
        amount = amount or 0
        result.requests += 1
        result.active.add(outcome, code, reasons, amount, currency)
        result.drafted.add(decision.outcome, decision.code, decision.hold_reasons, decision.amount_minor, currency)
        before = (outcome, code, tuple(reasons))
        after = (decision.outcome, decision.code, tuple(decision.hold_reasons))
        if before != after:
            result.changes.append(Change(verdict_id, refund_id, payment_id, at, amount, currency, before, after))
        if progress is not None and result.requests % PROGRESS_EVERY == 0:
            progress(result.requests)
    return result


def to_replay(*, draft: PolicyDraft, days: int, now: datetime | None = None) -> int:
    _, verdicts = recorded_requests(days=days, currency=draft.currency, now=now)
    return verdicts.exclude(policy_input={}).count()


def start_backtest(*, draft: PolicyDraft, days: int, person) -> BacktestRun:
    """Ask the worker for a backtest (the admin's way: a year of requests is minutes, not a request's
    work); the draft's page polls the run's progress and shows its result."""
    with transaction.atomic():
        run = BacktestRun.objects.create(draft=draft, days=days, requested_by=person.get_username())
        outbox.send_after_commit("refundops.tasks.run_backtest", {"run_id": run.pk})
    return run


def complete_backtest_run(*, run_id: str) -> BacktestRun | None:
    """The worker's half: count, replay with progress written to the run's row, keep the result."""
    claimed = BacktestRun.objects.filter(pk=run_id, status=BacktestRun.Status.QUEUED).update(
        status=BacktestRun.Status.RUNNING, heartbeat_at=timezone.now())
    run = BacktestRun.objects.select_related("draft").filter(pk=run_id).first()
    if not claimed or run is None:
        return run  # already run (a redelivered task) or gone
    runs = BacktestRun.objects.filter(pk=run_id)
    try:
        runs.update(total=to_replay(draft=run.draft, days=run.days), heartbeat_at=timezone.now())
        result = run_backtest(draft=run.draft, days=run.days,
                              progress=lambda n: runs.update(replayed=n, heartbeat_at=timezone.now()))
    except Exception as exc:  # the page says so instead of polling for ever
        log.exception("backtest %s failed", run_id)
        runs.update(status=BacktestRun.Status.FAILED, error=f"{type(exc).__name__}: {exc}", finished_at=timezone.now())
        raise
    kept = result.as_json()
    kept["changes"] = kept["changes"][:BACKTEST_CHANGES_KEPT]
    runs.update(status=BacktestRun.Status.DONE, replayed=result.requests, result=kept, finished_at=timezone.now())
    run.refresh_from_db()
    return run


def polled_backtest_run(run: BacktestRun) -> BacktestRun:
    """The run as the draft's page shows it: one still running whose worker has been silent for
    ``BACKTEST_STALL_SECONDS`` is marked failed (a killed worker raises nothing we could catch), so
    the page stops polling and the person can run it again."""
    if run.status != BacktestRun.Status.RUNNING:
        return run
    silent_since = timezone.now() - timedelta(seconds=BACKTEST_STALL_SECONDS)
    BacktestRun.objects.filter(Q(heartbeat_at__lte=silent_since) | Q(heartbeat_at__isnull=True),  # claimed
                               pk=run.pk, status=BacktestRun.Status.RUNNING).update(  # before heartbeats were kept
        status=BacktestRun.Status.FAILED, finished_at=timezone.now(),
        error=f"the worker stopped: no progress for {BACKTEST_STALL_SECONDS // 60} minutes. Run it again.")
    run.refresh_from_db()
    return run


# Refused before the policy runs: no policy input to keep, and no policy would decide otherwise.
_BEFORE_THE_POLICY = ("VALIDATION_ERROR", "IDEMPOTENCY_KEY_REQUIRED", "IDEMPOTENCY_KEY_REUSED", "PAYMENT_NOT_FOUND",
                      "UNAUTHENTICATED", "CAPABILITY_NOT_GRANTED", "RATE_LIMITED", "PAYLOAD_TOO_LARGE")
