"""``manage.py create_staff USER ROLE``: the first staff login of a production install (and any
after it, for those who prefer a shell to the admin): an account with one of the five roles, its
password asked for (or read from stdin), audited. In production mode the first sign-in enrols a TOTP
second factor: the page shows the key for an authenticator app (roles/signin.py)."""

from __future__ import annotations

import getpass
import sys

from django.conf import settings
from django.contrib.auth import get_user_model
from django.contrib.auth.password_validation import validate_password
from django.core.exceptions import ValidationError
from django.core.management.base import BaseCommand, CommandError, CommandParser
from django.db import transaction

from audit.services import record_audit
from roles.definitions import ROLES, find_role
from roles.services import grant_role


class Command(BaseCommand):
    help = (f"Create a staff login with a role ({', '.join(ROLES)}); the password is asked for, or read from "
            "stdin when it is not a terminal. The first sign-in in production mode enrols a TOTP second factor.")
    stealth_options = ("stdin",)

    def add_arguments(self, parser: CommandParser) -> None:
        parser.add_argument("username", metavar="USER")
        parser.add_argument("role", metavar="ROLE", nargs="+", help="e.g. administrator, or finance approver")
        parser.add_argument("--email", default="")

    def handle(self, *args, username: str, role: list[str], email: str, **options) -> None:
        try:
            found = find_role(" ".join(role))
        except LookupError as exc:
            raise CommandError(str(exc)) from None
        users = get_user_model()
        if users.objects.filter(username=username).exists():
            raise CommandError(f"{username!r} exists already: give it a role with 'manage.py grant_role'.")
        password = self._password(options.get("stdin") or sys.stdin)
        user = users(username=username, email=email, is_staff=True)
        try:
            validate_password(password, user)
        except ValidationError as exc:
            raise CommandError(" ".join(exc.messages)) from None
        user.set_password(password)
        actor = f"cli:{getpass.getuser()}"
        with transaction.atomic():
            user.save()
            record_audit(actor=actor, action="user.created", subject_type="user", subject_id=str(user.pk),
                         data={"username": username, "after": {"email": email, "is_staff": True,
                                                               "is_superuser": False}})
            grant_role(user=user, role=found, actor=actor)
        self.stdout.write(
            f"{username} can sign in at {settings.PUBLIC_BASE_URL}/admin/ as {found.name} ({found.does}). "
            + ("The first sign-in sets up a TOTP second factor: have an authenticator app at hand."
               if settings.PRODUCTION else "In production mode the first sign-in also sets up a TOTP second factor."))

    @staticmethod
    def _password(stdin) -> str:
        if not stdin.isatty():
            return stdin.readline().rstrip("\n")
        password = getpass.getpass("Password: ")
        if password != getpass.getpass("Password (again): "):
            raise CommandError("The two passwords differ; nothing was created.")
        return password
