"""``manage.py rebuild_refund_totals``: the day's kept totals made again from the refunds."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import OperationalError

from refundops.services.totals import rebuild_totals


class Command(BaseCommand):
    help = ("Make the kept refund totals (refundops_refundtotaldelta) again from the refunds: after a "
            "restore or bulk load that ran with triggers disabled. Refund writes wait while it runs.")

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("--lock-timeout", type=float, default=5.0, metavar="SECONDS",
                            help="How long to wait for the refunds' lock before giving up (default 5).")

    def handle(self, *args, lock_timeout: float, **options) -> None:
        try:
            rows = rebuild_totals(lock_timeout_ms=lock_timeout * 1000)  # at least 1 ms (0 would be none)
        except OperationalError as exc:
            raise CommandError(f"Nothing changed: a transaction writing refunds held its lock for over "
                               f"{lock_timeout:g} s ({exc}). Run it again when it is done, or with a "
                               f"longer --lock-timeout.") from exc
        self.stdout.write(f"Refund totals rebuilt: {rows} bucket rows from the last few days' refunds.")
