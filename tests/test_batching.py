"""refundops.batching: statements sent with the next one keep their order, their errors and their
transaction; and a refund whose batched writes fail leaves nothing behind."""

from __future__ import annotations

import uuid

import pytest
from django.db import DatabaseError, connection, transaction

from audit.models import AuditEntry, Verdict
from bench.wire import on_the_wire
from refundops import batching, idempotency
from refundops.models import IdempotencyRecord, OutboxMessage, Payment, Refund
from refundops.services import refunds
from tests.conftest import make_payment, post

pytestmark = pytest.mark.django_db(transaction=True)  # real BEGIN and COMMIT, as in production


def count(table: str) -> int:
    with connection.cursor() as cursor:
        cursor.execute(f"SELECT count(*) FROM {table}")
        return cursor.fetchone()[0]


def test_deferred_statements_ride_with_the_next_one_in_order_and_read_their_returning(scratch):
    ids: list[int] = []
    with on_the_wire(connection) as wire, transaction.atomic(), batching.batch():
        batching.defer(f"INSERT INTO {scratch} (n) VALUES (%s) RETURNING id", [1],
                       then=lambda cursor: ids.append(cursor.fetchone()[0]))
        batching.defer(f"INSERT INTO {scratch} (n, t) VALUES (%s, %s)", [5, "50% off, 'quoted'; and %s"])
        assert ids == []  # not sent yet
        with connection.cursor() as cursor:  # carries both, and sees them: the server runs them first
            cursor.execute(f"SELECT count(*), sum(n), max(t) FROM {scratch} WHERE n >= %s", [0])
            assert cursor.fetchone() == (2, 6, "50% off, 'quoted'; and %s")
        assert len(ids) == 1
        batching.defer(f"INSERT INTO {scratch} (n) VALUES (%s)", [7])  # left for the end of the block
    assert count(scratch) == 3
    # psycopg's BEGIN; the first two INSERTs with the SELECT; the third at the end of the block (the
    # pipeline's Sync); COMMIT. (Before pipeline mode: BEGIN rode with the first, COMMIT with the last,
    # psycopg set to autocommit behind Django's back: 2 round trips.)
    assert (wire.round_trips, wire.statements) == (4, 6), wire.trips
    assert [len(trip) for trip in wire.trips] == [1, 3, 1, 1], wire.trips


def test_a_failing_deferred_statement_raises_and_rolls_the_transaction_back(scratch):
    with pytest.raises(DatabaseError), transaction.atomic(), batching.batch():
        with connection.cursor() as cursor:
            cursor.execute(f"INSERT INTO {scratch} (n) VALUES (1)")
        batching.defer(f"INSERT INTO {scratch} (n) VALUES (%s)", [2])
        batching.defer(f"INSERT INTO {scratch} (n) VALUES (%s)", [-1])  # the CHECK refuses it
        batching.defer(f"INSERT INTO {scratch} (n) VALUES (%s)", [3])
    assert count(scratch) == 0
    # The connection is as Django left it: the next transaction, batched or not, works.
    with transaction.atomic(), batching.batch():
        batching.defer(f"INSERT INTO {scratch} (n) VALUES (%s)", [4])
    with transaction.atomic():
        with connection.cursor() as cursor:
            cursor.execute(f"INSERT INTO {scratch} (n) VALUES (5)")
    assert count(scratch) == 2


def test_savepoints_ride_too_and_still_undo_what_was_done_inside_them(scratch):
    with on_the_wire(connection) as wire, transaction.atomic(), batching.batch():
        with connection.cursor() as cursor:
            cursor.execute(f"INSERT INTO {scratch} (n) VALUES (1)")
        try:
            with transaction.atomic():  # SAVEPOINT rides with the INSERT below
                with connection.cursor() as cursor:
                    cursor.execute(f"INSERT INTO {scratch} (n) VALUES (2)")
                raise LookupError
        except LookupError:
            pass
        with transaction.atomic():  # undone above; this one is released with the next statement
            with connection.cursor() as cursor:
                cursor.execute(f"INSERT INTO {scratch} (n) VALUES (3)")
        with connection.cursor() as cursor:
            cursor.execute(f"SELECT array_agg(n ORDER BY n) FROM {scratch}")
            assert cursor.fetchone()[0] == [1, 3]
    assert count(scratch) == 2
    trips = [" ;".join(trip) for trip in wire.trips]
    assert any(t.startswith("SAVEPOINT") and "VALUES (2)" in t for t in trips), trips
    assert any(t.startswith("RELEASE SAVEPOINT") and "array_agg" in t for t in trips), trips


def test_deferred_writes_leave_before_a_savepoint_opens(scratch):
    """So that an error of theirs is never taken for one inside the savepoint (and undone with it)."""
    with on_the_wire(connection) as wire, pytest.raises(DatabaseError), transaction.atomic(), batching.batch():
        batching.defer(f"INSERT INTO {scratch} (n) VALUES (%s)", [-1])  # the CHECK refuses it
        with transaction.atomic():  # raises as it opens: the SAVEPOINT never leaves
            pytest.fail("the savepoint opened")
    assert not any(text.startswith("SAVEPOINT") for trip in wire.trips for text in trip), wire.trips
    assert count(scratch) == 0


def test_a_carrier_refused_before_it_leaves_takes_nothing_deferred_with_it(scratch):
    """A statement that fails before it is sent (a value psycopg cannot adapt) raises Django's error,
    as it would unbatched, and leaves what waited for it waiting: caught, the deferred INSERT and
    BEGIN still reach the server with the next statement and commit with the transaction. (Before:
    psycopg's own error, and the queue was dropped, so the block committed without that INSERT.)"""
    with transaction.atomic(), batching.batch():
        batching.defer(f"INSERT INTO {scratch} (n) VALUES (%s)", [1])
        with pytest.raises(DatabaseError, match="adapt"), connection.cursor() as cursor:
            cursor.execute("SELECT %s", [object()])
        with pytest.raises(DatabaseError, match="adapt"):
            batching.defer(f"INSERT INTO {scratch} (n, t) VALUES (%s, %s)", [5, object()])
        batching.defer(f"INSERT INTO {scratch} (n) VALUES (%s)", [2])
    assert count(scratch) == 2


def test_outside_a_batch_a_deferred_statement_runs_at_once(scratch):
    ids: list[int] = []
    with transaction.atomic():
        batching.defer(f"INSERT INTO {scratch} (n) VALUES (%s) RETURNING id", [1],
                       then=lambda cursor: ids.append(cursor.fetchone()[0]))
        assert len(ids) == 1
    assert count(scratch) == 1


def _too_long(field: str, size: int):
    def spoil(obj):
        setattr(obj, field, "x" * (size + 1))
        return obj
    return spoil


@pytest.mark.parametrize("spoiled", ["verdict", "audit entry", "stored answer"])
def test_an_error_in_one_batched_write_rolls_the_whole_refund_back(api, policy, monkeypatch, spoiled):
    """The writes after the decision leave in one round trip; one of them failing (first, middle or
    last of it) fails the request and leaves nothing of the refund: not the refund or its history,
    the verdict, the audit entry, the outbox rows, the idempotency record, nor the payment's sums."""
    post(api, "/api/v1/refunds", {"transaction_id": make_payment().pk, "amount": 100, "reason": "duplicate"})
    if spoiled == "verdict":
        fill = refunds._fill_verdict
        monkeypatch.setattr(refunds, "_fill_verdict", lambda *a: _too_long("policy_version", 40)(fill(*a)))
    elif spoiled == "audit entry":
        entry = refunds.new_audit_entry
        monkeypatch.setattr(refunds, "new_audit_entry", lambda **kw: _too_long("actor", 200)(entry(**kw)))
    else:
        store = idempotency.store
        monkeypatch.setattr(idempotency, "store", lambda scope, key, status, body: store(scope, key, -1, body))
    payment = make_payment(amount=5_000)
    outbox, audit = OutboxMessage.objects.count(), AuditEntry.objects.count()
    api.raise_request_exception = False
    key = uuid.uuid4().hex

    with on_the_wire(connection) as wire:
        response = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 1_250,
                                                 "reason": "customer_request"}, key=key)

    assert response.status_code == 500
    (failed,) = [" ;".join(trip) for trip in wire.failed_trips]
    # The batched writes leave as the block leaves the pipeline (psycopg sends them as the socket
    # takes them: under load some may follow in the next packet); the spoiled one fails, no COMMIT goes.
    table = {"verdict": '"audit_verdict"', "audit entry": '"audit_auditentry"',
             "stored answer": "refundops_idempotencyrecord"}[spoiled]
    assert table in failed, failed[:2000]
    assert not any(text == "COMMIT" for trip in wire.trips for text in trip), wire.trips
    assert not Refund.objects.filter(payment_id=payment.pk).exists()
    assert not Refund.history.filter(payment_id=payment.pk).exists()
    assert not Verdict.objects.filter(payment_id=payment.pk).exists()
    assert (OutboxMessage.objects.count(), AuditEntry.objects.count()) == (outbox, audit)
    assert not IdempotencyRecord.objects.filter(key=key).exists()
    assert Payment.objects.values_list("amount_reserved_minor", "amount_refunded_minor").get(pk=payment.pk) == (0, 0)

    monkeypatch.undo()  # the same request again, on the same connection, now goes through
    response = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 1_250,
                                             "reason": "customer_request"}, key=key)
    assert response.status_code == 201 and response.json()["deduplicated"] is False
    assert Refund.objects.filter(payment_id=payment.pk).count() == 1


def test_a_statement_that_never_left_leaves_the_statements_after_it_in_the_transaction(scratch):
    """A carrier that fails before it is sent (a value psycopg cannot adapt) leaves BEGIN waiting:
    the statements after it still run inside the transaction, and roll back with it."""
    with pytest.raises(LookupError), transaction.atomic(), batching.batch():
        with pytest.raises(Exception, match="adapt"), connection.cursor() as cursor:
            cursor.execute("SELECT %s", [object()])
        with connection.cursor() as cursor:
            cursor.execute(f"INSERT INTO {scratch} (n) VALUES (1)")
        raise LookupError
    assert count(scratch) == 0


def test_a_batched_commit_the_server_refuses_raises_and_leaves_the_connection_as_django_expects():
    """A COMMIT the server refuses (a deferred foreign key) after the batch still raises, leaves nothing,
    and the connection is back in Django's autocommit with psycopg agreeing, ready for the next one."""
    with connection.cursor() as cursor:
        cursor.execute("CREATE TABLE batching_parent (id int PRIMARY KEY)")
        cursor.execute("CREATE TABLE batching_child (parent int REFERENCES batching_parent DEFERRABLE INITIALLY DEFERRED)")
    try:
        with on_the_wire(connection) as wire, pytest.raises(DatabaseError), transaction.atomic(), batching.batch():
            batching.defer("INSERT INTO batching_child (parent) VALUES (%s)", [1])  # no parent 1: refused at COMMIT
        assert wire.failed_trips == [["COMMIT"]], wire.trips
        assert any("INSERT INTO batching_child" in text for text in wire.trips[-2]), wire.trips
        assert count("batching_child") == 0
        assert connection.get_autocommit() and connection.connection.autocommit
        with transaction.atomic(), batching.batch():
            batching.defer("INSERT INTO batching_parent (id) VALUES (%s)", [1])
            batching.defer("INSERT INTO batching_child (parent) VALUES (%s)", [1])
        assert count("batching_child") == 1
    finally:
        with connection.cursor() as cursor:
            cursor.execute("DROP TABLE batching_child, batching_parent")


def test_no_commit_rides_when_django_is_to_roll_back_or_inside_an_outer_transaction(scratch):
    with transaction.atomic(), batching.batch():
        batching.defer(f"INSERT INTO {scratch} (n) VALUES (%s)", [1])
        transaction.set_rollback(True)  # as after an error caught in a block Django could not undo
    assert count(scratch) == 0
    with on_the_wire(connection) as wire, transaction.atomic():
        with transaction.atomic(), batching.batch():  # in a savepoint: the outer block commits
            batching.defer(f"INSERT INTO {scratch} (n) VALUES (%s)", [2])
        assert not any("COMMIT" in text for trip in wire.trips for text in trip), wire.trips
        transaction.set_rollback(True)
    assert count(scratch) == 0


class _Refused(Exception):
    pass


def test_a_callback_that_raises_leaves_nothing_committed(scratch):
    """Issue 30, finding 2: a deferred statement's ``then`` runs before the COMMIT leaves, never after
    it: one that raises rolls the transaction back, so an error never stands for a committed change."""

    def refuse(cursor) -> None:
        raise _Refused

    with pytest.raises(_Refused), transaction.atomic(), batching.batch():
        batching.defer(f"INSERT INTO {scratch} (n) VALUES (%s) RETURNING id", [1], then=refuse)
    assert count(scratch) == 0


def test_a_refund_whose_outbox_callback_raises_answers_an_error_only_when_nothing_committed(api, policy, monkeypatch):
    """A refund answered with an error must not have committed (a retry with its key would replay 201)."""
    from refundops import outbox

    post(api, "/api/v1/refunds", {"transaction_id": make_payment().pk, "amount": 100, "reason": "duplicate"})
    payment = make_payment(amount=5_000)

    def refuse(ids) -> None:
        raise _Refused

    monkeypatch.setattr(outbox, "_nudge_after_commit", refuse)
    with pytest.raises(_Refused):
        post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 1_250, "reason": "customer_request"})
    assert not Refund.objects.filter(payment_id=payment.pk).exists()
    assert Payment.objects.values_list("amount_reserved_minor", flat=True).get(pk=payment.pk) == 0
