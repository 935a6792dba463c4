"""Statements that need no answer yet, sent with the next one: fewer round trips to PostgreSQL,
through psycopg's pipeline mode.

Inside ``batch()`` (opened right inside a transaction's outermost ``atomic()``) the connection is in
pipeline mode. A statement given to ``defer`` is queued on a cursor of its own and not waited for;
every statement Django executes is followed by a sync, so it answers (rows, row count, or its error)
before its caller reads it, and whatever was deferred before it leaves in the same round trip. A
SAVEPOINT or RELEASE SAVEPOINT is not synced: it rides with the statement after it (and when
deferred statements wait, they are synced first, so an error of theirs is never taken for one
inside the savepoint). A statement that fails aborts the rest of its round trip: the error is
raised by the execute() that carried it (or by the end of the block) and the transaction rolls
back whole, as for any failed statement.

The end of the block leaves the pipeline, which sends what waits and reads it back; each deferred
statement's ``then`` runs then, and only then does ``atomic()`` send the COMMIT: nothing of ours runs
between the COMMIT and the answer (issue 30), and a ``then`` that raises rolls the transaction back.
psycopg sends BEGIN in a round trip of its own (in pipeline mode as outside it).

Prepared statements are psycopg's own (server-side binding, ``prepare_threshold``; settings.py,
``DATABASE_PREPARED_STATEMENTS``): a connection prepares a statement it has run that many times,
whether Django or ``defer`` sends it, and keeps at most the setting's count (least recently used
deallocated); psycopg forgets them on a ROLLBACK or DISCARD ALL.

Elsewhere (SQLite, outside a batch) ``defer`` executes at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from django.conf import settings
from django.db import transaction
from django.db.backends.signals import connection_created

Then = Callable[[Any], None]  # given the cursor on the statement's own result


def _prepare_as_set(sender, connection, **kwargs) -> None:
    """psycopg's prepared statements on each new connection, as the settings say (read now, so a
    test's override counts): ``prepare_threshold`` None prepares nothing."""
    if connection.vendor == "postgresql":
        count = settings.DATABASE_PREPARED_STATEMENTS
        connection.connection.prepare_threshold = settings.DATABASE_PREPARE_THRESHOLD if count > 0 else None
        connection.connection.prepared_max = max(count, 1)


connection_created.connect(_prepare_as_set, dispatch_uid="refundops.batching.prepared")


class _Batch:
    def __init__(self, connection, pipeline) -> None:
        self.connection = connection
        self.raw = connection.connection  # psycopg's
        self.pipeline = pipeline
        self.waiting: list[tuple[Any, Then | None]] = []  # deferred, sent or queued, not answered

    def add(self, sql: str, params: Any, then: Then | None) -> None:
        cursor = self.raw.cursor()
        with self.connection.wrap_database_errors:
            cursor.execute(sql, params)  # queued: psycopg binds it now, sends it with the next sync
        self.waiting.append((cursor, then))

    # The execute wrapper (Django's database instrumentation): each of Django's statements answers.
    def __call__(self, execute, sql, params, many, context):
        savepoint = sql.startswith(("SAVEPOINT ", "RELEASE SAVEPOINT "))
        if savepoint and self.waiting:
            self.sync()
        result = execute(sql, params, many, context)
        if not savepoint:
            self.sync()
        return result

    def sync(self) -> None:
        """Send what is queued and wait for it; then the deferred statements' ``then``s, in order."""
        waiting, self.waiting = self.waiting, []
        try:
            with self.connection.wrap_database_errors:
                self.pipeline.sync()
            for cursor, then in waiting:
                if then is not None:
                    then(cursor)
        finally:
            for cursor, _ in waiting:
                cursor.close()


@contextmanager
def batch() -> Iterator[None]:
    """Defer what ``defer`` is given, and savepoints, until the next statement or the end of the
    block. Open it as the last context of the outermost atomic() (``with transaction.atomic(),
    batch():``), so that nothing runs between its end and the commit."""
    connection = transaction.get_connection()
    if (connection.vendor != "postgresql" or not connection.in_atomic_block
            or getattr(connection, "refundops_batch", None) is not None):
        yield
        return
    connection.ensure_connection()
    # Leaving the pipeline sends what waits (psycopg's Sync) and reads each result back; a failed
    # statement raises there, as Django's error.
    with connection.wrap_database_errors, connection.connection.pipeline() as pipeline:
        current = connection.refundops_batch = _Batch(connection, pipeline)
        try:
            with connection.execute_wrapper(current):
                yield
        finally:
            del connection.refundops_batch
    try:
        if not (transaction.get_rollback() or connection.closed_in_transaction):
            for cursor, then in current.waiting:  # before atomic() commits: one that raises rolls back
                if then is not None:
                    then(cursor)
    finally:
        for cursor, _ in current.waiting:
            cursor.close()


def defer(sql: str, params: Any = None, *, then: Then | None = None) -> None:
    """Run ``sql`` in this transaction with the next statement, or at the end of the batch; ``then``
    gets the cursor on its result, before the transaction commits. Outside a batch (or not on
    PostgreSQL), at once."""
    current = getattr(transaction.get_connection(), "refundops_batch", None)
    if current is not None:
        current.add(sql, params, then)
        return
    with transaction.get_connection().cursor() as cursor:
        cursor.execute(sql, params)
        if then is not None:
            then(cursor)


def send() -> None:
    """What waits in this connection's batch, now (before something that must not carry it)."""
    current = getattr(transaction.get_connection(), "refundops_batch", None)
    if current is not None:
        current.sync()
