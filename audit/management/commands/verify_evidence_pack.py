"""``manage.py verify_evidence_pack FILE.zip --public-key K``: exit 0 only when nothing in the pack
was added, removed or changed since it was signed."""

from __future__ import annotations

import zipfile
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from audit.evidence import verify_pack


class Command(BaseCommand):
    help = ("Check an evidence pack against its signed manifest with the public key the auditor keeps. "
            "Exit 0 only when the signature holds and no file was added, removed or changed.")

    def add_arguments(self, parser):
        parser.add_argument("pack", metavar="FILE.zip")
        parser.add_argument("--public-key", required=True, metavar="K", help="the Ed25519 public key (PEM file)")

    def handle(self, *args, pack, public_key, **options):
        try:
            problems = verify_pack(pack, Path(public_key).read_bytes())
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
            raise CommandError(f"cannot read {pack} or {public_key}: {exc}") from None
        if problems:
            raise CommandError(f"{pack} does not verify: " + "; ".join(problems))
        self.stdout.write(f"{pack} verifies: the signature holds and every file is as signed.")
