"""``manage.py agents off|on|status``: all agent access at once, and a list of agents and keys.
``agents grant AGENT CAP`` and ``agents issue-key AGENT`` give back what revoking took."""

from __future__ import annotations

import getpass
from datetime import timedelta

from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.utils import timezone

from refundops.models import Agent, PlatformState
from refundops.services.agents import (
    AgentAccessError,
    find_agent,
    grant_capability,
    issue_key,
    set_agents_disabled,
)


class Command(BaseCommand):
    help = "Switch all agent access off or on, list agents, grant a capability, or issue a new key."

    def add_arguments(self, parser: CommandParser) -> None:
        sub = parser.add_subparsers(dest="action", required=True)
        sub.add_parser("off", help="Every agent key is refused from the next call")
        sub.add_parser("on", help="Agent keys work again")
        sub.add_parser("status", help="The switches, each agent, its capabilities and keys")
        grant = sub.add_parser("grant", help="Give an agent a capability")
        grant.add_argument("agent", metavar="AGENT")
        grant.add_argument("capability", metavar="CAP")
        key = sub.add_parser("issue-key", help="A new key for an existing agent, printed once")
        key.add_argument("agent", metavar="AGENT")
        key.add_argument("--expires-in-days", type=int, default=None)

    def handle(self, *args, action: str, **options) -> None:
        actor = f"cli:{getpass.getuser()}"
        try:
            if action in ("off", "on"):
                set_agents_disabled(disabled=action == "off", actor=actor)
            elif action == "grant":
                agent = grant_capability(agent_name_or_id=options["agent"], capability=options["capability"],
                                         actor=actor)
                self.stdout.write(f"Agent {agent.name} can: {', '.join(agent.capabilities)}.")
                return
            elif action == "issue-key":
                days = options["expires_in_days"]
                if days is not None and days <= 0:
                    raise CommandError("--expires-in-days must be a positive number of days.")
                raw = issue_key(agent=find_agent(options["agent"]), actor=actor,
                                expires_at=timezone.now() + timedelta(days=days) if days else None)
                self.stdout.write("Key (shown only now; store it in the agent's secret store):")
                self.stdout.write(raw)
                return
        except AgentAccessError as exc:
            raise CommandError(str(exc)) from None
        self._status()

    def _status(self) -> None:
        state = PlatformState.current()
        self.stdout.write(f"Agent access: {'OFF for every agent' if state.agents_disabled else 'on'}; "
                          f"kill switch: {'ON' if state.refunds_paused else 'off'}.")
        now = timezone.now()
        for agent in Agent.objects.prefetch_related("keys").order_by("name"):
            self.stdout.write(f"{agent.name} ({agent.pk}{', disabled' if not agent.is_active else ''}): "
                              f"{', '.join(agent.capabilities) or 'no capabilities'}")
            for key in agent.keys.all():
                live = ("revoked" if key.revoked_at else
                        "expired" if key.expires_at and key.expires_at <= now else "live")
                self.stdout.write(f"  {key.prefix}… {live}")
