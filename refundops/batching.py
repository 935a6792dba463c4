"""Statements that need no answer yet, sent with the next one: fewer round trips to PostgreSQL.

Inside ``batch()`` (opened right inside a transaction's outermost ``atomic()``) a statement given to
``defer`` is not sent at once: it goes ahead of the next statement this connection executes, in
the same round trip, or at the end of the block, with the COMMIT. The transaction's BEGIN, and
Django's SAVEPOINT and RELEASE SAVEPOINT, wait the same way. psycopg's client-side binding cursor
(Django's default) sends several statements separated by semicolons as one query and keeps a
result for each (``nextset()``); a deferred statement's ``then`` reads its result (a RETURNING)
once the round trip is back.

The server still runs every statement in the order the code issued it; only the moment each
leaves changes. A statement that fails fails the whole query: the error is raised by the
execute() that carried it (or by the end of the block) and the transaction rolls back whole, as
for any failed statement. So that such an error is never taken for another statement's, nothing
may open a savepoint while deferred statements wait (``batch`` refuses it), and the block is left
before the ``atomic()`` around it, with nothing in between that catches database errors.

BEGIN: psycopg sends it in a round trip of its own before a transaction's first statement. In a
batch it rides with that statement instead: psycopg is set to autocommit for the transaction (it
then sends no BEGIN of its own) while the server holds it open; ROLLBACK is still sent when Django
asks, since psycopg looks at the server's transaction status. COMMIT: the block ends right before
the outermost ``atomic()`` commits, so the COMMIT leaves with what waits, and the commit Django then
asks psycopg for finds the transaction ended (psycopg does nothing then). Not when Django is to roll
back (``needs_rollback``), nor inside an outer transaction. A COMMIT the server refuses (a deferred
constraint) raises from the end of the block, and ``atomic()`` rolls back as when its own fails.

Elsewhere (SQLite, PostgreSQL with server-side binding, outside a batch) ``defer`` executes at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from django.db import transaction
from psycopg.pq import TransactionStatus

Then = Callable[[Any], None]  # given the cursor on the statement's own result


class _Batch:
    def __init__(self, connection) -> None:
        self.connection = connection
        self.raw = connection.connection  # psycopg's
        self.binder = self.raw.cursor()  # a ClientCursor: binds deferred statements' parameters
        self.queue: list[tuple[str, Then | None]] = []
        self.deferred = 0  # statements queued by defer() (not BEGIN nor savepoints), not yet sent
        self.begins = False  # BEGIN is queued, psycopg in autocommit for it

    def add(self, sql: str, params: Any = None, then: Then | None = None, *, control: bool = False) -> None:
        self.queue.append((self._bind(self.binder, sql, params), then))
        self.deferred += not control

    def _bind(self, cursor, sql: str, params: Any) -> str:
        """``sql`` with ``params`` merged in (psycopg adapts each value), or raising Django's error
        for a value it cannot adapt, as execute() would."""
        if params is None:
            return sql
        with self.connection.wrap_database_errors:
            return cursor.mogrify(sql, params)

    # The execute wrapper (Django's database instrumentation): the queue rides with every statement.
    def __call__(self, execute, sql, params, many, context):
        if not self.queue:
            return execute(sql, params, many, context)
        cursor = context["cursor"].cursor
        if many or isinstance(cursor, psycopg.ServerCursor):  # one statement only: the queue goes first
            self.send()
            return execute(sql, params, many, context)
        # Bound here as psycopg would, so that the queue is not parsed again; before the queue is
        # taken, so that a value refused leaves it (and BEGIN) waiting for the next statement.
        sql = self._bind(cursor, sql, params)
        with self._sending() as (queue, prefix):
            result = execute(prefix + sql, None, many, context)
        self._answer(cursor, queue)
        return result

    def send(self) -> None:
        """The queue in a round trip of its own (the end of the block)."""
        if self.queue:
            with self._sending() as (queue, sql), self.connection.cursor() as cursor:  # Django's: logged
                cursor.execute(sql.removesuffix(";\n"))
                self._answer(cursor.cursor, queue)

    @contextmanager
    def _sending(self) -> Iterator[tuple[list[tuple[str, Then | None]], str]]:
        queue, begins = self.queue, self.begins
        self.queue, self.deferred, self.begins = [], 0, False
        try:
            yield queue, "".join(f"{sql};\n" for sql, _ in queue)
        except BaseException:
            if begins and self.raw.info.transaction_status == TransactionStatus.IDLE:
                self.raw.autocommit = False  # BEGIN never reached the server: psycopg sends it again
            raise

    @staticmethod
    def _answer(cursor, queue: list[tuple[str, Then | None]]) -> None:
        for _, then in queue:  # each result in turn; the carrier's own is left current
            if then is not None:
                then(cursor)
            cursor.nextset()

    def savepoint(self, sid: str) -> None:
        if self.deferred:
            raise RuntimeError("a savepoint while deferred statements wait: an error of one could pass for "
                               "an error inside the savepoint; send them first (batching.send)")
        self.add(self.connection.ops.savepoint_create_sql(sid), control=True)

    def release(self, sid: str) -> None:
        self.add(self.connection.ops.savepoint_commit_sql(sid), control=True)


@contextmanager
def batch() -> Iterator[None]:
    """Defer what ``defer`` is given, and the transaction's BEGIN, savepoints and COMMIT, until the
    next statement or the end of the block. Open it as the last context of the outermost atomic()
    (``with transaction.atomic(), batch():``), so that nothing runs between its end and the commit."""
    connection = transaction.get_connection()
    if (connection.vendor != "postgresql" or connection.features.uses_server_side_binding
            or not connection.in_atomic_block or getattr(connection, "refundops_batch", None) is not None):
        yield
        return
    connection.ensure_connection()
    outermost = len(connection.atomic_blocks) == 1 and not connection.savepoint_ids
    current = _Batch(connection)
    raw = current.raw
    if (raw.info.transaction_status == TransactionStatus.IDLE and outermost
            and raw.isolation_level is None and raw.read_only is None and raw.deferrable is None):
        raw.autocommit = True  # psycopg sends no BEGIN: the first statement carries it
        current.add("BEGIN", control=True)
        current.begins = True
    connection.refundops_batch = current
    connection._savepoint, connection._savepoint_commit = current.savepoint, current.release
    try:
        with connection.execute_wrapper(current):
            yield
            if connection.needs_rollback or connection.closed_in_transaction:
                pass  # atomic() rolls back: nothing to send
            elif current.begins and len(current.queue) == 1:
                pass  # not a statement in the transaction: nothing to commit
            else:
                if outermost:  # atomic() commits next: the COMMIT rides too, and psycopg's finds nothing to do
                    current.add("COMMIT", control=True)
                current.send()
    finally:
        del connection.refundops_batch, connection._savepoint, connection._savepoint_commit
        current.binder.close()
        if current.begins:  # nothing was sent: psycopg opens the transaction itself, as before
            raw.autocommit = False


def defer(sql: str, params: Any = None, *, then: Then | None = None) -> None:
    """Run ``sql`` in this transaction with the next statement, or at the end of the batch; ``then``
    gets the cursor on its result. Outside a batch (or not on PostgreSQL), at once."""
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
        current.send()
