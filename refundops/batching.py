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

Prepared statements: a statement whose text was given to ``prepared`` (the hot path's reads and
writes) is sent as ``EXECUTE name(literals)``, in a batch or not, after a ``PREPARE name (types) AS
...$1...`` that rides ahead of it in the same round trip the first time this connection sends it:
PostgreSQL then parses it once a session and, once it has seen that a generic plan costs no more
than the custom ones (after five executions, ``plan_cache_mode`` ``auto``), no longer plans it.
The literals are psycopg's, as the client-side binding cursor would merge them; each parameter is
declared of the type that literal has (``'…'::timestamptz``, ``5``: ``integer``), and a plain
string, an untyped array or NULL as ``unknown``, which PostgreSQL infers from where it stands, as it
does a literal there: so only statements written for it are marked (a ``$1`` whose type nothing
decides, in ``jsonb_build_object('a', $1)``, fails to prepare where the literal would not).
What a session holds is known per psycopg connection (``_Prepared``, on the connection object: a
new or pooled connection brings its own, a reconnect starts empty), at most
``DATABASE_PREPARED_STATEMENTS`` of them (the least recently used is deallocated in the round trip
that prepares one more; 0 turns preparing off, as behind a pooler that hands one session's
transactions to several server sessions, PgBouncer's transaction mode). PREPARE and DEALLOCATE are
not transactional: a round trip that fails may or may not have run those it carried, and a batch
whose queue is dropped never sent them; either way the connection forgets every name and its next
prepared statement goes after a ``DEALLOCATE ALL``, so no name is ever executed before its PREPARE
has run nor prepared twice. Names are never reused on a connection, nor drawn alike by two (a
random part each): on a session shared by mistake (that pooler, the setting left on), a name
another client prepared is never taken for one's own statement (an error then, not its answer).
A statement PostgreSQL refuses because a column it returns changed type since it was prepared (a
migration: "cached plan must not change result type", answered to every EXECUTE until it is
deallocated) makes the connection forget its names too, as a session reset does.
"""

from __future__ import annotations

import re
import secrets
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import psycopg
import psycopg.errors
from django.conf import settings
from django.db import transaction
from django.db.backends.signals import connection_created
from psycopg.adapt import Dumper, Transformer
from psycopg.pq import TransactionStatus

Then = Callable[[Any], None]  # given the cursor on the statement's own result


_MARKED: set[str] = set()


def prepared(sql: str) -> str:
    """``sql``, marked to be sent as a prepared statement on PostgreSQL (the module's docstring):
    for a statement every request sends, whose parameters each stand where PostgreSQL can tell their
    type (a column compared, a cast), never where only a literal may (``INTERVAL %s``, ``ORDER BY
    %s``). The text itself is the mark: give ``prepared`` the very string that is executed."""
    _MARKED.add(sql)
    return sql


class _Placeholder:
    """A parameter written ``$n`` by mogrify: ``n`` in the order the statement first names it."""

    __slots__ = ("key", "order")

    def __init__(self, key: Any, order: list) -> None:
        self.key, self.order = key, order


class _PlaceholderDumper(Dumper):
    oid = 0

    def dump(self, obj: _Placeholder) -> bytes:  # pragma: no cover - only quoted
        raise NotImplementedError

    def quote(self, obj: _Placeholder) -> bytes:
        if obj.key not in obj.order:
            obj.order.append(obj.key)
        return b"$%d" % (obj.order.index(obj.key) + 1)


_SHAPES: dict[tuple[str, bool, int], tuple[str, tuple]] = {}  # (sql, by name, count) -> body with $n, keys
_INT4, _INT8 = 2**31, 2**63
_LABEL = re.compile(r"\b(?:FROM|INTO|UPDATE)\s+\"?(\w+)")


def _declared(literal: bytes) -> str | None:
    """The type PostgreSQL gives ``literal`` (psycopg's), to declare its parameter with; None: not
    one this module knows (then the statement is sent as it is)."""
    if literal[-1:] == b"'":
        return "unknown"  # a plain string (or E'...'), an untyped array: typed by its place
    quote = literal.rfind(b"'")
    if quote >= 0:
        cast = literal[quote + 1:]
        return cast[2:].decode() if cast.startswith(b"::") else None
    if literal == b"NULL":
        return "unknown"
    if literal in (b"true", b"false"):
        return "boolean"
    text = literal.strip()
    try:
        number = int(text)
    except ValueError:
        return "numeric" if re.fullmatch(rb"-?[0-9.]+(e[-+]?[0-9]+)?", text) else None
    return "integer" if -_INT4 <= number < _INT4 else "bigint" if -_INT8 <= number < _INT8 else "numeric"


class _Prepared:
    """The statements prepared in one psycopg connection's session, least recently used first."""

    def __init__(self, raw, limit: int) -> None:
        self.limit = limit
        self.names: OrderedDict[tuple[str, tuple[str, ...]], str] = OrderedDict()
        self.made = 0  # names drawn on this connection: never reused
        # A connection's names are its own: behind a pooler that hands one server session to several
        # clients (left on by mistake), another's refundops_1_payment is never taken for this one's.
        self.token = secrets.token_hex(4)
        self.unsure = False  # a PREPARE or DEALLOCATE may or may not have run: forget them all
        self.literals = Transformer(raw)
        self.shaper = psycopg.ClientCursor(raw)
        self.shaper.adapters.register_dumper(_Placeholder, _PlaceholderDumper)

    def _shape(self, sql: str, params: Any) -> tuple[str, tuple]:
        by_name = isinstance(params, Mapping)
        key = (sql, by_name, 0 if by_name else len(params))
        shape = _SHAPES.get(key)
        if shape is None:
            order: list = []
            placeholders = ({name: _Placeholder(name, order) for name in params} if by_name
                            else [_Placeholder(i, order) for i in range(len(params))])
            body = self.shaper.mogrify(sql, placeholders)
            shape = _SHAPES[key] = (body, tuple(order))
        return shape

    def statement(self, sql: str, params: Any) -> tuple[list[str], str] | None:
        """What to send for ``sql`` with ``params``: the PREPARE (and DEALLOCATE) to run first, and
        the EXECUTE; None when it is to be sent as it is. Raises as mogrify would for a value psycopg
        cannot adapt, with nothing changed."""
        body, order = (sql, ()) if params is None else self._shape(sql, params)  # None: no % processing
        values = [params[key] for key in order]
        literals = [self.literals.as_literal(v) if v is not None else b"NULL" for v in values]
        types = tuple(_declared(literal) for literal in literals)
        if None in types:
            return None
        first: list[str] = []
        if self.unsure:
            first.append("DEALLOCATE ALL")
            self.names.clear()
            self.unsure = False
        name = self.names.get((sql, types))
        if name is None:
            if len(self.names) >= self.limit:
                first.append(f"DEALLOCATE {self.names.popitem(last=False)[1]}")
            self.made += 1
            label = _LABEL.search(sql)
            label = label[1].removeprefix("refundops_") if label else "q"
            name = self.names[sql, types] = f"refundops_{self.token}_{self.made}_{label}"[:63]
            first.append(f"PREPARE {name}" + (f" ({', '.join(types)})" if types else "") + f" AS {body}")
        else:
            self.names.move_to_end((sql, types))
        encoding = self.literals.encoding
        arguments = ", ".join(literal.decode(encoding) for literal in literals)
        return first, f"EXECUTE {name}({arguments})" if literals else f"EXECUTE {name}"


def _prepared_for(connection, sql: str, many: bool = False) -> _Prepared | None:
    """The connection's prepared statements, if ``sql`` is to be one there."""
    if many or sql not in _MARKED:
        return None
    raw = connection.connection
    state = getattr(raw, "refundops_prepared", None)
    if state is None:
        limit = getattr(settings, "DATABASE_PREPARED_STATEMENTS", 0)
        if (connection.vendor != "postgresql" or connection.features.uses_server_side_binding
                or limit <= 0 or not isinstance(raw, psycopg.Connection)):
            return None
        state = raw.refundops_prepared = _Prepared(raw, limit)
    return state


def _gone(error: BaseException) -> bool:
    """``error`` says a prepared statement is not there, or not usable: the session was reset behind
    the connection's back (a pooler's ``DISCARD ALL``, someone's ``DEALLOCATE ALL``), or a column it
    returns changed type since it was prepared (a migration: "cached plan must not change result
    type", which PostgreSQL then answers to every EXECUTE of it until it is deallocated)."""
    error = error.__cause__ if not isinstance(error, psycopg.Error) else error
    return isinstance(error, (psycopg.errors.InvalidSqlStatementName,  # by SQLSTATE, not the message:
                              psycopg.errors.FeatureNotSupported))  # lc_messages may translate it


def _outside_batch(execute, sql, params, many, context):
    """The execute wrapper every PostgreSQL connection keeps: a marked statement outside a batch is
    sent prepared (in a batch, the batch's own wrapper does it). One whose session lost its
    statements is sent again, after a DEALLOCATE ALL, when no transaction is open: it did nothing."""
    connection = context["connection"]
    if (getattr(connection, "refundops_batch", None) is not None
            or (state := _prepared_for(connection, sql, many)) is None
            or isinstance(context["cursor"].cursor, psycopg.ServerCursor)):
        return execute(sql, params, many, context)
    errors_before = connection.errors_occurred
    for attempt in (1, 2):
        with connection.wrap_database_errors:
            statement = state.statement(sql, params)
        if statement is None:
            return execute(sql, params, many, context)
        first, executed = statement
        try:
            result = execute("".join(f"{line};\n" for line in first) + executed, None, many, context)
        except Exception as error:
            gone = _gone(error)
            if first or gone:
                state.unsure = True
            if gone and attempt == 1 and not connection.in_atomic_block:
                continue
            raise
        except BaseException:
            if first:
                state.unsure = True
            raise
        cursor = context["cursor"].cursor
        for _ in first:  # the EXECUTE's result is the current one
            cursor.nextset()
        if attempt == 2:  # healed: the connection works, so Django need not check it before its next use
            connection.errors_occurred = errors_before
        return result


def _keep_wrapper(sender, connection, **kwargs) -> None:
    if connection.vendor == "postgresql" and _outside_batch not in connection.execute_wrappers:
        connection.execute_wrappers.insert(0, _outside_batch)  # outermost: a batch's wrapper pops its own


connection_created.connect(_keep_wrapper, dispatch_uid="refundops.batching.prepared")


class _Batch:
    def __init__(self, connection) -> None:
        self.connection = connection
        self.raw = connection.connection  # psycopg's
        self.binder = self.raw.cursor()  # a ClientCursor: binds deferred statements' parameters
        self.queue: list[tuple[str, Then | None]] = []
        self.deferred = 0  # statements queued by defer() (not BEGIN nor savepoints), not yet sent
        self.begins = False  # BEGIN is queued, psycopg in autocommit for it
        self.prepares = 0  # PREPARE and DEALLOCATE queued, not yet sent

    def add(self, sql: str, params: Any = None, then: Then | None = None, *, control: bool = False) -> None:
        sql = self._bind(self.binder, sql, params)
        self.queue.append((sql, then))
        self.deferred += not control

    def _prepare(self, sql: str, params: Any) -> str | None:
        """``sql`` as an EXECUTE, its PREPARE queued ahead of it; None when it is not to be prepared."""
        state = _prepared_for(self.connection, sql)
        if state is None:
            return None
        with self.connection.wrap_database_errors:
            statement = state.statement(sql, params)
        if statement is None:
            return None
        first, sql = statement
        self.queue.extend((line, None) for line in first)
        self.prepares += len(first)
        return sql

    def _bind(self, cursor, sql: str, params: Any) -> str:
        """``sql`` with ``params`` merged in (psycopg adapts each value), or raising Django's error
        for a value it cannot adapt, as execute() would; a marked statement as its EXECUTE."""
        if (execute := self._prepare(sql, params)) is not None:
            return execute
        if params is None:
            return sql
        with self.connection.wrap_database_errors:
            return cursor.mogrify(sql, params)

    # The execute wrapper (Django's database instrumentation): the queue rides with every statement.
    def __call__(self, execute, sql, params, many, context):
        if not self.queue and (many or sql not in _MARKED):
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
        queue, begins, prepares = self.queue, self.begins, self.prepares
        self.queue, self.deferred, self.begins, self.prepares = [], 0, False, 0
        try:
            yield queue, "".join(f"{sql};\n" for sql, _ in queue)
        except BaseException as error:
            if begins and self.raw.info.transaction_status == TransactionStatus.IDLE:
                self.raw.autocommit = False  # BEGIN never reached the server: psycopg sends it again
            if prepares or _gone(error):
                self._unsure()
            raise

    def _unsure(self) -> None:
        """PREPAREs or DEALLOCATEs that may or may not have run: the connection forgets its names."""
        state = getattr(self.raw, "refundops_prepared", None)
        if state is not None:
            state.unsure = True

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
        if current.prepares:  # queued, never sent (the block left on an error, or to roll back)
            current._unsure()
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
