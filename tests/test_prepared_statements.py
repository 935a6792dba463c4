"""refundops.batching's prepared statements: the statements every refund sends go as EXECUTE of a
statement prepared once a connection; they answer exactly what the statement sent as it is answers;
an error, a dropped batch, a new, reset or pooled connection never leaves a name executed before its
PREPARE ran, nor prepared twice; and a connection keeps at most DATABASE_PREPARED_STATEMENTS."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from decimal import Decimal

import pytest
from django.db import DatabaseError, connection, transaction
from django.utils import timezone

from bench.wire import on_the_wire
from refundops import batching, outbox
from refundops.celery import app as celery_app
from refundops.models import Refund
from refundops.services import refunds
from refundops.tasks import submit_refund
from tests.conftest import make_payment, post

pytestmark = pytest.mark.django_db(transaction=True)  # real BEGIN and COMMIT, as in production

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _as_deployed(monkeypatch):
    """Tasks to the broker, not run eagerly here: the request's own statements only."""
    monkeypatch.setattr(submit_refund, "apply_async", lambda **options: None)
    monkeypatch.setitem(celery_app.conf, "task_always_eager", False)


def server_names() -> list[str]:
    """The statements this connection's session holds prepared, by name."""
    with connection.connection.cursor() as cursor:  # psycopg's own: not through the wrappers
        cursor.execute("SELECT name FROM pg_prepared_statements ORDER BY name")
        return [row[0] for row in cursor.fetchall()]


def queries(wire) -> list[str]:
    return [line for line in wire.lines if "\tQuery\t" in line]


def approved(api, payment=None, **body):
    payment = payment or make_payment(amount=5_000)
    return post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 1_250,
                                         "reason": "customer_request", **body})


def test_an_approved_refund_sends_its_hot_statements_prepared_once_a_connection(api, policy):
    connection.close()  # a new connection: nothing prepared yet
    with on_the_wire(connection) as first:
        assert approved(api).status_code == 201
    sent = "\n".join(queries(first))
    # The key, the payment, the policy, the scope locks, the totals, the refund with its history,
    # the merchant endpoints, the payment's sums.
    assert sent.count("PREPARE refundops_") == sent.count("EXECUTE refundops_") == 8, sent
    held = server_names()
    assert len(held) == 8 and all(name.startswith("refundops_") for name in held)
    with on_the_wire(connection) as second:
        assert approved(api).status_code == 201
    sent = "\n".join(queries(second))
    assert "PREPARE" not in sent and sent.count("EXECUTE refundops_") == 8, sent
    assert server_names() == held  # the same eight, executed again


def test_each_hot_statement_answers_exactly_what_it_answers_sent_as_it_is(api, policy, monkeypatch):
    """Every marked statement of an approved refund, with the parameters it was sent with, run once
    prepared (Django's cursor) and once as psycopg's client-side binding sends it, each in a
    transaction rolled back: the same rows, column types and row count."""
    assert approved(api).status_code == 201  # the key's first use is stamped: not the steady state
    sent: list[tuple[str, object]] = []
    statement = batching._Prepared.statement
    request_thread = threading.get_ident()

    def recorded(self, sql, params):
        if threading.get_ident() == request_thread:  # not the outbox's sender, still on the first refund's rows
            sent.append((sql, params))
        return statement(self, sql, params)

    payment = make_payment(amount=5_000)
    with monkeypatch.context() as patched:
        patched.setattr(batching._Prepared, "statement", recorded)
        assert approved(api, payment).status_code == 201
    assert len(sent) == 8
    Refund.objects.filter(payment=payment).delete()  # its INSERT may run again
    for sql, params in sent:
        answers = {}
        for how in ("as it is", "prepared"):
            with transaction.atomic(), on_the_wire(connection) as wire:
                if how == "as it is":  # psycopg's client-side binding cursor, as Django's sends it
                    cursor = connection.connection.cursor()
                    cursor.execute(sql, params)
                else:
                    django_cursor = connection.cursor()
                    django_cursor.execute(sql, params)
                    cursor = django_cursor.cursor
                answers[how] = (cursor.rowcount, [(c.name, c.type_code) for c in cursor.description or ()],
                                cursor.fetchall() if cursor.description else None)
                transaction.set_rollback(True)
            sent = "\n".join(queries(wire))
            assert ("EXECUTE refundops_" in sent) == (how == "prepared"), sent[:300]
        assert answers["prepared"] == answers["as it is"], sql[:200]
        assert answers["prepared"][0] >= 0


@pytest.mark.parametrize("value,declared", [
    (5, "integer"), (-5, "integer"), (2**40, "bigint"), (2**70, "numeric"), (1.5, "numeric"),
    (Decimal("1.50"), "numeric"), ("it's", "unknown"), ("a\\b", "unknown"), (None, "unknown"), (True, "boolean"),
    (["a", "b"], "unknown"), ([2**40], "int8[]"), ({"a": 1}, None),
])
def test_each_parameter_is_declared_of_the_type_its_literal_has(value, declared):
    from psycopg.types.json import Jsonb

    connection.ensure_connection()
    literals = batching.Transformer(connection.connection)
    value = Jsonb(value) if isinstance(value, dict) else value
    literal = literals.as_literal(value) if value is not None else b"NULL"
    assert batching._declared(literal) == (declared or "jsonb")
    with connection.connection.cursor() as cursor:  # PostgreSQL agrees: the literal's own type
        cursor.execute(b"SELECT pg_typeof(" + literal + b")::text")
        assert cursor.fetchone()[0] == {"integer": "integer", "bigint": "bigint", "numeric": "numeric",
                                        "unknown": "unknown", "boolean": "boolean", "int8[]": "bigint[]",
                                        None: "jsonb"}[declared]


def test_a_failed_round_trip_that_carried_prepares_is_forgotten_and_the_next_one_works(scratch):
    """A deferred statement fails ahead of a PREPARE in the same query: the PREPARE never ran. Another
    fails after one: it ran. Either way the next use of the statement on this connection works,
    after a DEALLOCATE ALL: never 'does not exist', never 'already exists'."""
    read = batching.prepared(f"SELECT count(*) FROM {scratch} WHERE n >= %s")
    insert = batching.prepared(f"INSERT INTO {scratch} (n, t) VALUES (%s, %s)")
    fresh = batching.prepared(f"INSERT INTO {scratch} (n, t) VALUES (%s, 'fresh')")
    connection.close()
    for attempt in range(2):
        with pytest.raises(DatabaseError), transaction.atomic(), batching.batch():
            if attempt == 0:
                batching.defer(insert, [-1, "refused ahead of the PREPARE"])  # the CHECK refuses it
                with connection.cursor() as cursor:
                    cursor.execute(read, [0])  # PREPARE, EXECUTE after the failing INSERT: not run
            else:
                batching.defer(fresh, [5])  # prepared in this trip: its PREPARE runs ...
                batching.defer(insert, [-2, "refused after it"])  # ... then this fails
                with connection.cursor() as cursor:
                    cursor.execute(read, [0])
        with on_the_wire(connection) as wire, transaction.atomic(), batching.batch():
            batching.defer(insert, [attempt, "after"])
            with connection.cursor() as cursor:
                cursor.execute(read, [0])
                assert cursor.fetchone()[0] == attempt + 1
        sent = "\n".join(queries(wire))
        assert "DEALLOCATE ALL" in sent and sent.count("PREPARE refundops_") == 2, sent
    assert len(server_names()) == 2


def test_a_batch_left_before_its_prepares_were_sent_is_forgotten(scratch):
    insert = batching.prepared(f"INSERT INTO {scratch} (n) VALUES (%s)")
    with pytest.raises(LookupError), transaction.atomic(), batching.batch():
        batching.defer(insert, [1])  # queued with its PREPARE, never sent
        raise LookupError
    with transaction.atomic(), batching.batch():
        batching.defer(insert, [2])
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT array_agg(n) FROM {scratch}")
        assert cursor.fetchone()[0] == [2]


def test_a_session_reset_behind_the_connections_back_heals_on_its_next_read(api, policy):
    """A pooler's DISCARD ALL (or anyone's DEALLOCATE ALL) between requests: the key's read, outside
    any transaction, finds its statement gone, forgets every name and is sent again (prepared anew);
    so the request, and every one after it, goes through."""
    assert approved(api).status_code == 201
    with connection.connection.cursor() as cursor:
        cursor.execute("DISCARD ALL")
    assert server_names() == []
    assert approved(api).status_code == 201
    assert len(server_names()) == 8
    assert approved(api).status_code == 201


def test_a_statement_healed_after_a_reset_leaves_django_nothing_to_distrust():
    """The failed first try of a statement healed outside a transaction (the outbox's sender marks
    its batch so, no COMMIT after it) is not an error of the connection: Django, seeing one, would
    check the connection once at the next ``close_old_connections`` and then skip its next health
    check (``health_check_done``), so a connection cut after that went unnoticed until a statement
    failed on it (the sender then left its batch to the relay)."""
    mark = [timezone.now(), [0]]
    with connection.cursor() as cursor:
        cursor.execute(outbox._SENT_SQL, mark)
        connection.connection.execute("DISCARD ALL")
        assert server_names() == []
        cursor.execute(outbox._SENT_SQL, mark)  # healed: prepared anew
    assert len(server_names()) == 1
    assert connection.errors_occurred is False


def test_a_new_connection_prepares_again(api, policy):
    assert approved(api).status_code == 201
    connection.close()  # as CONN_MAX_AGE, a failed health check, or a restart of PostgreSQL
    assert approved(api).status_code == 201
    assert len(server_names()) == 8


def test_a_connection_keeps_at_most_the_setting(scratch, settings):
    settings.DATABASE_PREPARED_STATEMENTS = 2
    connection.close()
    statements = [batching.prepared(f"SELECT {i} + count(*) FROM {scratch} WHERE n >= %s") for i in range(4)]
    for rounds in range(2):
        for i, sql in enumerate(statements):
            with connection.cursor() as cursor:
                cursor.execute(sql, [0])
                assert cursor.fetchone()[0] == i
            assert len(server_names()) <= 2
    with connection.cursor() as cursor, on_the_wire(connection) as wire:
        cursor.execute(statements[3], [0])  # the most recent: still prepared
    assert "PREPARE" not in "\n".join(queries(wire))


def test_zero_sends_them_as_they_are(api, policy, settings):
    settings.DATABASE_PREPARED_STATEMENTS = 0
    connection.close()
    with on_the_wire(connection) as wire:
        assert approved(api).status_code == 201
    assert "EXECUTE" not in "\n".join(queries(wire)) and server_names() == []


def test_a_refund_failing_in_the_round_trip_that_prepares_leaves_the_next_request_on_its_connection_working(
        api, policy, monkeypatch):
    """On a new connection the refund's INSERT with its history (prepared there) fails in the round
    trip that also prepares the merchant endpoints' read and the payment's sums: those PREPAREs never
    run. The next request on the same connection is approved."""
    connection.close()
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


POOLED = """
import json, threading
import refundops.asgi  # noqa: F401 - the ASGI entry point: a psycopg pool
from django.db import DatabaseError, connection, transaction
from refundops import batching

answers, pids = [], []
read = batching.prepared("SELECT %s::int + 1, pg_backend_pid()")
fails = batching.prepared("SELECT 1 / %s")

def one_request(i):  # as under ASGI: a thread of its own, its connection back to the pool after
    try:
        if i == 2:  # a failed batch that prepared: the pooled connection must forget it
            try:
                with transaction.atomic(), batching.batch():
                    with connection.cursor() as cursor:
                        cursor.execute(fails, [0])
            except DatabaseError:
                pass
        with connection.cursor() as cursor:
            cursor.execute(read, [i])
            answer, pid = cursor.fetchone()
        with connection.connection.cursor() as cursor:
            cursor.execute("SELECT count(*) FROM pg_prepared_statements")
            held = cursor.fetchone()[0]
        answers.append([answer, held])
        pids.append(pid)
    finally:
        connection.close()

for i in range(5):
    thread = threading.Thread(target=one_request, args=(i,))
    thread.start()
    thread.join()
print(json.dumps({"answers": answers, "pids": pids}))
"""


def test_a_pooled_connection_keeps_its_statements_across_checkouts(django_db_blocker):
    from tests.test_connection_reuse import database_url

    environment = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_POOL", "DATABASE_CONN"))}
    environment.update(DATABASE_URL=database_url(), DATABASE_POOL_MIN="1", DATABASE_POOL_MAX="1")
    out = subprocess.run([sys.executable, "-c", POOLED], cwd=ROOT, env=environment, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    found = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(set(found["pids"])) == 1  # one session, checked out five times
    # Prepared once (one held), again after the failed batch's DEALLOCATE ALL (one held, not two).
    assert found["answers"] == [[1, 1], [2, 1], [3, 1], [4, 1], [5, 1]]


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
    until it closes. The key's read, outside a transaction, is sent again after a DEALLOCATE ALL; the
    payment's read, inside the refund's transaction, fails that one request at most, and the
    connection forgets its names, so the next goes through."""
    assert approved(api).status_code == 201
    assert approved(api).status_code == 201  # past the first executions: generic plans
    widened()
    try:  # the payment's read in the refund's transaction: this one may fail
        approved(api)
    except DatabaseError:
        pass
    assert approved(api).status_code == 201
    assert approved(api).status_code == 201


def test_a_name_prepared_by_another_client_on_the_same_session_is_never_taken_for_ones_own(scratch):
    """Behind a pooler that hands one server session to several clients (PgBouncer's transaction
    mode, with DATABASE_PREPARED_STATEMENTS left on), a client may find on its session names another
    client prepared. Names drawn the same way by every connection (refundops_1_<table>, ...) then
    name another statement there, with the same parameters: its EXECUTE would run that one and
    answer wrongly without an error (the scope locks of another currency, the payment unlocked).
    Each connection's names are its own: the EXECUTE finds no such statement (an error, healed as a
    session reset is), never another client's."""
    from django.db import connections

    read_a = batching.prepared(f"SELECT 'a' FROM {scratch} WHERE n >= %s")
    read_b = batching.prepared(f"SELECT 'b' FROM {scratch} WHERE n >= %s")
    with connection.cursor() as cursor:
        cursor.execute(f"INSERT INTO {scratch} (n) VALUES (1)")
    other = connections.create_connection("default")
    try:
        connection.close()
        with connection.cursor() as cursor:  # this client prepares read_a first on its session
            cursor.execute(read_a, [0])
            assert cursor.fetchone() == ("a",)
        with other.cursor() as cursor:  # another client prepares read_b first on its own
            cursor.execute(read_b, [0])
            assert cursor.fetchone() == ("b",)
        # The pooler now gives the other client's next transactions this client's session.
        mine, theirs = connection.connection, other.connection
        mine.refundops_prepared, theirs.refundops_prepared = theirs.refundops_prepared, mine.refundops_prepared
        try:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute(read_b, [0])
                answer = cursor.fetchone()
        except DatabaseError:  # not on this session: this request fails, the names are forgotten
            answer = None
        assert answer != ("a",)  # never the other statement's answer
        with connection.cursor() as cursor:
            cursor.execute(read_b, [0])
            assert cursor.fetchone() == ("b",)
    finally:
        other.close()
