"""The outbox's sender: after COMMIT the caller hands its rows to a thread of its process and
returns; the thread claims, publishes and marks them in batches on its own database connection.
The broker is the real Redis; a publish is held back by blocking kombu's Redis transport on an
event, so what the caller saw while the broker had not taken the message yet can be checked."""

from __future__ import annotations

import base64
import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import structlog
from celery._state import _task_stack
from django.conf import settings as django_settings
from django.db import connection, connections, transaction
from kombu.transport import redis as kombu_redis

from refundops import outbox
from refundops.celery import app as celery_app
from refundops.logs import REQUEST_ID_TASK_HEADER, bind_request_id
from refundops.models import OutboxMessage
from tests.conftest import make_payment, post
from tests.test_connection_reuse import database_url
from tests.test_outbox import broker_at, queued

pytestmark = pytest.mark.django_db(transaction=True)  # real commits: the outbox acts on them

POLL = "refundops.tasks.poll_refund"  # a task with plain kwargs, sent to the default queue
ROOT = Path(__file__).resolve().parent.parent


class HeldBroker:
    """kombu's Redis transport holds every publish made in this process, outside the test's own
    thread, until :meth:`release` (a publish in the test's thread goes through, and is recorded:
    the old nudge published in the caller's thread, and must not hang the test)."""

    def __init__(self) -> None:
        self.entered, self.released = threading.Event(), threading.Event()
        self.in_caller: list[str] = []
        self.pid, self.caller = os.getpid(), threading.current_thread()

    def held(self) -> bool:
        return os.getpid() == self.pid and threading.current_thread() is not self.caller

    def release(self) -> None:
        self.released.set()


@pytest.fixture
def held_broker(monkeypatch) -> Iterator[HeldBroker]:
    held = HeldBroker()
    put = kombu_redis.Channel._put

    def held_put(self, queue, message, **kwargs):
        if held.held():
            held.entered.set()
            held.released.wait(timeout=60)  # ends a hopeless wait only; the test releases it
        elif os.getpid() == held.pid:
            held.in_caller.append(message["headers"]["task"])
        return put(self, queue, message, **kwargs)

    monkeypatch.setattr(kombu_redis.Channel, "_put", held_put)
    try:
        yield held
    finally:
        held.release()


def commit(*names: str) -> list[int]:
    """One transaction writing a poll_refund row for each name; the rows' ids."""
    with transaction.atomic():
        return [outbox.send_after_commit(POLL, {"refund_id": name}, queue="default").pk for name in names]


def sent_names() -> list[str]:
    return sorted(m["kwargs"]["refund_id"] for m in queued("default"))


def test_the_api_answers_while_the_broker_has_not_taken_the_effects_and_they_go_once(api, policy, held_broker):
    """Fails on the nudge in the caller's thread: the refund's two messages were published there,
    before the answer, and the rows were sent when it came."""
    payment = make_payment(amount=5_000)
    with broker_at(django_settings.REDIS_URL):
        response = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 1_000,
                                                 "reason": "duplicate"})

        assert response.status_code == 201, response.content
        assert held_broker.in_caller == []  # nothing published in the request's thread
        assert held_broker.entered.wait(timeout=30)  # the sender is publishing, held by the broker
        rows = OutboxMessage.objects.order_by("pk")
        assert [(m.task, m.sent_at, m.tries) for m in rows] == [
            ("refundops.tasks.count_agent_refund", None, 1), ("refundops.tasks.submit_refund", None, 1)]
        assert outbox.relay_unsent(older_than_seconds=0) == 0  # claimed by the sender: the relay keeps off

        held_broker.release()
    assert all(m.sent_at is not None and m.tries == 1 for m in OutboxMessage.objects.all())
    refund_id = response.json()["refund"]["id"]
    assert queued("payments.sandbox") == [{"task": "refundops.tasks.submit_refund", "kwargs": {"refund_id": refund_id}}]
    assert queued("default") == []  # the breaker's count: run by the sender itself, not a message
    assert breaker_counted() == 1
    assert outbox.relay_unsent(older_than_seconds=0) == 0  # sent once: nothing left for the relay


def breaker_counted() -> int:
    """Agent refunds the breaker has counted, every minute together."""
    from processors.redis_client import redis_client
    from refundops import breaker

    return sum(int(n) for n in redis_client().hvals(breaker._series_key("n")))


def request_ids_queued(queue: str) -> dict[str, str | None]:
    """Each message waiting in ``queue``: its refund_id (or task) and the request id it carries."""
    client = redis.Redis.from_url(django_settings.REDIS_URL)
    carried = {}
    for raw in client.lrange(f"{django_settings.REDIS_KEY_PREFIX}{queue}", 0, -1):
        message = json.loads(raw)
        _, kwargs, _ = json.loads(base64.b64decode(message["body"]))
        carried[kwargs.get("refund_id") or message["headers"]["task"]] = message["headers"].get(REQUEST_ID_TASK_HEADER)
    return carried


def test_each_effect_carries_the_request_id_of_the_request_that_committed_it(api, policy, held_broker):
    """The worker's lines name the agent's request (tests/test_logs.py, end to end): the id bound
    while the request ran rides each of its messages. Fails on the sender as it landed: it published
    in its own thread, where no request id is bound, so every message went without one."""
    payment = make_payment(amount=5_000)
    with broker_at(django_settings.REDIS_URL):
        response = api.post("/api/v1/refunds", {"transaction_id": payment.pk, "amount": 1_000, "reason": "duplicate"},
                            format="json", HTTP_IDEMPOTENCY_KEY=uuid.uuid4().hex, HTTP_X_REQUEST_ID="req-api-1")
        assert response.status_code == 201, response.content
        assert held_broker.entered.wait(timeout=30)  # the sender is publishing the request's two
        try:  # two commits of two other requests while it is busy: one batch, one id each
            for name in ("a", "b"):
                bind_request_id(f"req-{name}")
                commit(name)
        finally:
            structlog.contextvars.clear_contextvars()
        commit("no-request")  # nothing bound: a command's or the MCP stdio server's
        held_broker.release()
    assert request_ids_queued("payments.sandbox") == {response.json()["refund"]["id"]: "req-api-1"}
    assert request_ids_queued("default") == {"a": "req-a", "b": "req-b", "no-request": None}


def test_commits_made_while_the_sender_is_busy_go_out_in_one_batch(held_broker, monkeypatch):
    claims: list[int] = []
    claim = outbox._claim
    monkeypatch.setattr(outbox, "_claim", lambda **kw: claims.append(len(kw["ids"])) or claim(**kw))
    with broker_at(django_settings.REDIS_URL):
        commit("first")
        assert held_broker.entered.wait(timeout=30)
        for i in range(5):
            commit(f"later-{i}a", f"later-{i}b")
        held_broker.release()
    assert claims == [1, 10]  # one claim (and one publish batch, one mark) for the ten waiting
    assert sent_names() == sorted(["first", *(f"later-{i}{x}" for i in range(5) for x in "ab")])
    assert not OutboxMessage.objects.filter(sent_at__isnull=True).exists()


def test_a_sender_that_cannot_keep_up_leaves_what_it_cannot_hold_to_the_relay(held_broker, monkeypatch, settings):
    monkeypatch.setattr(outbox, "SENDER_MAX_WAITING", 2)
    with broker_at(django_settings.REDIS_URL):
        commit("in-flight")
        assert held_broker.entered.wait(timeout=30)
        commit("waiting-1", "waiting-2")
        (dropped,) = commit("dropped")  # past the bound: not queued, the caller not delayed
        held_broker.release()
    assert sent_names() == ["in-flight", "waiting-1", "waiting-2"]
    row = OutboxMessage.objects.get(pk=dropped)
    assert row.sent_at is None and row.tries == 0

    settings.OUTBOX_GRACE_SECONDS = 0
    with broker_at(django_settings.REDIS_URL):
        assert outbox.relay_unsent() == 1
    assert sent_names() == ["dropped", "in-flight", "waiting-1", "waiting-2"]


def test_a_rolled_back_transaction_hands_the_sender_nothing():
    with broker_at(django_settings.REDIS_URL):
        with pytest.raises(ZeroDivisionError), transaction.atomic():
            commit("undone")
            1 / 0
        commit("kept")
    assert sent_names() == ["kept"]
    assert list(OutboxMessage.objects.values_list("kwargs", flat=True)) == [{"refund_id": "kept"}]


def test_rows_a_dead_sender_held_are_sent_by_the_relay_and_the_next_commit_starts_another(monkeypatch, settings):
    class Died(BaseException):
        """Ends the sender's thread between its claim and the publish."""

    send_claimed = outbox.send_claimed

    def die(rows, **options):
        raise Died

    monkeypatch.setattr(outbox, "send_claimed", die)
    monkeypatch.setattr(outbox, "CLAIM_SECONDS", 0)  # a dead sender's claim lapses now, not in a minute
    monkeypatch.setattr(threading, "excepthook", lambda args: None)  # the thread's death is the point
    with broker_at(django_settings.REDIS_URL):
        (lost,) = commit("lost")
        first = outbox._sender
        first.thread.join(timeout=30)
        assert not first.thread.is_alive()
        row = OutboxMessage.objects.get(pk=lost)
        assert row.sent_at is None and row.tries == 1  # claimed, never published

        monkeypatch.setattr(outbox, "send_claimed", send_claimed)
        commit("next")  # a new sender, in a thread of its own
    assert outbox._sender is not first and outbox._sender.thread.is_alive()
    assert sent_names() == ["next"]

    settings.OUTBOX_GRACE_SECONDS = 0
    with broker_at(django_settings.REDIS_URL):
        assert outbox.relay_unsent() == 1
    assert sent_names() == ["lost", "next"]
    assert OutboxMessage.objects.get(pk=lost).tries == 2


@pytest.mark.parametrize("health_checks", [True, False])
def test_a_sender_whose_database_connection_was_cut_recovers(health_checks, monkeypatch, settings):
    monkeypatch.setitem(connection.settings_dict, "CONN_HEALTH_CHECKS", health_checks)  # the sender's, at connect
    with broker_at(django_settings.REDIS_URL):
        commit("before")
    with connection.cursor() as cursor:  # PostgreSQL restarted, or an operator ended the sender's session
        cursor.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                       "WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'")
        assert cursor.fetchone()
    with broker_at(django_settings.REDIS_URL):
        (cut,) = commit("cut")  # checked before use, a new connection; unchecked, the claim fails
        assert outbox.drain(timeout=30)
        commit("after")
    if health_checks:
        assert sent_names() == ["after", "before", "cut"]
    else:
        assert sent_names() == ["after", "before"]  # the failed batch's row is the relay's
        assert OutboxMessage.objects.get(pk=cut).sent_at is None
        settings.OUTBOX_GRACE_SECONDS = 0
        with broker_at(django_settings.REDIS_URL):
            assert outbox.relay_unsent() == 1
        assert sent_names() == ["after", "before", "cut"]


def _child_commits_and_sends() -> None:
    """In the forked child: its own commit, through a sender of its own; the parent's not touched."""
    inherited = outbox._sender
    try:
        commit("child")
        sender = outbox._sender
        ok = sender is not inherited and sender.pid == os.getpid() and outbox.stop_sender(timeout=30)
    finally:
        connection.close()
    os._exit(0 if ok else 1)


def test_a_forked_process_sends_through_a_sender_of_its_own(held_broker):
    """As gunicorn forks its workers: the child starts its own thread and queue; the parent's ids,
    one being published and one waiting at the fork, stay the parent's, sent once."""
    with broker_at(django_settings.REDIS_URL):
        commit("parent-in-flight")
        assert held_broker.entered.wait(timeout=30)
        commit("parent-waiting")
        connections.close_all()  # the test's own connection is not the child's to share
        child = multiprocessing.get_context("fork").Process(target=_child_commits_and_sends)
        child.start()
        child.join(timeout=60)
        assert child.exitcode == 0
        assert sent_names() == ["child"]
        held_broker.release()
    assert sent_names() == ["child", "parent-in-flight", "parent-waiting"]
    assert set(OutboxMessage.objects.values_list("tries", flat=True)) == {1}
    assert not OutboxMessage.objects.filter(sent_at__isnull=True).exists()


EXIT_RIGHT_AFTER_COMMIT = """
import os, sys, django
os.environ["DJANGO_SETTINGS_MODULE"] = "refundops.settings"
django.setup()
from django.db import transaction
from refundops import outbox
with transaction.atomic():
    outbox.send_after_commit("refundops.tasks.poll_refund", {"refund_id": "exiting"}, queue="default")
sys.exit(0)  # a graceful exit (gunicorn's worker, a management command) right after the commit
"""


def test_a_process_that_exits_right_after_its_commit_sends_what_its_sender_held():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_POOL", "DATABASE_CONN"))}
    env.update(DATABASE_URL=database_url(), REDIS_URL=django_settings.REDIS_URL, CELERY_TASK_ALWAYS_EAGER="false",
               REDIS_KEY_PREFIX=django_settings.REDIS_KEY_PREFIX)
    subprocess.run([sys.executable, "-c", EXIT_RIGHT_AFTER_COMMIT], cwd=ROOT, env=env, check=True, timeout=120)
    assert sent_names() == ["exiting"]
    assert OutboxMessage.objects.get().sent_at is not None


def test_inside_a_celery_task_the_nudge_runs_before_the_task_returns():
    """A worker's task commits its effects and sends them itself: no client waits on it, and a
    worker process Celery recycles or kills would otherwise take them along."""
    _task_stack.push(celery_app.tasks[POLL])
    try:
        with broker_at(django_settings.REDIS_URL):
            commit("from-a-task")
            assert OutboxMessage.objects.get().sent_at is not None  # before any drain
            assert outbox._sender is None
    finally:
        _task_stack.pop()
    assert sent_names() == ["from-a-task"]


POOLED_COMMITS = """
import threading
import time
import refundops.asgi  # noqa: F401 - as uvicorn imports it: a psycopg pool, here of one connection
from django.db import connection, transaction
from refundops import outbox

def one_request(i):  # as under ASGI: a thread of its own, its connection given back when it ends
    with transaction.atomic():
        outbox.send_after_commit("refundops.tasks.poll_refund", {"refund_id": f"pooled-{i}"}, queue="default")
    connection.close()

for i in range(4):
    thread = threading.Thread(target=one_request, args=(i,))
    thread.start()
    thread.join()
    assert outbox.drain(timeout=60)
"""


def test_under_the_pool_the_sender_gives_its_connection_back_after_each_batch():
    """With a pool of one connection, a sender that kept it would leave the next request waiting
    for the pool's timeout, and that request's row would never be written."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_POOL", "DATABASE_CONN"))}
    env.update(DATABASE_URL=database_url(), DATABASE_POOL_MIN="1", DATABASE_POOL_MAX="1",
               REDIS_URL=django_settings.REDIS_URL, REDIS_KEY_PREFIX=django_settings.REDIS_KEY_PREFIX,
               CELERY_TASK_ALWAYS_EAGER="false")
    subprocess.run([sys.executable, "-c", POOLED_COMMITS], cwd=ROOT, env=env, check=True, timeout=300)
    assert sent_names() == [f"pooled-{i}" for i in range(4)]
    assert not OutboxMessage.objects.filter(sent_at__isnull=True).exists()


def raw_queued(queue: str) -> list[dict]:
    client = redis.Redis.from_url(django_settings.REDIS_URL)
    return [json.loads(raw) for raw in client.lrange(f"{django_settings.REDIS_KEY_PREFIX}{queue}", 0, -1)]


def without_ids(message: dict) -> dict:
    """A message less what differs from one send to the next (its task id, delivery tag) and from
    one thread to the next (reply_to, a per-thread id)."""
    headers = {k: v for k, v in message["headers"].items() if k not in ("id", "root_id")}
    properties = {k: v for k, v in message["properties"].items() if k not in ("correlation_id", "reply_to")}
    properties["delivery_info"] = dict(properties["delivery_info"])
    properties.pop("delivery_tag")
    return {**message, "headers": headers, "properties": properties}


def test_the_sender_publishes_each_message_as_apply_async_would():
    """The sender builds its messages with Celery's own parts on a producer it keeps; what reaches
    the broker is what apply_async sends: headers (argsrepr, kwargsrepr, the request id), body,
    properties, routing (the router's queue for a submission written without one)."""
    rows = [("refundops.tasks.submit_refund", {"refund_id": "rf_nowhere"}, ""),  # the router: payments.sandbox
            (POLL, {"refund_id": "rf_polled"}, "default"),
            ("refundops.tasks.deliver_webhook", {"delivery_id": "wd_nowhere"}, "")]
    with broker_at(django_settings.REDIS_URL):
        bind_request_id("req-sent")
        try:
            with transaction.atomic():
                for task, kwargs, queue in rows:
                    outbox.send_after_commit(task, kwargs, queue=queue)
        finally:
            structlog.contextvars.clear_contextvars()
    by_sender = {q: raw_queued(q) for q in ("payments.sandbox", "default")}
    redis.Redis.from_url(django_settings.REDIS_URL).delete(
        *(f"{django_settings.REDIS_KEY_PREFIX}{q}" for q in by_sender))
    with broker_at(django_settings.REDIS_URL):
        bind_request_id("req-sent")
        try:
            for row in OutboxMessage.objects.order_by("pk"):  # kwargs as jsonb keeps them (keys reordered)
                celery_app.tasks[row.task].apply_async(kwargs=row.kwargs, queue=row.queue or None, retry=False)
        finally:
            structlog.contextvars.clear_contextvars()
    by_apply_async = {q: raw_queued(q) for q in by_sender}
    assert [len(by_sender[q]) for q in by_sender] == [1, 2]
    for queue, messages in by_sender.items():
        def key(message: dict) -> str:
            return message["headers"]["task"]

        assert ([without_ids(m) for m in sorted(messages, key=key)]  # a batch's order is the claim's, not the ids'
                == [without_ids(m) for m in sorted(by_apply_async[queue], key=key)])
        assert all(m["headers"]["refundops_request_id"] == "req-sent" for m in messages)
        assert all(m["properties"]["reply_to"] for m in messages)


def test_a_batch_the_broker_refused_is_the_relays_and_the_next_goes_through(monkeypatch, settings):
    """A batch the broker refused (kombu's publish batch, on a producer from Celery's pool) leaves
    its rows to the relay, and the next batch is sent."""
    with broker_at(django_settings.REDIS_URL):
        commit("before")
        assert outbox.drain(timeout=30)
        flush = kombu_redis.PublishBatch.flush
        refusals = []

        def refused_once(self):
            if not refusals:
                refusals.append(self)
                self.pipeline.reset()
                raise redis.exceptions.ConnectionError("Connection reset by peer")
            return flush(self)

        monkeypatch.setattr(kombu_redis.PublishBatch, "flush", refused_once)
        (refused,) = commit("refused")
        assert outbox.drain(timeout=30)
        commit("after")
    assert refusals
    assert sent_names() == ["after", "before"]
    row = OutboxMessage.objects.get(pk=refused)
    assert row.sent_at is None and "Connection reset by peer" in row.last_error
    settings.OUTBOX_GRACE_SECONDS = 0
    with broker_at(django_settings.REDIS_URL):
        assert outbox.relay_unsent() == 1
    assert sent_names() == ["after", "before", "refused"]


def test_the_senders_producer_follows_the_apps_broker():
    """The sender publishes where the app says: a broker moved (here to one that is down) is the one
    the next batch goes to."""
    from tests.test_outbox import DEAD_BROKER

    with broker_at(django_settings.REDIS_URL):
        commit("up")
    with broker_at(DEAD_BROKER):
        (down,) = commit("down")
    assert sent_names() == ["up"]
    assert OutboxMessage.objects.get(pk=down).sent_at is None


def test_commits_made_while_the_sender_lingers_go_out_in_one_batch_and_a_stop_ends_the_wait(monkeypatch):
    """After the first id comes the sender waits SENDER_LINGER_SECONDS for more: commits made
    meanwhile share one claim, one publish and one mark. A process stopping does not wait it out."""
    monkeypatch.setattr(outbox, "SENDER_LINGER_SECONDS", 60)
    claims: list[int] = []
    claim = outbox._claim
    monkeypatch.setattr(outbox, "_claim", lambda **kw: claims.append(len(kw["ids"])) or claim(**kw))
    with broker_at(django_settings.REDIS_URL):
        commit("first")
        commit("second-a", "second-b")
        commit("third")
        assert claims == []  # lingering
        started = time.monotonic()
        assert outbox.stop_sender(timeout=30)
        assert time.monotonic() - started < 10
    assert claims == [4]
    assert sent_names() == ["first", "second-a", "second-b", "third"]


COUNT = "refundops.tasks.count_agent_refund"


def commit_count(amount_minor: int = 500) -> int:
    with transaction.atomic():
        return outbox.send_after_commit(COUNT, {"amount_minor": amount_minor, "currency": "USD",
                                                "at": "2026-12-01T08:00:00+00:00"}).pk


def test_the_sender_counts_for_the_breaker_itself_and_without_its_redis_leaves_the_count_to_the_relay(settings):
    """The breaker's count is run by the sender in its process (one Redis script), not sent to a
    worker; its row is still the outbox's: with the breaker's Redis away it is kept, and the relay
    sends it to a worker as count_agent_refund."""
    redis_url = django_settings.REDIS_URL
    with broker_at(redis_url):
        commit_count()
    assert breaker_counted() == 1 and queued("default") == []
    assert not OutboxMessage.objects.filter(sent_at__isnull=True).exists()

    settings.REDIS_URL = "redis://127.0.0.1:1/0"  # the breaker's store, not the broker
    with broker_at(redis_url):
        kept = commit_count()
    row = OutboxMessage.objects.get(pk=kept)
    assert row.sent_at is None and row.tries == 1 and "ApiError" in row.last_error
    settings.REDIS_URL = redis_url
    assert breaker_counted() == 1

    settings.OUTBOX_GRACE_SECONDS = 0
    with broker_at(redis_url):
        assert outbox.relay_unsent() == 1
    assert [m["task"] for m in queued("default")] == [COUNT]  # for a worker, which retries while Redis is away


def test_a_trip_counted_by_the_sender_mails_the_operators_through_a_worker(settings):
    """The count that trips the breaker runs in the sender's thread; the operators' mail is a task
    (refundops.tasks.mail_operators) sent through the outbox with the request's id, never mailed
    from the sender, nor from a request's thread."""
    from django.core import mail

    from audit.models import AuditEntry

    settings.BREAKER_MIN_COUNT = 0  # the first count trips it
    settings.OPERATOR_EMAILS = ["ops@example.com"]
    with broker_at(django_settings.REDIS_URL):
        bind_request_id("req-trip")
        try:
            commit_count()
        finally:
            structlog.contextvars.clear_contextvars()
    assert AuditEntry.objects.filter(action="breaker.opened").count() == 1
    assert mail.outbox == []
    assert [m["task"] for m in queued("default")] == ["refundops.tasks.mail_operators"]
    assert queued("default")[0]["kwargs"]["subject"] == "RefundOps: agent refunds paused by the breaker"
    assert request_ids_queued("default") == {"refundops.tasks.mail_operators": "req-trip"}
    assert not OutboxMessage.objects.filter(sent_at__isnull=True).exists()

    celery_app.tasks["refundops.tasks.mail_operators"](**queued("default")[0]["kwargs"])  # as a worker runs it
    assert [m.to for m in mail.outbox] == [["ops@example.com"]]


EXIT_RIGHT_AFTER_A_TRIP = """
import os, sys, django
os.environ["DJANGO_SETTINGS_MODULE"] = "refundops.settings"
django.setup()
from django.db import transaction
from refundops import outbox
from refundops.logs import bind_request_id
bind_request_id("req-exit-trip")
with transaction.atomic():
    outbox.send_after_commit("refundops.tasks.count_agent_refund",
                             {"amount_minor": 500, "currency": "USD", "at": "2026-12-01T08:00:00+00:00"})
sys.exit(0)  # a graceful exit right after the commit: the sender counts it at exit, and it trips
"""


def test_a_trip_counted_by_the_sender_at_exit_sends_its_mail_before_the_process_ends():
    """At exit the sender is stopping (stop_sender has let go of it) when the count it sends last
    trips the breaker: the mail's row, committed in the sender's thread, goes out with it, not to a
    new sender that the exit kills while it lingers (the operators would hear of the trip only when
    the relay finds the row, OUTBOX_GRACE_SECONDS later, or a claim's 60 s after that)."""
    from audit.models import AuditEntry

    env = {k: v for k, v in os.environ.items() if not k.startswith(("DATABASE_POOL", "DATABASE_CONN"))}
    env.update(DATABASE_URL=database_url(), REDIS_URL=django_settings.REDIS_URL, CELERY_TASK_ALWAYS_EAGER="false",
               REDIS_KEY_PREFIX=django_settings.REDIS_KEY_PREFIX, BREAKER_MIN_COUNT="0")
    subprocess.run([sys.executable, "-c", EXIT_RIGHT_AFTER_A_TRIP], cwd=ROOT, env=env, check=True, timeout=120)
    assert AuditEntry.objects.filter(action="breaker.opened").count() == 1
    assert [m["task"] for m in queued("default")] == ["refundops.tasks.mail_operators"]
    assert request_ids_queued("default") == {"refundops.tasks.mail_operators": "req-exit-trip"}
    assert not OutboxMessage.objects.filter(sent_at__isnull=True).exists()
