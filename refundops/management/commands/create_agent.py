"""``manage.py create_agent NAME --capability CAP …``: a new agent and its key, printed once."""

from __future__ import annotations

import getpass
import json
from datetime import timedelta

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from refundops.access import KEY_PREFIX_LENGTH
from refundops.models import Capability
from refundops.services.agents import AgentAccessError, create_agent


class Command(BaseCommand):
    help = "Create an agent with the given capabilities and print its new key (shown only this once)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("name")
        parser.add_argument("--capability", dest="capabilities", action="extend", nargs="+", required=True,
                            metavar="CAP", help=f"One or more of: {', '.join(Capability.values)}")
        parser.add_argument("--merchant", default="", help="The merchant (id or name) the agent acts for; "
                                                           "default: the default merchant")
        parser.add_argument("--owner", default="", help="Team or person responsible for the agent")
        parser.add_argument("--expires-in-days", type=int, default=None, help="The key expires after this many days")
        parser.add_argument("--json", action="store_true", dest="as_json", help="Print one JSON object")

    def handle(self, *args, name: str, capabilities: list[str], owner: str, expires_in_days: int | None,
               as_json: bool, merchant: str = "", **options) -> None:
        if expires_in_days is not None and expires_in_days <= 0:
            raise CommandError("--expires-in-days must be a positive number of days.")
        expires_at = timezone.now() + timedelta(days=expires_in_days) if expires_in_days else None
        try:
            agent, raw = create_agent(name=name, owner=owner, capabilities=capabilities,
                                      actor=f"cli:{getpass.getuser()}", expires_at=expires_at, merchant=merchant)
        except AgentAccessError as exc:
            raise CommandError(str(exc)) from None
        if as_json:
            self.stdout.write(json.dumps({
                "agent_id": agent.pk, "name": agent.name, "owner": agent.owner, "merchant_id": agent.merchant_id,
                "capabilities": agent.capabilities, "key": raw, "key_prefix": raw[:KEY_PREFIX_LENGTH],
                "expires_at": expires_at.isoformat() if expires_at else None}))
            return
        self.stdout.write(f"Agent {agent.name} ({agent.pk}) can: {', '.join(agent.capabilities)}")
        if expires_at:
            self.stdout.write(f"The key expires at {expires_at:%Y-%m-%d %H:%M %Z}.")
        self.stdout.write("Key (shown only now; store it in the agent's secret store):")
        self.stdout.write(raw)

