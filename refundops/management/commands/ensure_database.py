"""Create the PostgreSQL database that DATABASE_URL names when the server has none of that name, so
the README's `DATABASE_URL=postgres://…/refundops scripts/run` works on a fresh server. SQLite (embedded
mode) needs nothing: its file is made on first use."""

from __future__ import annotations

from django.core.management.base import BaseCommand, CommandError
from django.db import DatabaseError, connection


class Command(BaseCommand):
    help = "Create the database DATABASE_URL names, when the PostgreSQL server has none of that name (scripts/run)."
    requires_system_checks: list[str] = []  # the database may not exist yet

    def handle(self, *args, **options):
        if connection.vendor != "postgresql":
            return
        params = connection.settings_dict
        name, where = params["NAME"], f"{params['HOST'] or 'localhost'}:{params['PORT'] or 5432}"
        try:
            # Django's own way in without the database: the server's "postgres" database.
            with connection._nodb_cursor() as cursor:
                cursor.execute("SELECT 1 FROM pg_database WHERE datname = %s", [name])
                if cursor.fetchone():
                    return
                cursor.execute(f"CREATE DATABASE {connection.ops.quote_name(name)}")
        except DatabaseError as error:
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise CommandError(f"could not create the database {name} on PostgreSQL at {where} ({reason}). "
                               f"Create it yourself (createdb -h {params['HOST'] or 'localhost'} {name}) or "
                               "check DATABASE_URL.") from None
        self.stdout.write(f"created the database {name} on PostgreSQL at {where}")
