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
