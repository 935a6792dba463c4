"""Prepared statements are psycopg's own (server-side binding, ``prepare_threshold``;
refundops/batching.py, settings.py): a statement a connection has run DATABASE_PREPARE_THRESHOLD
times is prepared at the protocol level and executed by name after; a connection keeps at most
DATABASE_PREPARED_STATEMENTS; 0 prepares none; a failed refund, a new connection or a migration
leaves the next request working."""

from __future__ import annotations

import pytest
from django.db import DatabaseError, connection

from bench.wire import on_the_wire
from refundops.celery import app as celery_app
from refundops.services import refunds
from refundops.tasks import submit_refund
from tests.conftest import make_payment, post

pytestmark = pytest.mark.django_db(transaction=True)  # real BEGIN and COMMIT, as in production


@pytest.fixture(autouse=True)
def _as_deployed(monkeypatch, settings):
    """Tasks to the broker, not run eagerly here: the request's own statements only. Straight to
    PostgreSQL (DATABASE_POOLER=none: scripts/test), prepared statements on."""
    monkeypatch.setattr(submit_refund, "apply_async", lambda **options: None)
    monkeypatch.setitem(celery_app.conf, "task_always_eager", False)
    settings.DATABASE_PREPARED_STATEMENTS, settings.DATABASE_PREPARE_THRESHOLD = 100, 5
    connection.close()  # the next connection takes the settings


def server_names() -> list[str]:
    """The statements this connection's session holds prepared, by name."""
    connection.ensure_connection()
    with connection.connection.cursor() as cursor:  # psycopg's own: not through the wrappers
        cursor.execute("SELECT name FROM pg_prepared_statements ORDER BY name")
        return [row[0] for row in cursor.fetchall()]


def executed_by_name(wire) -> int:
    """Statements the block executed by a prepared statement's name (psycopg's Bind to it)."""
    return sum(1 for line in wire.lines if line.split("\t")[2:3] == ["Bind"] and '"_pg3_' in line)


def approved(api, payment=None, **body):
    payment = payment or make_payment(amount=5_000)
    return post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 1_250,
                                         "reason": "customer_request", **body})


# The key, the idempotency claim, the payment, the policy, the scope locks, the totals, the refund
# with its history, the merchant endpoints, the payment's sums, the verdict, the outbox rows, the
# audit entry, the stored answer: every statement an approved refund sends but BEGIN, COMMIT and the
# savepoint's two (named anew each time), the two outbox rows' INSERT being one text.
HOT = 13


def test_an_approved_refund_sends_its_statements_prepared_once_the_connection_has_run_them_five_times(api, policy):
    payments = [make_payment(amount=5_000) for _ in range(7)]
    connection.close()
    with on_the_wire(connection) as first:
        assert approved(api, payments[0]).status_code == 201
    assert executed_by_name(first) == 0, first.trips  # not yet: psycopg counts
    for payment in payments[1:5]:
        assert approved(api, payment).status_code == 201
    with on_the_wire(connection) as sixth:
        assert approved(api, payments[5]).status_code == 201
    held = server_names()
    assert len(held) >= HOT and all(name.startswith("_pg3_") for name in held), held
    with on_the_wire(connection) as seventh:
        assert approved(api, payments[6]).status_code == 201
    assert executed_by_name(seventh) >= HOT, seventh.trips
    assert server_names() == held  # the same ones, executed again
    # Preparing costs a round trip only outside a pipeline (the key's read), once a connection.
    assert (sixth.round_trips, seventh.round_trips) == (11, 10)


def test_a_connection_keeps_at_most_the_setting(scratch, settings):
    settings.DATABASE_PREPARED_STATEMENTS, settings.DATABASE_PREPARE_THRESHOLD = 2, 0
    connection.close()
    statements = [f"SELECT {i} + count(*) FROM {scratch} WHERE n >= %s" for i in range(4)]
    for _ in range(2):
        for i, sql in enumerate(statements):
            with connection.cursor() as cursor:
                cursor.execute(sql, [0])
                assert cursor.fetchone()[0] == i
            assert len(server_names()) <= 2
    with connection.cursor() as cursor, on_the_wire(connection) as wire:
        cursor.execute(statements[3], [0])  # the most recent: still prepared
    assert executed_by_name(wire) == 1


def test_zero_prepares_none(api, policy, settings):
    settings.DATABASE_PREPARED_STATEMENTS = 0
    connection.close()
    for _ in range(7):
        with on_the_wire(connection) as wire:
            assert approved(api).status_code == 201
    assert executed_by_name(wire) == 0 and server_names() == []


def test_a_new_connection_prepares_again(api, policy):
    for _ in range(6):
        assert approved(api).status_code == 201
    connection.close()  # as CONN_MAX_AGE, a failed health check, or a restart of PostgreSQL
    assert server_names() == []
    for _ in range(6):
        assert approved(api).status_code == 201
    assert len(server_names()) >= HOT


def test_a_refund_failing_in_the_round_trip_that_prepares_leaves_the_next_request_on_its_connection_working(
        api, policy, monkeypatch):
    """The refund's INSERT with its history fails in the round trip that prepares it and the statements
    after it (the connection's sixth refund): those prepares never run, and psycopg forgets them with
    the ROLLBACK. The next requests on the same connection are approved."""
    for _ in range(5):
        assert approved(api).status_code == 201
    insert = refunds._insert_with_history

    def too_long(refund, rows):
        refund.currency = "USDX"  # varchar(3): the INSERT fails
        return insert(refund, rows)

    api.raise_request_exception = False
    with monkeypatch.context() as patched:
        patched.setattr(refunds, "_insert_with_history", too_long)
        assert approved(api).status_code == 500
    assert approved(api).status_code == 201
    assert approved(api).status_code == 201


@pytest.fixture
def widened():
    """A migration's ALTER ... TYPE on a column the hot statements return (a CharField's max_length
    raised), undone afterwards."""
    from refundops.models import AgentKey, Payment
    columns = [(AgentKey._meta.db_table, "key_hash", 64), (Payment._meta.db_table, "processor_reference", 100)]

    def widen(table, column, length):
        connection.ensure_connection()
        with connection.connection.cursor() as cursor:  # psycopg's own: not through the wrappers
            cursor.execute(f"ALTER TABLE {table} ALTER COLUMN {column} TYPE varchar({length})")

    yield lambda: [widen(table, column, length + 1) for table, column, length in columns]
    connection.close()
    for table, column, length in columns:
        widen(table, column, length)
    connection.close()


def test_a_column_a_prepared_statement_returns_changed_by_a_migration_heals(api, policy, widened):
    """PostgreSQL refuses every EXECUTE of a statement prepared before a column it returns changed
    type ('cached plan must not change result type'), until it is deallocated: a migration widening a
    CharField would otherwise fail every request on every connection kept (CONN_MAX_AGE, the pool)
    until it closes. A request inside a transaction fails at most once: psycopg forgets a connection's
    statements (DEALLOCATE ALL) with the ROLLBACK, so the next goes through."""
    for _ in range(8):
        assert approved(api).status_code == 201  # prepared, and past the first executions: generic plans
    widened()
    try:  # the payment's read in the refund's transaction: this one may fail
        approved(api)
    except DatabaseError:
        pass
    assert approved(api).status_code == 201
    assert approved(api).status_code == 201
