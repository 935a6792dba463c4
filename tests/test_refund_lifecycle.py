"""The refund state machine, and a refund's way from the agent to the gateway and back."""

from __future__ import annotations

import threading
import time

import pytest
from django.db import connection
from django_fsm import TransitionNotAllowed

from processors import sandbox
from processors.base import RefundRequest
from processors.models import SandboxRefund
from processors.redis_client import redis_client, redis_key
from processors.registry import get_processor
from refundops.celery import app as celery_app
from refundops.models import Refund, RefundState
from refundops.services import payouts
from refundops.services.attempts import RetryLater
from tests.conftest import make_payment, post
from tests.fakes.fixtures import wait_for

S = RefundState
# Every transition method and the states it may start from (the contract's diagram).
ALLOWED = {
    "approve_automatically": {S.REQUESTED},
    "hold": {S.REQUESTED},
    "deny": {S.REQUESTED},
    "approve": {S.HELD},
    "reject": {S.HELD},
    "expire": {S.HELD},
    "submit": {S.APPROVED},
    "settle": {S.SUBMITTED},
    "fail": {S.APPROVED, S.SUBMITTED, S.SETTLED},
    "resubmit": {S.FAILED},
    "resubmit_for_decision": {S.FAILED},
    "cancel": {S.REQUESTED, S.HELD, S.APPROVED, S.SUBMITTED},
}
TARGET = {"approve_automatically": S.APPROVED, "hold": S.HELD, "deny": S.DENIED, "approve": S.APPROVED,
          "reject": S.REJECTED, "expire": S.EXPIRED, "submit": S.SUBMITTED, "settle": S.SETTLED,
          "fail": S.FAILED, "resubmit": S.APPROVED, "resubmit_for_decision": S.HELD, "cancel": S.CANCELED}
KWARGS = {"hold": {"reasons": ["APPROVAL_REQUIRED"]}, "deny": {"code": "X", "message": "m"},
          "submit": {"processor_refund_id": "sbre_1", "at": None}, "settle": {"at": None},
          "fail": {"code": "X", "message": "m"}, "resubmit": {"at": None},
          "resubmit_for_decision": {"at": None, "reasons": ["PAYMENT_FLAGGED"]}}

def _refund_in(state: str) -> Refund:
    refund = Refund(amount_minor=1, currency="USD", reason="duplicate")
    refund.__dict__["status"] = state  # a bare instance in any state, without the database
    return refund

@pytest.mark.parametrize("method", sorted(ALLOWED))
@pytest.mark.parametrize("state", [s.value for s in S])
def test_every_state_move_is_allowed_or_refused_as_the_contract_says(method, state):
    refund = _refund_in(state)
    move = getattr(refund, method)
    if state in ALLOWED[method]:
        move(**KWARGS.get(method, {}))
        assert refund.status == TARGET[method]
    else:
        with pytest.raises(TransitionNotAllowed):
            move(**KWARGS.get(method, {}))
        assert refund.status == state

def test_the_state_field_cannot_be_set_directly():
    refund = Refund(amount_minor=1, currency="USD", reason="duplicate")
    with pytest.raises(AttributeError):
        refund.status = S.SETTLED

@pytest.fixture
def worker_never_runs():
    """Approved refunds are queued to a broker nobody reads: as if the worker died."""
    celery_app.conf.task_always_eager = False
    broker = celery_app.conf.broker_url
    celery_app.conf.broker_url = "memory://"
    yield
    celery_app.conf.broker_url = broker
    celery_app.conf.task_always_eager = True

def status_of(refund_id: str) -> str:
    return Refund.objects.values_list("status", flat=True).get(pk=refund_id)

@pytest.mark.django_db(transaction=True)
def test_end_to_end_agent_to_sandbox_to_settled(api, policy, worker):
    sandbox.set_mode("up", settle_delay_seconds=1)
    payment = make_payment(amount=5_000)
    response = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 1_250,
                                             "reason": "product_issue"})
    assert response.status_code == 201
    rf = response.json()["refund"]["id"]
    wait_for(lambda: status_of(rf) == S.SETTLED, what="settled")
    refund = Refund.objects.get(pk=rf)
    moves = [h.status for h in refund.history.order_by("history_date")]
    assert moves == [S.REQUESTED, S.APPROVED, S.SUBMITTED, S.SETTLED]
    gateway = SandboxRefund.objects.get(reference=refund.processor_refund_id)
    assert gateway.amount_minor == 1_250 and gateway.metadata["verdict_id"] == refund.verdict_id
    payment.refresh_from_db()
    assert (payment.amount_refunded_minor, payment.amount_reserved_minor) == (1_250, 0)
    assert api.get(f"/api/v1/refunds/{rf}").json()["refund"]["status"] == "settled"

@pytest.mark.django_db(transaction=True)
def test_gateway_down_keeps_the_refund_approved_and_retries_until_it_settles(api, policy, worker):
    sandbox.set_mode("down", settle_delay_seconds=0)
    payment = make_payment(amount=5_000)
    rf = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 700,
                                       "reason": "duplicate"}).json()["refund"]["id"]
    wait_for(lambda: int(redis_client().hget(redis_key("metrics:gateway:sandbox"), "unavailable:count") or 0) >= 2,
             what="two tries while the gateway is down")  # as /metrics counts them
    assert status_of(rf) == S.APPROVED
    assert not SandboxRefund.objects.exists()
    detail = api.get(f"/api/v1/refunds/{rf}").json()["refund"]
    assert detail["pending_at_gateway"] is True and "on its way" in detail["suggested_message"]
    sandbox.set_mode("up")
    wait_for(lambda: status_of(rf) == S.SETTLED, what="settled after the outage")
    assert SandboxRefund.objects.count() == 1

@pytest.mark.django_db(transaction=True)
def test_a_worker_that_died_after_the_gateway_call_does_not_pay_twice(policy, api, worker_never_runs):
    sandbox.set_mode("up", settle_delay_seconds=0)
    payment = make_payment(amount=5_000)
    rf = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 900,
                                       "reason": "duplicate"}).json()["refund"]["id"]
    refund = Refund.objects.select_related("payment").get(pk=rf)
    # The gateway call went through, then the worker died before recording it.
    get_processor("sandbox").refund(RefundRequest(payment=payouts.payment_ref(refund.payment), amount=refund.money,
                                   reason=refund.reason, idempotency_key=payouts.gateway_idempotency_key(refund),
                                   refund_id=refund.pk, verdict_id=refund.verdict_id))
    assert status_of(rf) == S.APPROVED
    payouts.submit_refund(refund_id=rf)  # the retry
    assert status_of(rf) == S.SETTLED
    assert SandboxRefund.objects.count() == 1

@pytest.mark.django_db(transaction=True)
def test_racing_submissions_of_one_refund_pay_once(policy, api, worker_never_runs):
    sandbox.set_mode("up", settle_delay_seconds=0)
    payment = make_payment(amount=5_000)
    rf = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 900,
                                       "reason": "duplicate"}).json()["refund"]["id"]
    barrier, errors = threading.Barrier(8), []

    def submit():
        try:
            barrier.wait()
            payouts.submit_refund(refund_id=rf)
        except RetryLater:
            pass  # another worker holds the refund's lease: this task would come back later
        except Exception as exc:  # noqa: BLE001 - collected and asserted below
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=submit) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert SandboxRefund.objects.count() == 1
    assert status_of(rf) == S.SETTLED
