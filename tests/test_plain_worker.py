"""A plain `celery -A refundops worker`, as an operator starts one, consumes every routed queue: the
app declares them (task_queues), so nobody has to know the `-Q` list. (Issue 13, finding 2.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from django.conf import settings

from processors import sandbox
from refundops.celery import app as celery_app
from refundops.models import Refund, RefundState
from tests.conftest import make_payment, post
from tests.fakes.fixtures import wait_for

ROOT = Path(__file__).resolve().parent.parent


def database_url() -> str:
    db = settings.DATABASES["default"]
    return f"postgres://{db['USER']}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


@pytest.fixture
def plain_worker(tmp_path):
    """`celery -A refundops worker` with no -Q, in a process of its own, on the test database."""
    log = open(tmp_path / "worker.log", "w+")
    env = {**os.environ, "DATABASE_URL": database_url(), "REDIS_URL": settings.REDIS_URL,
           "REDIS_KEY_PREFIX": settings.REDIS_KEY_PREFIX, "CELERY_TASK_ALWAYS_EAGER": "false",
           "REFUND_FIRST_SYNC_SECONDS": "1", "DATABASE_POOL": "false",
           "MERCHANT_WEBHOOK_ALLOW_PRIVATE": "true"}  # a merchant receiver on this machine
    process = subprocess.Popen([sys.executable, "-m", "celery", "-A", "refundops", "worker", "--pool", "solo",
                                "--loglevel", "INFO"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                               start_new_session=True)
    celery_app.conf.task_always_eager = False
    broker = celery_app.conf.broker_url
    celery_app.conf.broker_url = settings.REDIS_URL
    try:
        wait_for(lambda: " ready." in (tmp_path / "worker.log").read_text(), timeout=90, what="worker ready")
        yield tmp_path / "worker.log"
    finally:
        celery_app.conf.broker_url = broker
        celery_app.conf.task_always_eager = True
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=60)
        log.close()


def test_the_app_declares_every_gateway_queue():
    declared = set(celery_app.amqp.queues)
    assert {"default", "payments.sandbox", "payments.stripe", "payments.paypal"} <= declared


@pytest.mark.django_db(transaction=True)
def test_a_plain_worker_settles_a_refund(api, policy, plain_worker):
    sandbox.set_mode("up", settle_delay_seconds=0)
    payment = make_payment(amount=5_000)
    response = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 900,
                                             "reason": "product_issue"})
    assert response.status_code == 201, response.json()
    refund_id = response.json()["refund"]["id"]
    status = lambda: Refund.objects.values_list("status", flat=True).get(pk=refund_id)  # noqa: E731
    wait_for(lambda: status() == RefundState.SETTLED, timeout=90,
             what=f"settled by the plain worker; its log:\n{plain_worker.read_text()[-3000:]}")
    assert "payments.sandbox" in plain_worker.read_text()  # it said which queues it consumes
