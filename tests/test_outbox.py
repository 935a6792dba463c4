"""The transactional outbox: every effect that must follow a commit is a row of the deciding
transaction, nudged to the broker on commit and swept by beat. A broker outage never fails a
committed request and never loses its effects; one failing effect never skips another; two
senders never send one row twice. The broker is the real Redis, made unreachable by pointing the
Celery app at a dead port or by refusing one message at kombu's Redis transport."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import pytest
import redis
from celery.contrib.testing.worker import start_worker
from django.conf import settings as django_settings
from django.db import transaction
from django.utils import timezone
from kombu.transport import redis as kombu_redis

from processors import sandbox
from refundops import outbox
from refundops.celery import app as celery_app
from refundops.models import (
    MerchantEndpoint,
    OutboxMessage,
    Refund,
    RefundState,
    WebhookDelivery,
)
from refundops.tasks import deliver_overdue_webhooks, relay_outbox
from tests.conftest import make_payment, post, race
from tests.fakes.fixtures import wait_for
from tests.test_health_and_metrics import TOKEN, metrics, sample
from tests.test_webhooks_out import MerchantReceiver

pytestmark = pytest.mark.django_db(transaction=True)  # real commits: the outbox acts on them

DEAD_BROKER = "redis://127.0.0.1:9/0"  # nothing listens on the discard port


@contextmanager
def broker_at(url: str) -> Iterator[None]:
    """Publish to ``url`` for real (not eagerly), as a fresh process would: no pooled connection.
    Commits meanwhile are sent by the outbox's sender thread: what it was handed is sent (or
    refused) by the end of the block."""
    conf = celery_app.conf
    saved = conf.broker_url, conf.task_always_eager
    conf.broker_url, conf.task_always_eager = url, False
    celery_app._after_fork()  # Celery's own reset of its connection and producer pools
    try:
        yield
        assert outbox.drain(timeout=30)
    finally:
        conf.broker_url, conf.task_always_eager = saved
        celery_app._after_fork()


def queued(queue: str) -> list[dict]:
    """The messages waiting in one Redis queue, as (task name, kwargs)."""
    client = redis.Redis.from_url(django_settings.REDIS_URL)
    messages = []
    for raw in client.lrange(f"{django_settings.REDIS_KEY_PREFIX}{queue}", 0, -1):
        message = json.loads(raw)
        _, kwargs, _ = json.loads(base64.b64decode(message["body"]))
        messages.append({"task": message["headers"]["task"], "kwargs": kwargs})
    return messages


def test_a_broker_outage_at_commit_answers_201_and_the_relay_sends_the_submission_later(
        api, policy, worker, settings):
    sandbox.set_mode("up", settle_delay_seconds=0)
    payment = make_payment(amount=5_000)

    with broker_at(DEAD_BROKER):
        response = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 1_000,
                                                 "reason": "duplicate"})

    assert response.status_code == 201, response.content  # the approval stands: the caller is told so
    refund = Refund.objects.get(pk=response.json()["refund"]["id"])
    assert refund.status == RefundState.APPROVED
    submission = OutboxMessage.objects.get(task="refundops.tasks.submit_refund")
    assert submission.kwargs == {"refund_id": refund.pk} and submission.queue == "payments.sandbox"
    assert submission.sent_at is None and submission.tries == 1 and submission.last_error
    # The breaker's count is the sender's own (its Redis, not the broker): counted all the same.
    assert OutboxMessage.objects.get(task="refundops.tasks.count_agent_refund").sent_at is not None
    settings.METRICS_TOKEN = TOKEN
    _, body = metrics(HTTP_AUTHORIZATION=f"Bearer {TOKEN}")  # what operators alert on
    assert sample(body, "refundops_outbox_unsent") == 1
    assert sample(body, "refundops_outbox_oldest_unsent_age_seconds") > 0

    settings.OUTBOX_GRACE_SECONDS = 0
    assert relay_outbox() == 1  # beat's sweep, with the broker back (the worker fixture's Redis)
    assert sample(metrics(HTTP_AUTHORIZATION=f"Bearer {TOKEN}")[1], "refundops_outbox_unsent") == 0

    wait_for(lambda: Refund.objects.get(pk=refund.pk).status == RefundState.SETTLED, what="settled")
    submission.refresh_from_db()
    assert submission.sent_at is not None and submission.tries == 2
    assert relay_outbox() == 0  # sent once: the next sweep finds nothing


def test_one_effect_the_broker_refuses_never_keeps_the_others_from_going(api, policy, monkeypatch):
    refused: list[str] = []
    put = kombu_redis.Channel._put

    def refuse_the_submission(self, queue, message, **kwargs):  # the broker refuses one message
        if message["headers"]["task"] == "refundops.tasks.submit_refund":
            refused.append(message["headers"]["id"])
            raise redis.exceptions.ConnectionError("Connection reset by peer")
        return put(self, queue, message, **kwargs)

    monkeypatch.setattr(kombu_redis.Channel, "_put", refuse_the_submission)
    payment = make_payment(amount=5_000)

    with broker_at(django_settings.REDIS_URL):
        response = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 1_000,
                                                 "reason": "duplicate"})

    assert response.status_code == 201
    refund_id = response.json()["refund"]["id"]
    assert refused  # the submission was refused, and is kept
    submission = OutboxMessage.objects.get(task="refundops.tasks.submit_refund")
    assert submission.sent_at is None and "Connection reset by peer" in submission.last_error
    count = OutboxMessage.objects.get(task="refundops.tasks.count_agent_refund")
    assert count.sent_at is not None  # the other effect (the breaker's count, the sender's own) went
    assert queued("payments.sandbox") == []

    poll = OutboxMessage.objects.create(  # written after the submission; its nudge died with its process
        task="refundops.tasks.poll_refund", kwargs={"refund_id": refund_id}, queue="default",
        created_at=timezone.now() - timedelta(minutes=1))
    with broker_at(django_settings.REDIS_URL):  # the relay, too, goes on past a refused row
        assert outbox.relay_unsent(older_than_seconds=0) == 1
    submission.refresh_from_db()
    assert submission.sent_at is None and submission.tries == 2  # tried again, refused again, kept
    assert OutboxMessage.objects.get(pk=poll.pk).sent_at is not None
    assert queued("default") == [{"task": "refundops.tasks.poll_refund", "kwargs": {"refund_id": refund_id}}]


def test_rows_that_keep_failing_never_keep_the_relay_from_the_rows_behind_them():
    """The relay takes at most ``limit`` rows a sweep: rows it tried and failed go behind the ones
    it has not tried, so three old rows that fail every time (a task this process lacks) cannot
    hold back a fourth for ever. (Issue 27, finding 3: the outbox relay.)"""
    hour_ago = timezone.now() - timedelta(hours=1)
    failing = OutboxMessage.objects.bulk_create([
        OutboxMessage(task="refundops.tasks.no_such_task", kwargs={"n": i}, queue="default",
                      created_at=hour_ago, next_try_at=hour_ago) for i in range(3)])
    (behind,) = OutboxMessage.objects.bulk_create([OutboxMessage(
        task="refundops.tasks.poll_refund", kwargs={"refund_id": "behind"}, queue="default",
        created_at=hour_ago + timedelta(minutes=1), next_try_at=hour_ago + timedelta(minutes=1))])
    with broker_at(django_settings.REDIS_URL):
        assert outbox.relay_unsent(older_than_seconds=0, limit=3) == 0  # the three oldest, each refused
        assert outbox.relay_unsent(older_than_seconds=0, limit=3) == 1  # then the one behind them
    assert OutboxMessage.objects.get(pk=behind.pk).sent_at is not None
    assert queued("default") == [{"task": "refundops.tasks.poll_refund", "kwargs": {"refund_id": "behind"}}]
    for message in OutboxMessage.objects.filter(pk__in=[m.pk for m in failing]):
        assert message.sent_at is None and message.tries >= 1 and message.last_error  # kept, for the next sweeps


def test_the_nudge_and_two_relays_racing_send_each_row_once(settings):
    settings.OUTBOX_GRACE_SECONDS = 0  # the relays take a row the moment it is committed
    n = 80

    def write_then_nudge() -> None:
        with transaction.atomic():  # committed at once; then each row's nudge sends it
            for i in range(n):
                outbox.send_after_commit("refundops.tasks.poll_refund", {"refund_id": f"rf_{i}"}, queue="default")

    def relay_until_all_sent() -> int:
        relayed, deadline = 0, time.monotonic() + 20
        while time.monotonic() < deadline and (
                OutboxMessage.objects.count() < n or OutboxMessage.objects.filter(sent_at__isnull=True).exists()):
            relayed += outbox.relay_unsent(limit=3)
        return relayed

    with broker_at(django_settings.REDIS_URL):
        race(3, lambda i: write_then_nudge() if i == 0 else relay_until_all_sent())

    messages = queued("default")
    assert sorted(m["kwargs"]["refund_id"] for m in messages) == sorted(f"rf_{i}" for i in range(n))
    assert not OutboxMessage.objects.filter(sent_at__isnull=True).exists()
    assert set(OutboxMessage.objects.values_list("tries", flat=True)) == {1}  # each claimed once


def test_the_relay_forgets_rows_sent_long_ago_and_never_an_unsent_one(settings):
    settings.OUTBOX_KEEP_SENT_DAYS = 7
    now = timezone.now()
    old_sent, recent_sent, old_unsent = (
        OutboxMessage.objects.create(task="refundops.tasks.poll_refund", kwargs={"refund_id": name},
                                     created_at=now - timedelta(days=days), sent_at=sent, next_try_at=now + timedelta(hours=1))
        for name, days, sent in (("old", 8, now - timedelta(days=8)), ("recent", 6, now - timedelta(days=6)),
                                 ("unsent", 30, None)))
    relay_outbox()
    assert set(OutboxMessage.objects.values_list("pk", flat=True)) == {recent_sent.pk, old_unsent.pk}


# -- merchant webhooks: written with the change, sent through the outbox, swept when lost ---------

@pytest.fixture
def merchant() -> Iterator[MerchantReceiver]:
    fake = MerchantReceiver().start()
    MerchantEndpoint.objects.create(url=f"{fake.url}/hooks/refundops")
    yield fake
    fake.stop()


def test_a_broker_outage_at_commit_delays_the_merchant_webhooks_and_loses_none(api, policy, worker, merchant,
                                                                             settings):
    sandbox.set_mode("up", settle_delay_seconds=0)
    payment = make_payment(amount=5_000)

    with broker_at(DEAD_BROKER):
        response = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 1_000,
                                                 "reason": "duplicate"})

    assert response.status_code == 201
    assert WebhookDelivery.objects.filter(status="pending").count() == 2  # requested, approved: written
    assert OutboxMessage.objects.filter(task="refundops.tasks.deliver_webhook", sent_at__isnull=True).count() == 2
    assert merchant.received == []

    settings.OUTBOX_GRACE_SECONDS = 0
    relay_outbox()  # the broker is back

    wanted = ["refund.requested", "refund.approved", "refund.submitted", "refund.settled"]
    wait_for(lambda: sorted(e["type"] for e in merchant.events()) == sorted(wanted), what="four events")
    wait_for(lambda: WebhookDelivery.objects.filter(status="delivered").count() == 4, what="deliveries logged")


def test_deliveries_whose_task_was_lost_are_delivered_by_the_sweep(api, policy, merchant, settings):
    payment = make_payment(amount=5_000)
    with broker_at(django_settings.REDIS_URL):  # no worker yet: the tasks wait in Redis
        response = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 1_000,
                                                 "reason": "duplicate"})
    assert response.status_code == 201
    assert not OutboxMessage.objects.filter(sent_at__isnull=True).exists()  # sent: the broker had them
    assert [m["task"] for m in queued("default")].count("refundops.tasks.deliver_webhook") == 2
    client = redis.Redis.from_url(django_settings.REDIS_URL)  # Redis restarts without its queues
    client.delete(*client.scan_iter(match=f"{django_settings.REDIS_KEY_PREFIX}*"))

    settings.WEBHOOK_OVERDUE_SECONDS = 0
    with broker_at(django_settings.REDIS_URL), start_worker(
            celery_app, pool="threads", concurrency=2, perform_ping_check=False,
            queues=django_settings.CELERY_WORKER_QUEUES, loglevel="WARNING", shutdown_timeout=10):
        assert deliver_overdue_webhooks() == 2
        wait_for(lambda: sorted(e["type"] for e in merchant.events()) == ["refund.approved", "refund.requested"],
                 what="both events")
        wait_for(lambda: WebhookDelivery.objects.filter(status="delivered").count() == 2, what="deliveries logged")
    assert deliver_overdue_webhooks() == 0


@pytest.mark.django_db(transaction=True)
def test_an_eager_task_that_nudges_its_own_rows_never_holds_two_of_the_brokers_producers(api, policy, monkeypatch):
    """Eagerly (tests, CELERY_TASK_ALWAYS_EAGER) a task runs inside the publish that sends it; the
    submission's own commit nudges its rows again. Were the outer nudge to hold a producer from the
    broker's pool meanwhile, threads doing this at once would empty the pool and wait on each other
    for ever (32 racing refunds did)."""
    original = celery_app.producer_or_acquire
    depth = {"now": 0, "most": 0}

    @contextmanager
    def counted(*args, **kwargs):
        with original(*args, **kwargs) as producer:
            depth["now"] += 1
            depth["most"] = max(depth["most"], depth["now"])
            try:
                yield producer
            finally:
                depth["now"] -= 1

    monkeypatch.setattr(celery_app, "producer_or_acquire", counted)
    response = post(api, "/api/v1/refunds", {"transaction_id": make_payment().pk, "amount": 500,
                                             "reason": "duplicate"})
    assert response.status_code == 201
    refund = Refund.objects.get(pk=response.json()["refund"]["id"])
    assert refund.status in (RefundState.SUBMITTED, RefundState.SETTLED)  # paid inside the publish
    assert depth["most"] <= 1
    assert not OutboxMessage.objects.filter(sent_at__isnull=True).exists()
