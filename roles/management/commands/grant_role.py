"""``manage.py grant_role USER ROLE``: give a staff member one of the five roles (audited)."""

from __future__ import annotations

import getpass

from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError, CommandParser

from roles.definitions import ROLES, find_role
from roles.services import grant_role, revoke_role


class Command(BaseCommand):
    help = f"Give USER a role ({', '.join(ROLES)}); --revoke takes it away."

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username", metavar="USER")
        parser.add_argument("role", metavar="ROLE", nargs="+", help="e.g. finance approver (quoted or not)")
        parser.add_argument("--revoke", action="store_true")

    def handle(self, *args, username: str, role: list[str], revoke: bool, **options) -> None:
        try:
            found = find_role(" ".join(role))
        except LookupError as exc:
            raise CommandError(str(exc)) from None
        user = get_user_model().objects.filter(username=username).first()
        if user is None:
            raise CommandError(f"No user {username!r}: create the account first.")
        actor = f"cli:{getpass.getuser()}"
        if revoke:
            revoke_role(user=user, role=found, actor=actor)
            self.stdout.write(f"{username} is no longer {found.name}.")
        else:
            grant_role(user=user, role=found, actor=actor)
            self.stdout.write(f"{username} is now {found.name}: {found.does}.")
