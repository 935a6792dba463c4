"""``manage.py reconcile [--gateway G] [--since DATE] [--json]``: compare each gateway's captures and
refunds with our ledger, record every difference, and exit 1 while any is open (unresolved)."""

from __future__ import annotations

import json
from datetime import datetime, time

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone
from django.utils.dateparse import parse_date, parse_datetime

from refundops.models import Payment
from refundops.services.reconciliation import PaymentCheck, discrepancy_json, open_discrepancies, reconcile


def _moment(text: str) -> datetime:
    """A date (midnight, in the server's time zone) or an ISO 8601 date and time."""
    day = parse_date(text)
    moment = datetime.combine(day, time.min) if day else parse_datetime(text)
    if moment is None:
        raise CommandError(f"--since {text!r}: give a date (2026-01-31) or a date and time (2026-01-31T12:00Z).")
    return timezone.make_aware(moment) if timezone.is_naive(moment) else moment


PROGRESS_EVERY = 10_000  # payments between two progress lines on stderr


class Command(BaseCommand):
    help = ("Compare each gateway's captures and refunds with our ledger, per payment, and record every "
            "difference for a person to resolve. Exits 1 while any difference is open.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--gateway", choices=Payment.Processor.values, help="only this gateway's payments")
        parser.add_argument("--since", help="only payments created, captured or refunded since this date, "
                                            "and those with a refund still submitted")
        parser.add_argument("--json", action="store_true", dest="as_json", help="print one JSON object instead of progress")

    def handle(self, *args, gateway: str | None, since: str | None, as_json: bool, **options) -> None:
        moment = _moment(since) if since else None

        seen = 0

        def progress(check: PaymentCheck) -> None:
            nonlocal seen
            seen += 1
            if seen % PROGRESS_EVERY == 0:
                self.stderr.write(f"… {seen} payments compared")
            if as_json:
                return
            line = f"{check.payment_id} ({check.gateway}): {check.outcome}"
            if check.error or check.why:
                line += f" ({check.error or check.why})"
            self.stdout.write(line)
            for found in check.discrepancies:
                self.stdout.write(f"  {found.pk} {found.kind}: {found.detail}")
            for refund_id in check.recorded:
                self.stdout.write(f"  recorded {refund_id}, a refund made on the gateway directly")

        run = reconcile(gateway=gateway, since=moment, progress=progress)
        still_open = list(open_discrepancies(gateway=gateway))
        if as_json:
            self.stdout.write(json.dumps({
                "checked": run.checked,
                "discrepancies": [discrepancy_json(d, seen_since=run.started_at) for d in still_open],
                "unreachable": [{"payment_id": c.payment_id, "gateway": c.gateway, "error": c.error}
                                for c in run.unreachable],
                # compared, nothing found, but the gateway's book cannot list every refund
                "unverifiable": [{"payment_id": c.payment_id, "gateway": c.gateway, "why": c.why}
                                 for c in run.unverifiable],
                "recorded": [refund_id for c in run.checks for refund_id in c.recorded],
            }, indent=2))
        else:
            unverifiable = (f" ({len(run.unverifiable)} of them unverifiable: their gateway cannot list every "
                            f"refund)" if run.unverifiable else "")
            self.stdout.write(f"{run.checked} payments compared{unverifiable}, {len(run.unreachable)} unreachable, "
                              f"{len(still_open)} discrepancies open.")
        if still_open:
            raise CommandError(f"{len(still_open)} ledger discrepancies are open: resolve them in the admin "
                               f"(Reconciliation) once the books are put right.", returncode=1)

