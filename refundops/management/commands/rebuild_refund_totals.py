"""``manage.py rebuild_refund_totals``: the day's kept totals made again from the refunds."""

from __future__ import annotations

from django.core.management.base import BaseCommand

from refundops.services.totals import rebuild_totals


class Command(BaseCommand):
    help = ("Make the kept refund totals (refundops_refundtotaldelta) again from the refunds: after a "
            "restore or bulk load that ran with triggers disabled. Refund writes wait while it runs.")

    def handle(self, *args, **options) -> None:
        rows = rebuild_totals()
        self.stdout.write(f"Refund totals rebuilt: {rows} bucket rows from the last few days' refunds.")
