"""``manage.py killswitch on|off|status``: pause or resume every agent refund at once."""

from __future__ import annotations

import getpass

from django.core.management.base import BaseCommand, CommandParser

from refundops.models import PlatformState
from refundops.services.agents import set_killswitch


class Command(BaseCommand):
    help = "Pause (on) or resume (off) agent refunds; 'status' shows the switch."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("state", choices=["on", "off", "status"])

    def handle(self, *args, state: str, **options) -> None:
        if state == "status":
            current = PlatformState.current()
        else:
            current = set_killswitch(on=state == "on", actor=f"cli:{getpass.getuser()}")
        by = f" (last changed by {current.changed_by})" if current.changed_by else ""
        self.stdout.write(f"Kill switch is {'ON: agent refunds are paused' if current.refunds_paused else 'off'}{by}.")
