"""``manage.py verify_audit``: walk the audit log's hash chain from the first entry to the last."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError

from audit.services import verify_chain


class Command(BaseCommand):
    help = ("Check the audit log's hash chain. Exit 0 with the number of entries checked, or non-zero "
            "naming the first entry that does not verify.")

    def add_arguments(self, parser):
        parser.add_argument("--progress-every", type=int, default=10_000, metavar="N",
                            help="report progress on stderr every N entries (default 10000)")

    def handle(self, *args, progress_every: int, **options):
        if progress_every < 1:
            raise CommandError("--progress-every must be at least 1")
        for checked, bad, why in verify_chain(batch_size=progress_every):
            if bad is not None:
                raise CommandError(f"audit entry #{bad.seq} (id {bad.pk}, {bad.action} "
                                   f"{bad.subject_type}:{bad.subject_id}) does not verify: {why}; "
                                   f"{checked} entries before it verified")
            if why == "ok":
                self.stdout.write(f"{checked} audit entries checked; the chain verifies.")
                return
            self.stderr.write(f"… {checked} entries verified")
