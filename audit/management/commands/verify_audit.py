"""``manage.py verify_audit``: walk the audit chain from the first entry to the last, against a head
kept outside the database when one is given."""

from __future__ import annotations

from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from audit.chain import Head, verify_chain
from audit.models import AuditEntry
from audit.parallel import default_processes


class Command(BaseCommand):
    help = ("Check the audit chain: every entry's MAC and link, the verdicts and history rows entries record, "
            "entries left unsealed too long and, with --head or --head-file (from `manage.py audit_head`), "
            "that nothing after that head was deleted. Exit 0 with the number of entries checked, or non-zero "
            "naming the first entry that does not verify.")

    def add_arguments(self, parser):
        given = parser.add_mutually_exclusive_group()
        given.add_argument("--head", metavar="SEQ:HASH", help="a head printed earlier by `manage.py audit_head`")
        given.add_argument("--head-file", metavar="PATH", help="a file holding such a head")
        parser.add_argument("--progress-every", type=int, default=100_000, metavar="N",
                            help="report progress on stderr every N entries (default 100000)")
        parser.add_argument("--chunk-size", type=int, default=5_000, metavar="N",
                            help="read and check N entries at a time (default 5000): what bounds memory")
        parser.add_argument("--processes", type=int, default=default_processes(), metavar="N",
                            help="check the chain in N ranges at once, one process each (default: this machine's "
                                 "cores); the failure named is the one a single process names")

    def handle(self, *args, head: str | None, head_file: str | None, progress_every: int, chunk_size: int,
               processes: int, **options):
        if progress_every < 1:
            raise CommandError("--progress-every must be at least 1")
        if chunk_size < 1:
            raise CommandError("--chunk-size must be at least 1")
        if processes < 1:
            raise CommandError("--processes must be at least 1")
        try:
            kept = Head.parse(Path(head_file).read_text() if head_file else head) if (head or head_file) else None
        except (OSError, ValueError) as exc:
            raise CommandError(f"--head{'-file' if head_file else ''}: {exc}") from None
        if kept is None:
            self.stderr.write("No --head given: a deleted tail or an emptied log cannot be told from a shorter "
                              "chain. Keep `manage.py audit_head` outside the database and pass it here.")
        for checked, bad, why in verify_chain(batch_size=chunk_size, progress_every=progress_every,
                                              head=kept, processes=processes):
            if why == "":
                self.stderr.write(f"… {checked} entries verified")
            elif why != "ok":
                raise CommandError(_failure(checked, bad, why))
        self.stdout.write(f"{checked} audit entries checked; the chain verifies.")
        if kept is not None:
            self.stdout.write(f"The head #{kept.seq} matches.")
        if waiting := AuditEntry.objects.filter(seq__isnull=True).count():
            self.stdout.write(f"{waiting} entries wait to be sealed.")


def _failure(checked: int, bad: AuditEntry | None, why: str) -> str:
    if bad is None:
        return f"the audit chain does not verify: {why}; {checked} entries verified"
    what = f"id {bad.pk}, {bad.action} {bad.subject_type}:{bad.subject_id}"
    if bad.seq is None:
        return f"audit entry (unsealed, {what}) does not verify: {why}; the {checked} sealed entries verified"
    return f"audit entry #{bad.seq} ({what}) does not verify: {why}; {checked} entries before it verified"
