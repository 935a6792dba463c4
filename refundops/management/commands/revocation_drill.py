"""``manage.py revocation_drill [--json]``: prove that revoking a capability, then a key, refuses
the next REST and MCP call (refundops/services/revocation_drill.py); exit 1 when a call got through."""

from __future__ import annotations

import json

from django.core.management.base import BaseCommand

from refundops.services.revocation_drill import run_drill


class Command(BaseCommand):
    help = ("In a drill merchant of its own: create an agent and key, prove a call gets through, revoke a "
            "capability and prove the next REST and MCP call with it is refused, revoke the key and prove every "
            "call is refused. Moves no money; recorded as an audit entry. Exit 1 when a call got through.")

    def add_arguments(self, parser):
        parser.add_argument("--json", action="store_true", dest="as_json", help="print the result as JSON")

    def handle(self, *args, as_json: bool = False, **options):
        result = run_drill()
        if as_json:
            self.stdout.write(json.dumps(result.as_json(), indent=2))
        else:
            for step in result.steps:
                timing = f" ({step.ms_since_revocation} ms after revoking)" if step.ms_since_revocation is not None else ""
                self.stdout.write(f"{'ok ' if step.ok else 'FAIL'} {step.channel:4} {step.name}: expected "
                                  f"{step.expected}, got {step.got}{timing}")
            self.stdout.write(f"Drill {'passed' if result.passed else 'FAILED'}: agent {result.agent_id}, key "
                              f"{result.key_prefix}… (revoked).")
        if not result.passed:
            raise SystemExit(1)

