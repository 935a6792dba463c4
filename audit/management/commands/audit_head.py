"""``manage.py audit_head``: seal what is committed, then print the chain's head as SEQ:HASH, for
keeping outside the database (``verify_audit --head``)."""

from __future__ import annotations

from django.core.management.base import BaseCommand

from audit.chain import chain_head, seal


class Command(BaseCommand):
    help = ("Seal the committed audit entries, then print the chain's head (SEQ:HASH). Keep it outside the "
            "database (another system, write-once storage) and pass it to `verify_audit --head`: a deleted "
            "tail or an emptied log is then detected.")

    def handle(self, *args, **options):
        seal()  # the verdicts written so far too
        self.stdout.write(str(chain_head()))
