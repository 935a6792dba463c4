"""Behind PgBouncer in transaction mode (docs/OPERATIONS.md's advice in front of PostgreSQL): a
client's transactions run on whichever server session is free, so nothing a session keeps between
transactions (a prepared statement) may be counted on. Issue 30, finding 1."""

from __future__ import annotations

import threading
import uuid
from collections import Counter

import pytest
from django.db import connection, connections
from rest_framework.test import APIClient

from refundops.celery import app as celery_app
from refundops.models import Refund
from tests.conftest import make_agent_key, make_payment, make_rules, make_limits
from tests.pgbouncer import pgbouncer

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("quiet_breaker")]


@pytest.fixture
def behind_pgbouncer(settings):
    """Connections opened in other threads go through a PgBouncer of the test's own (2 server
    sessions), configured as a deployment behind it is (DATABASE_POOLER)."""
    settings.DATABASE_POOLER = "pgbouncer-transaction"
    settings.DATABASE_PREPARED_STATEMENTS = 0  # what settings.py makes of that pooler (test below)
    db = connection.settings_dict
    with pgbouncer(host=db["HOST"] or "127.0.0.1", port=int(db["PORT"] or 5432), user=db["USER"] or "postgres",
                   pool_size=2) as port:
        yield {**db, "HOST": "127.0.0.1", "PORT": str(port)}


def test_160_refunds_from_4_threads_through_pgbouncer_in_transaction_mode_all_answer(behind_pgbouncer, monkeypatch):
    monkeypatch.setitem(celery_app.conf, "task_always_eager", False)  # as deployed: payouts are a worker's
    make_limits()
    make_rules()
    raw_key = make_agent_key()[1]
    payments = [make_payment(amount=5_000).pk for _ in range(160)]
    results: list[tuple[int, str]] = []
    errors: list[BaseException] = []

    def run(thread: int) -> None:
        connections["default"].settings_dict = behind_pgbouncer  # this thread's connection only
        client = APIClient(raise_request_exception=False)
        client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw_key}")
        try:
            for payment in payments[thread::4]:
                response = client.post("/api/v1/refunds", {"transaction_id": payment, "amount": 100,
                                                           "reason": "duplicate"},
                                       format="json", HTTP_IDEMPOTENCY_KEY=uuid.uuid4().hex)
                results.append((response.status_code, response.content.decode()[:200]))
        except BaseException as error:  # reported below
            errors.append(error)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[0]
    failed = [body for status, body in results if status != 201]
    assert (len(results), failed[:3], len(failed)) == (160, [], 0)
    assert Refund.objects.filter(payment_id__in=payments).count() == 160
    assert Counter(status for status, _ in results) == {201: 160}


def _settings_under(**env: str):
    import os
    import subprocess
    import sys

    return subprocess.run(
        [sys.executable, "-c", "import django; django.setup(); from django.conf import settings; "
                               "print(settings.DATABASE_PREPARED_STATEMENTS)"],
        env={**os.environ, "DJANGO_SETTINGS_MODULE": "refundops.settings", **env}, capture_output=True, text=True)


@pytest.mark.parametrize(("pooler", "prepared"), [("", "0"), ("none", "100"), ("pgbouncer-session", "100"),
                                                  ("pgbouncer-transaction", "0")])
def test_prepared_statements_are_on_by_default_only_where_the_pooler_is_known_to_keep_them(pooler, prepared):
    ran = _settings_under(DATABASE_POOLER=pooler)
    assert (ran.returncode, ran.stdout.strip()) == (0, prepared), ran.stderr[-2000:]


def test_prepared_statements_behind_pgbouncer_in_transaction_mode_refuse_to_start_with_one_line_saying_why():
    ran = _settings_under(DATABASE_POOLER="pgbouncer-transaction", DATABASE_PREPARED_STATEMENTS="32")
    assert ran.returncode != 0
    assert ran.stderr.strip().splitlines()[-1] == (
        "django.core.exceptions.ImproperlyConfigured: DATABASE_PREPARED_STATEMENTS=32 cannot work behind "
        "DATABASE_POOLER=pgbouncer-transaction (a prepared statement stays on one server session, PgBouncer moves "
        "the next transaction to another): set DATABASE_PREPARED_STATEMENTS=0.")
    ran = _settings_under(DATABASE_POOLER="pgbouncer-txn")
    assert ran.returncode != 0 and "DATABASE_POOLER='pgbouncer-txn' is not one of" in ran.stderr.strip().splitlines()[-1]
