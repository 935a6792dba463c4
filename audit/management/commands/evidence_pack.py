"""``manage.py evidence_pack --from DATE --to DATE [--merchant M] --out FILE.zip``: the auditors'
evidence pack for a period (audit/evidence.py); exit 1 when a control shows exceptions."""

from __future__ import annotations

from datetime import date
from pathlib import Path

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from audit.evidence import build_pack, load_signing_key, new_signing_key, period_of_days
from audit.services import record_audit


def _day(text: str) -> date:
    try:
        return date.fromisoformat(text)
    except ValueError:
        raise CommandError(f"expected a date as YYYY-MM-DD, got {text!r}") from None


class Command(BaseCommand):
    help = ("Write the auditors' evidence pack for a period: one section and one CSV per control, the controls "
            "in force, the audit chain's segment and heads, and a manifest.json signed with Ed25519. Both dates "
            "are UTC days and both are included. Exit 1 when a control shows exceptions.")

    def add_arguments(self, parser):
        parser.add_argument("--from", dest="start", required=True, metavar="DATE", help="first day, YYYY-MM-DD (UTC)")
        parser.add_argument("--to", dest="end", required=True, metavar="DATE", help="last day, YYYY-MM-DD (UTC), included")
        parser.add_argument("--merchant", metavar="M", help="one merchant's id (default: every merchant)")
        parser.add_argument("--out", required=True, metavar="FILE.zip")
        parser.add_argument("--signing-key", metavar="PEM",
                            help="Ed25519 private key (default: the EVIDENCE_SIGNING_KEY setting)")
        parser.add_argument("--new-key", metavar="PEM",
                            help="write a new Ed25519 private key to this path (it must not exist), sign with it, "
                                 "and write its public half beside it as PEM.pub for the auditor")

    def handle(self, *args, start, end, merchant, out, signing_key, new_key, **options):
        first, last = _day(start), _day(end)
        if last < first:
            raise CommandError(f"--to {end} is before --from {start}")
        try:
            period = period_of_days(first, last)
        except ValueError as no_end:
            raise CommandError(f"--to {no_end}") from None
        if merchant:
            from refundops.models import Merchant
            if not Merchant.objects.filter(pk=merchant).exists():
                raise CommandError(f"no merchant {merchant!r}; `manage.py shell` or the admin lists them")
        if new_key:
            path = Path(new_key)
            if path.exists():
                raise CommandError(f"{path} exists; --new-key never overwrites a key")
            Path(f"{path}.pub").write_bytes(new_signing_key(path))
            self.stderr.write(f"New signing key in {path}; give the auditor {path}.pub.")
            signing_key = str(path)
        signing_key = signing_key or settings.EVIDENCE_SIGNING_KEY
        if not signing_key:
            raise CommandError("no signing key: set EVIDENCE_SIGNING_KEY to an Ed25519 private key (PEM) or pass "
                               "--signing-key PEM, or --new-key PEM to make one")
        try:
            key = load_signing_key(signing_key)
        except (OSError, ValueError) as exc:
            raise CommandError(f"the signing key {signing_key}: {exc}") from None
        result = build_pack(start=period.start, end=period.end, out=out, signing_key=key, merchant_id=merchant,
                            progress=lambda step: self.stderr.write(f"… {step}"))
        record_audit(actor="system:evidence_pack", action="evidence_pack.built", subject_type="evidence_pack",
                     subject_id=f"{first}..{last}"[:60],
                     data={"merchant": merchant, "out": str(out), "exceptions": result.exception_count,
                           "manifest_sha256": result.manifest_sha256})
        for control in result.controls:
            self.stdout.write(f"{control.title}: {control.verdict}")
        self.stdout.write(f"Wrote {out}: {len(result.manifest['files'])} files and a signed manifest; "
                          f"{result.exception_count} exception(s).")
        if result.exception_count:
            raise SystemExit(1)
