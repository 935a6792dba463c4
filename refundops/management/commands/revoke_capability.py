"""``manage.py revoke_capability AGENT CAP``: every key of the agent loses it from the next call."""

from __future__ import annotations

import getpass

from django.core.management.base import BaseCommand, CommandError, CommandParser

from refundops.services.agents import AgentAccessError, revoke_capability


class Command(BaseCommand):
    help = "Take one capability away from an agent (by name or id)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("agent", metavar="AGENT")
        parser.add_argument("capability", metavar="CAP")

    def handle(self, *args, agent: str, capability: str, **options) -> None:
        try:
            updated = revoke_capability(agent_name_or_id=agent, capability=capability,
                                        actor=f"cli:{getpass.getuser()}")
        except AgentAccessError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"Agent {updated.name} no longer has {capability}; it can: "
                          f"{', '.join(updated.capabilities) or 'nothing'}.")
