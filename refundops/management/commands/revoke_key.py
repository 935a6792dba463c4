"""``manage.py revoke_key KEY_PREFIX``: the key is refused from its very next call."""

from __future__ import annotations

import getpass

from django.core.management.base import BaseCommand, CommandError, CommandParser

from refundops.services.agents import AgentAccessError, revoke_key


class Command(BaseCommand):
    help = "Revoke one agent key by its prefix (rk_ and 8 characters)."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("prefix", metavar="KEY_PREFIX")

    def handle(self, *args, prefix: str, **options) -> None:
        try:
            key = revoke_key(prefix=prefix, actor=f"cli:{getpass.getuser()}")
        except AgentAccessError as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(f"Key {key.prefix}… of agent {key.agent.name} is revoked "
                          f"(since {key.revoked_at:%Y-%m-%d %H:%M:%S %Z}).")
