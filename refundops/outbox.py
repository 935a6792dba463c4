"""The transactional outbox: effects that must follow a commit, written in the deciding transaction.

A service calls :func:`send_after_commit` inside its transaction: the task to run is a row of
that transaction, so it exists exactly when the change it follows does. Once the transaction
commits, a nudge tries to send just those rows to the broker; a broker that is down is logged,
never raised to the caller (whose change stands), and the row waits. Beat's ``relay_outbox``
sends every row still unsent ``OUTBOX_GRACE_SECONDS`` after it was written.

The nudge does not make the caller wait for the broker: the committed rows' ids are handed to
this process's sender, a daemon thread that sends what is handed to it in batches (one claim, one
publish batch, one mark per batch) on a database connection of its own, so a request answers right
after its COMMIT. Whatever the sender does not get to (its queue full, the broker down, the process
gone) is already durable and the relay's. Where a caller must see its effects at once (eager tasks)
or is itself off any request's path (a Celery task), the nudge runs inline instead (:func:`_nudge`).

A sender claims rows before it sends them (one statement that skips rows another sender has
locked and takes only rows nobody holds), so the nudge and the relay, or two relays, never send
one row twice. A sender that dies between sending and marking the row sent lets go after
``CLAIM_SECONDS``, and the row is sent again: delivery is at least once, and every task we send
through here is safe to run twice (keyed gateway calls, idempotent deliveries and counts).

Imports only models (and ``logs``, a leaf, for the request id a sent task carries): services,
approvals and ``outbound`` write here; ``tasks`` relays from here.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from datetime import timedelta
from typing import Any

import structlog
from celery import current_app
from django.conf import settings
from django.db import close_old_connections, connection, transaction
from django.db.models import F
from django.utils import timezone
from psycopg.types.json import Jsonb

from refundops import batching
from refundops.logs import current_request_id
from refundops.models import OutboxMessage

log = logging.getLogger(__name__)

# How long a claim holds a row: far longer than one publish takes.
CLAIM_SECONDS = 60
# The sender: ids it claims and publishes at once; ids it keeps waiting at most (past that, with the
# broker down or slow, new ones are left to the relay, which has them anyway); idle this long, it
# gives its database connection back; at exit, the process waits this long for it to finish.
SENDER_BATCH = 500
# After the first id comes, the sender waits this long for more before it claims them: a batch's
# cost (the thread's wake-up, the claim, the publish round trip, the mark, the connection's check)
# is then shared by the commits of that while. The effects reach the broker this much later; no
# caller waits for them (nor for this: the commit has answered).
SENDER_LINGER_SECONDS = 0.02
SENDER_MAX_WAITING = 20_000
SENDER_IDLE_SECONDS = 60
SENDER_EXIT_SECONDS = 5

_TABLE = OutboxMessage._meta.db_table
# Longest untried first (next_try_at, then id): a row that failed goes behind the rows not tried
# since, so rows that fail on every sweep never keep the relay (``limit`` a sweep) from the others.
_CLAIM_ORDER = ("next_try_at", "id")
_CLAIM_SQL = f"""
UPDATE {_TABLE} SET next_try_at = %s, tries = tries + 1
 WHERE id IN (SELECT id FROM {_TABLE}
               WHERE sent_at IS NULL AND next_try_at <= %s AND created_at <= %s {{only}}
               ORDER BY {", ".join(_CLAIM_ORDER)} LIMIT %s FOR UPDATE SKIP LOCKED)
RETURNING id, task, kwargs, queue"""
# Sent prepared (refundops/batching.py): the sender claims and marks once a batch, and planning them
# cost PostgreSQL more than running them (0.24 and 0.06 ms a batch against 0.13 and 0.08).
_CLAIM = {"any": _CLAIM_SQL.format(only=""), "ids": _CLAIM_SQL.format(only="AND id = ANY(%s)")}
_SENT_SQL = f"UPDATE {_TABLE} SET sent_at = %s WHERE id = ANY(%s)"


_RUN_IN_SENDER: dict[str, Callable[..., None]] = {}


def run_in_sender(task: str, run: Callable[[list[tuple[dict[str, Any], str | None]]], None]) -> None:
    """Have this process's sender run ``task`` itself instead of publishing it (a short effect,
    safe to run twice, that would cost a worker more to receive than to do: the breaker's count):
    ``run`` gets a batch's rows of ``task`` at once, each as (kwargs, the committing request's id).
    The rows are still the outbox's: marked sent once ``run`` returned; if it raises, they are the
    relay's, which publishes ``task`` for a worker. Only the sender does this: the relay, eager
    tasks and a task's own nudge publish ``task`` as for any row."""
    _RUN_IN_SENDER[task] = run


def send_after_commit(task: str, kwargs: dict[str, Any], *, queue: str = "") -> OutboxMessage:
    """Run ``task(**kwargs)`` once the caller's transaction commits, and never lose it: the row is
    written in that transaction, and a failed send is retried by the relay. ``kwargs`` are JSON."""
    return send_each_after_commit(task, [kwargs], queue=queue)[0]


def send_each_after_commit(task: str, each_kwargs: list[dict[str, Any]], *, queue: str = "") -> list[OutboxMessage]:
    """:func:`send_after_commit` for many runs of one task: one INSERT, one nudge. In a batch
    (refundops.batching) the INSERT rides with the next statement; the rows' ids, and so the
    messages' pks, are known once it is back, before the commit."""
    if not each_kwargs:
        return []
    messages = [OutboxMessage(task=task, kwargs=kwargs, queue=queue) for kwargs in each_kwargs]
    _insert(messages, then=lambda: _nudge_after_commit([message.pk for message in messages]))
    return messages


def _nudge_after_commit(ids: list[int]) -> None:
    nudge = _pending_nudge()
    if nudge is not None:
        nudge.ids.extend(ids)
    else:
        transaction.on_commit(_Nudge(ids), robust=True)


def _insert(messages: list[OutboxMessage], *, then: Callable[[], None]) -> None:
    """``bulk_create``, then ``then()``; on PostgreSQL the same INSERT … RETURNING id by hand (every
    approved refund writes two rows, and compiling the ORM's insert cost several times its
    execution), deferred in a batch."""
    if connection.vendor != "postgresql":
        OutboxMessage.objects.bulk_create(messages)
        then()
        return
    rows = ", ".join(["(%s, %s, %s, %s, NULL, %s, %s, %s)"] * len(messages))
    params: list[Any] = []
    for m in messages:
        params += [m.task, Jsonb(m.kwargs), m.queue, m.created_at, m.tries, m.last_error, m.next_try_at]

    def inserted(cursor) -> None:
        for message, (pk,) in zip(messages, cursor.fetchall(), strict=True):
            message.pk = pk
            message._state.adding = False
        then()

    batching.defer(f"INSERT INTO {_TABLE} (task, kwargs, queue, created_at, sent_at, tries, last_error, "
                   f"next_try_at) VALUES {rows} RETURNING id", params, then=inserted)


class _Nudge:
    """Right after the commit: send these rows (one claim, one publish each, one mark). Whatever
    goes wrong is the relay's to retry."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def __call__(self) -> None:
        _nudge(self.ids)


def _pending_nudge() -> _Nudge | None:
    """The nudge this transaction already registered, if rows written now may join it: it is still
    to run at commit, and was registered outside every savepoint open now or in one of them, so
    undoing a savepoint either drops both or neither. One transaction's rows are then claimed and
    marked sent together (a refund writes two), not a statement pair each."""
    if not connection.in_atomic_block:
        return None
    open_savepoints = set(connection.savepoint_ids)
    for savepoints, hook, _robust in reversed(connection.run_on_commit):
        if isinstance(hook, _Nudge) and savepoints <= open_savepoints:
            return hook
    return None


def _nudge(message_ids: list[int]) -> None:
    """Hand the committed rows to this process's sender, or send them here and now:
    - eager tasks (tests, ``CELERY_TASK_ALWAYS_EAGER``): inline, so the caller sees the effects
      when its call returns, and an eager task runs in its caller's thread, not in the sender's;
    - in a Celery task: inline. No client waits on a task; sent before the task returns, its
      effects do not wait in a worker process that Celery may recycle or kill, and a pool process
      does not hold a second database connection for a sender;
    - everywhere else (web workers, the MCP server, management commands): the sender. At exit the
      process gives it ``SENDER_EXIT_SECONDS`` to finish (a graceful shutdown sends what is
      waiting); a process killed, or a sender that cannot keep up, leaves the rows to the relay.
      The request id bound now goes along: the sender publishes each row under its own request's
      id, as the inline nudge did (``logs._carry_request_id``), so the worker's lines name it."""
    if current_app.conf.task_always_eager or current_app.current_task is not None:
        _send_now(message_ids)
        return
    # Committed by the sender's own thread (a trip's mail, from the breaker's count it ran): its
    # own queue, even when stopping at exit (stop_sender has let go of it): it sends what is put
    # before it ends, where a new sender would be killed by the exit while it lingered.
    sender = getattr(_in_sender, "sender", None) or _running_sender()
    if sender is None:  # no new thread at interpreter shutdown
        _send_now(message_ids)
    else:
        sender.put(message_ids, current_request_id())


def _send_now(message_ids: list[int], request_ids: dict[int, str] | None = None, *, in_sender: bool = False) -> None:
    try:  # one try: the relay retries
        send_claimed(_claim(ids=message_ids, now=timezone.now()), retry=False, request_ids=request_ids,
                     in_sender=in_sender)
    except Exception:  # noqa: BLE001 - the caller's change stands; the relay sends it later
        log.exception("outbox: could not send %s after commit; the relay will", message_ids)


class _Sender:
    """This process's after-commit sender: a daemon thread that sends the ids commits hand it, in
    batches of up to ``SENDER_BATCH``, on a database connection of its own (Django's are per
    thread), kept and checked between batches as around a request (``CONN_MAX_AGE``,
    ``CONN_HEALTH_CHECKS``; under the psycopg pool, taken from it and given back each batch)."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.waiting: list[tuple[int, str]] = []  # (row id, the committing request's id or "")
        self.since = float("-inf")  # when the first of the ids waiting now came
        self.busy = False  # a batch is being sent
        self.stopping = False
        self.full = False  # ids were left to the relay since the queue was last below its bound
        self.changed = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="outbox-sender", daemon=True)

    def put(self, ids: list[int], request_id: str = "") -> None:
        with self.changed:
            if len(self.waiting) + len(ids) > SENDER_MAX_WAITING:
                if not self.full:
                    log.warning("outbox: the sender has %s ids waiting; leaving new ones to the relay", len(self.waiting))
                self.full = True
                return
            self.full = False
            before = len(self.waiting)
            self.waiting.extend((message_id, request_id) for message_id in ids)
            if not before:
                self.since = time.monotonic()
            # Woken when there is something to send, or a full batch: not by every commit while it
            # lingers (each would cost a thread switch) or is busy (it looks again when done).
            if not before or before < SENDER_BATCH <= len(self.waiting):
                self.changed.notify_all()

    def drain(self, timeout: float | None) -> bool:
        """Wait until nothing is waiting or being sent; False if that took longer than ``timeout``
        or the thread ended with ids left (the relay's)."""
        with self.changed:
            self.changed.wait_for(lambda: not (self.waiting or self.busy) or not self.thread.is_alive(), timeout)
            return not (self.waiting or self.busy)

    def stop(self, timeout: float | None) -> bool:
        """Send what is waiting, then end the thread (closing its connection)."""
        with self.changed:
            self.stopping = True
            self.changed.notify_all()
        if self.thread.is_alive():
            self.thread.join(timeout)
        return not self.thread.is_alive() and not self.waiting

    def _run(self) -> None:
        _in_sender.sender = self
        try:
            while True:
                with self.changed:
                    self.busy = False
                    self.changed.notify_all()
                    if not self.changed.wait_for(lambda: self.waiting or self.stopping, SENDER_IDLE_SECONDS):
                        batch = None  # idle: give the connection back
                    elif not self.waiting:
                        return  # stopping, and nothing left
                    else:
                        # Linger: commits made meanwhile join this batch (one claim, one publish,
                        # one mark, one wake-up for them all). Not when stopping or a batch is full.
                        linger = self.since + SENDER_LINGER_SECONDS - time.monotonic()
                        if linger > 0:
                            self.changed.wait_for(lambda: self.stopping or len(self.waiting) >= SENDER_BATCH, linger)
                        batch, self.waiting = self.waiting[:SENDER_BATCH], self.waiting[SENDER_BATCH:]
                        self.since = float("-inf")  # what is left has waited already
                        self.busy = True
                if batch is None:
                    connection.close()
                    continue
                _send_now([message_id for message_id, _ in batch], dict(batch), in_sender=True)
                # As after a request: a connection broken or past CONN_MAX_AGE is closed (under the
                # pool, given back), the others checked before the next batch (CONN_HEALTH_CHECKS).
                close_old_connections()
        finally:  # stopped, or died (the next nudge starts another; what it held is the relay's)
            try:
                connection.close()
            finally:
                with self.changed:
                    self.busy = False
                    self.changed.notify_all()


_sender: _Sender | None = None
_sender_lock = threading.Lock()
_in_sender = threading.local()  # .sender: in a sender's thread, that sender


def _running_sender() -> _Sender | None:
    """This process's sender, started on first use and again after a fork (gunicorn forks its
    workers: a pid of its own means a thread and queue of its own) or after its thread died."""
    global _sender
    sender = _sender
    if sender is not None and sender.pid == os.getpid() and sender.thread.is_alive():
        return sender
    with _sender_lock:
        if _sender is None or _sender.pid != os.getpid() or not _sender.thread.is_alive():
            sender = _Sender()
            try:
                sender.thread.start()
            except RuntimeError:  # "can't create new thread at interpreter shutdown"
                return None
            _sender = sender
        return _sender


def _after_fork_in_child() -> None:
    global _sender_lock
    _sender_lock = threading.Lock()  # another thread of the parent may have held it at the fork


os.register_at_fork(after_in_child=_after_fork_in_child)


def drain(*, timeout: float | None = None) -> bool:
    """Wait until this process's sender has sent what was handed to it (tests, benchmarks). True
    when nothing is left waiting (or there is no sender)."""
    sender = _sender
    if sender is None or sender.pid != os.getpid():
        return True
    return sender.drain(timeout)


def stop_sender(*, timeout: float | None = SENDER_EXIT_SECONDS) -> bool:
    """Send what is waiting and end this process's sender, closing its connection (at exit, and
    after each test). What it could not send in ``timeout`` is the relay's. The next nudge starts
    a new one."""
    global _sender
    with _sender_lock:
        sender, _sender = _sender, None
    if sender is None or sender.pid != os.getpid():
        return True
    return sender.stop(timeout)


atexit.register(stop_sender)  # a graceful exit (gunicorn's, a command's) sends what is waiting


def relay_unsent(*, older_than_seconds: float | None = None, limit: int = 500) -> int:
    """Send rows unsent ``OUTBOX_GRACE_SECONDS`` after they were written (their nudge failed or its
    process died). Returns how many were sent."""
    if older_than_seconds is None:
        older_than_seconds = settings.OUTBOX_GRACE_SECONDS
    now = timezone.now()
    return send_claimed(_claim(now=now, written_before=now - timedelta(seconds=older_than_seconds), limit=limit))


def forget_sent(*, older_than_days: float | None = None) -> int:
    """Delete rows sent more than ``OUTBOX_KEEP_SENT_DAYS`` ago; unsent rows are never deleted."""
    if older_than_days is None:
        older_than_days = settings.OUTBOX_KEEP_SENT_DAYS
    cutoff = timezone.now() - timedelta(days=older_than_days)
    return OutboxMessage.objects.filter(sent_at__lt=cutoff).delete()[0]


def _claim(*, now, ids: Iterable[int] | None = None, written_before=None, limit: int = 1) -> list[tuple]:
    """Take unsent rows nobody holds, for ``CLAIM_SECONDS``; one statement, so it is its own
    transaction and a row is never claimed twice."""
    if connection.vendor != "postgresql":
        return _claim_elsewhere(now=now, ids=ids, written_before=written_before, limit=limit)
    claim, params = _CLAIM["any"], []
    if ids is not None:
        ids = list(ids)
        claim, params, limit = _CLAIM["ids"], [ids], len(ids)
    with connection.cursor() as cursor:
        cursor.execute(claim,
                       [now + timedelta(seconds=CLAIM_SECONDS), now, written_before or now, *params, limit])
        return cursor.fetchall()


def _claim_elsewhere(*, now, ids: Iterable[int] | None, written_before, limit: int) -> list[tuple]:
    """:func:`_claim` through the ORM, on a database without PostgreSQL's statement (SQLite, in
    embedded mode): the same rows, in one transaction. Django drops ``skip_locked`` where rows are
    not locked one by one; SQLite's transactions here take its write lock first (settings:
    ``transaction_mode`` IMMEDIATE), so two claims never interleave."""
    unsent = OutboxMessage.objects.select_for_update(skip_locked=True).filter(
        sent_at__isnull=True, next_try_at__lte=now, created_at__lte=written_before or now)
    if ids is not None:
        ids = list(ids)
        unsent, limit = unsent.filter(pk__in=ids), len(ids)
    with transaction.atomic():
        rows = list(unsent.order_by(*_CLAIM_ORDER).values_list("id", "task", "kwargs", "queue")[:limit])
        OutboxMessage.objects.filter(pk__in=[row[0] for row in rows]).update(
            next_try_at=now + timedelta(seconds=CLAIM_SECONDS), tries=F("tries") + 1)
    return rows


def send_claimed(rows: list[tuple], *, retry: bool = True, request_ids: dict[int, str] | None = None,
                 in_sender: bool = False) -> int:
    """Publish the claimed rows, each with ``apply_async`` on its own: one that fails never keeps the
    others from going. ``retry``: let kombu retry a broken connection (the relay may; a request's
    nudge does not). Without retries, in one round trip to the broker where it allows (a producer
    from Celery's pool, ``producer.batch()``: one Redis pipeline); a batch the broker then refuses
    frees every row in it for the relay. With retries, one by one (a retry revives the connection,
    which kombu refuses under a batch). ``request_ids``: the id of the request that committed each
    row, bound while it is published (the sender's). ``in_sender``: the sender's thread, which runs
    the tasks given to :func:`run_in_sender` itself."""
    sent: list[int] = []
    ran: list[int] = []  # run here (run_in_sender): done, whatever becomes of the batch's publish
    failed: list[tuple[int, str, Exception]] = []
    here: dict[str, list[tuple[int, dict[str, Any], str | None]]] = {}
    to_publish: list[tuple[int, str, Any, str]] = []
    for row in rows:
        message_id, task, kwargs, _queue = row
        if in_sender and task in _RUN_IN_SENDER:
            if isinstance(kwargs, str):  # Django reads jsonb as text on a raw cursor
                kwargs = json.loads(kwargs)
            here.setdefault(task, []).append((message_id, kwargs, request_ids.get(message_id) if request_ids else None))
        else:
            to_publish.append(row)
    for task, items in here.items():
        try:
            _RUN_IN_SENDER[task]([(kwargs, request_id) for _, kwargs, request_id in items])
        except Exception as exc:  # noqa: BLE001 - e.g. the breaker's Redis away: the relay's
            failed.extend((message_id, task, exc) for message_id, _, _ in items)
        else:
            ran.extend(message_id for message_id, _, _ in items)

    def publish(message_id: int, task: str, kwargs: Any, queue: str, **options: Any) -> None:
        request_id = request_ids.get(message_id) if request_ids else None
        try:
            if isinstance(kwargs, str):  # Django reads jsonb as text on a raw cursor
                kwargs = json.loads(kwargs)
            with structlog.contextvars.bound_contextvars(request_id=request_id) if request_id else nullcontext():
                current_app.tasks[task].apply_async(kwargs=kwargs, queue=queue or None, retry=retry, **options)
        except Exception as exc:  # noqa: BLE001 - a broker error, or a task this process lacks
            failed.append((message_id, task, exc))
        else:
            sent.append(message_id)

    if retry or current_app.conf.task_always_eager:
        # Eager tasks run here, inside the publish: one that nudges its own rows would ask the
        # broker's pool for a second producer while holding the first (threads doing so at once
        # empty the pool and wait on each other for ever). Nothing is sent to batch anyway.
        for row in to_publish:
            publish(*row)
    elif to_publish:
        try:
            with current_app.producer_or_acquire() as producer, producer.batch(max_size=SENDER_BATCH * 4):
                for row in to_publish:
                    publish(*row, producer=producer)
        except Exception as exc:  # noqa: BLE001 - the batch's flush (or the producer): none of it went
            done = {message_id for message_id, _, _ in failed}
            failed.extend((message_id, task, exc) for message_id, task, _, _ in to_publish if message_id not in done)
            sent = []
    _record(sent + ran, failed)
    return len(sent) + len(ran)


def _record(sent: list[int], failed: list[tuple[int, str, Exception]]) -> None:
    """Mark the sent rows sent; free the failed ones for the relay, with their error."""
    by_error: dict[str, list[int]] = {}
    for message_id, task, exc in failed:
        log.warning("outbox: sending %s (%s) failed: %s", task, message_id, exc)
        by_error.setdefault(f"{type(exc).__name__}: {exc}"[:1000], []).append(message_id)
    for error, message_ids in by_error.items():  # a broker down fails a whole batch with one error
        # Free for the relay's next sweep (the sweep interval is the backoff).
        OutboxMessage.objects.filter(pk__in=message_ids).update(next_try_at=timezone.now(), last_error=error)
    if sent and connection.vendor != "postgresql":  # SQLite (embedded mode) has no ANY(array)
        OutboxMessage.objects.filter(pk__in=sent).update(sent_at=timezone.now())
    elif sent:
        with connection.cursor() as cursor:
            cursor.execute(_SENT_SQL, [timezone.now(), sent])

