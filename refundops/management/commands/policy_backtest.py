"""``manage.py policy_backtest --limits DRAFT_ID | --rules DRAFT_ID --days N [--json]``: replay the
recorded refund requests of the last N days through a draft version, beside what was decided."""

from __future__ import annotations

import json
import time

from django.core.management.base import BaseCommand, CommandError, CommandParser

from processors.money import format_minor
from refundops.models import PolicyDraft
from refundops.services.backtest import OUTCOMES, Side, run_backtest


def _value(value: dict[str, int]) -> str:
    return ", ".join(format_minor(minor, currency) for currency, minor in sorted(value.items())) or "-"


class Command(BaseCommand):
    help = ("Replay the refund requests of the last N days through a draft limits or hold-rules version "
            "and print, beside what was decided, the counts and value approved, held and refused, per "
            "hold reason and refusal code, and the requests whose outcome would change.")

    def add_arguments(self, parser: CommandParser) -> None:
        which = parser.add_mutually_exclusive_group(required=True)
        which.add_argument("--limits", metavar="DRAFT_ID", help="a draft of refund limits (pd_…)")
        which.add_argument("--rules", metavar="DRAFT_ID", help="a draft of hold rules (pd_…)")
        parser.add_argument("--days", type=int, default=7, help="how many days back to replay (default 7)")
        parser.add_argument("--json", action="store_true", dest="as_json", help="print one JSON object")

    def handle(self, *args, limits: str | None, rules: str | None, days: int, as_json: bool, **options) -> None:
        kind, draft_id = (PolicyDraft.Kind.LIMITS, limits) if limits else (PolicyDraft.Kind.RULES, rules)
        if days < 1:
            raise CommandError("--days: give a whole number of days, 1 or more.")
        draft = PolicyDraft.objects.filter(pk=draft_id).first()
        if draft is None:
            raise CommandError(f"No policy draft {draft_id!r}; draft ids start with 'pd_' (admin: Policy drafts).")
        if draft.kind != kind:
            raise CommandError(f"{draft.pk} is a draft of {draft.get_kind_display().lower()}: "
                               f"use --{'limits' if draft.kind == PolicyDraft.Kind.LIMITS else 'rules'}.")
        started = time.monotonic()
        result = run_backtest(draft=draft, days=days)
        if as_json:
            self.stdout.write(json.dumps(result.as_json()))
            return
        took = time.monotonic() - started
        self.stdout.write(f"{draft}: {result.requests} requests since {result.since:%Y-%m-%d %H:%M} replayed in "
                          f"{took:.1f} s; {len(result.changes)} would change"
                          + (f" ({result.skipped} recorded before verdicts kept their policy input, skipped)"
                             if result.skipped else "") + ".")
        self._table("outcome", OUTCOMES, result.active, result.drafted, lambda side: side.outcomes)
        self._table("hold reason", sorted({*result.active.reasons, *result.drafted.reasons}), result.active,
                    result.drafted, lambda side: side.reasons)
        self._table("refusal code", sorted({*result.active.codes, *result.drafted.codes}), result.active,
                    result.drafted, lambda side: side.codes)
        for change in result.changes[:50]:
            before, after = change.before, change.after
            self.stdout.write(f"  {change.verdict_id} {change.refund_id or '-'} {format_minor(change.amount_minor, change.currency)}: "
                              f"{before[0]} {before[1] or ','.join(before[2])} -> {after[0]} {after[1] or ','.join(after[2])}")
        if len(result.changes) > 50:
            self.stdout.write(f"  … and {len(result.changes) - 50} more (--json lists every one)")

    def _table(self, title: str, keys, active: Side, drafted: Side, pick) -> None:
        if not keys:
            return
        self.stdout.write(f"\n{title:<30} {'active':>8} {'draft':>8}   value active -> draft")
        for key in keys:
            a, d = pick(active).get(key), pick(drafted).get(key)
            self.stdout.write(f"{key:<30} {a.count if a else 0:>8} {d.count if d else 0:>8}   "
                              f"{_value(a.value) if a else '-'} -> {_value(d.value) if d else '-'}")
