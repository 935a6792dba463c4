"""Merchant webhooks out: every refund state change, signed, delivered by the real worker to a
local receiver over a real socket, retried with backoff, logged, and redeliverable by hand."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from datetime import timedelta

import pytest
from django.conf import settings
from django.db import transaction
from django.utils import timezone

from approvals.services import (
    approve_refund,
    expire_held_refunds,
    reject_refund,
    resubmit_refund,
)
from audit.models import AuditEntry
from processors import sandbox, signing
from processors.base import RefundResult, WebhookEvent
from processors.money import Money
from refundops import outbound
from refundops.models import (
    MerchantEndpoint,
    OutboxMessage,
    Refund,
    RefundState,
    WebhookDelivery,
)
from refundops.services import payouts
from refundops.services.gateway_events import record_external_refund
from tests.conftest import make_payment, post
from tests.fakes import FakeGateway, Request, Response
from tests.fakes.fixtures import wait_for
from tests.test_approvals import approver, held_policy, held_refund  # noqa: F401 - held_policy is a fixture

S = RefundState


class MerchantReceiver(FakeGateway):
    """A merchant's endpoint: answers the scripted statuses in turn, then 200."""

    name = "merchant"

    def __init__(self) -> None:
        super().__init__()
        self.script: list[int] = []

    def handle(self, request: Request) -> Response:
        status = self.script.pop(0) if self.script else 200
        return Response(status, b'{"ok": true}', {"Content-Type": "application/json"})

    def events(self) -> list[dict]:
        with self.lock:
            return [json.loads(request.body) for request in self.received]


@pytest.fixture
def receiver() -> Iterator[MerchantReceiver]:
    fake = MerchantReceiver().start()
    yield fake
    fake.stop()


@pytest.fixture
def endpoint(db, receiver: MerchantReceiver) -> MerchantEndpoint:
    return MerchantEndpoint.objects.create(url=f"{receiver.url}/hooks/refundops")


def announced_held_refund(payment) -> Refund:
    """A held refund as a service writes it: with its event, in one transaction."""
    with transaction.atomic():
        refund = Refund.objects.create(payment=payment, amount_minor=100, currency="USD", reason="duplicate",
                                       status=S.HELD)
        outbound.announce_refund(refund, previous=None)
    return refund


def types_received(receiver: MerchantReceiver) -> list[str]:
    return [event["type"] for event in receiver.events()]


@pytest.mark.django_db(transaction=True)
def test_every_state_change_of_a_refund_reaches_the_merchant_signed(api, policy, worker, receiver, endpoint):
    sandbox.set_mode("up", settle_delay_seconds=0)
    payment = make_payment(amount=5_000)

    rf = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 1_000,
                                       "reason": "duplicate"}).json()["refund"]["id"]

    wanted = ["refund.requested", "refund.approved", "refund.submitted", "refund.settled"]
    wait_for(lambda: sorted(types_received(receiver)) == sorted(wanted), what="four events")
    for request in receiver.received:
        signing.verify(request.body, request.header("RefundOps-Signature"), endpoint.secret)  # raises if not
        assert request.header("Content-Type") == "application/json"
    settled = next(e for e in receiver.events() if e["type"] == "refund.settled")
    assert settled["data"]["object"]["id"] == rf and settled["data"]["object"]["status"] == "settled"
    assert settled["data"]["previous_status"] == "submitted"
    assert len({e["id"] for e in receiver.events()}) == 4
    wait_for(lambda: WebhookDelivery.objects.filter(status="delivered").count() == 4, what="deliveries logged")


@pytest.mark.django_db(transaction=True)
def test_a_failed_delivery_is_retried_with_backoff_until_it_lands(worker, receiver, endpoint):
    receiver.script = [500, 503]
    payment = make_payment(amount=5_000)
    endpoint.event_types = ["refund.held"]
    endpoint.save()

    announced_held_refund(payment)

    delivery = wait_for(lambda: WebhookDelivery.objects.filter(status="delivered").first(), what="delivered")
    assert (delivery.attempts, delivery.response_code, delivery.last_error) == (3, 200, "")
    assert delivery.delivered_at is not None and delivery.next_attempt_at is None
    event_ids = {event["id"] for event in receiver.events()}
    assert len(receiver.received) == 3 and event_ids == {delivery.event_id}


@pytest.mark.django_db(transaction=True)
def test_a_delivery_that_gave_up_can_be_redelivered_by_hand(settings, worker, receiver, endpoint):
    settings.WEBHOOK_MAX_ATTEMPTS = 2
    receiver.script = [500, 500]
    payment = make_payment(amount=5_000)
    announced_held_refund(payment)
    failed = wait_for(lambda: WebhookDelivery.objects.filter(status="failed").first(), what="gave up")
    assert (failed.attempts, failed.response_code) == (2, 500) and "HTTP 500" in failed.last_error

    outbound.redeliver(failed.pk, actor="user:ops")

    delivered = wait_for(lambda: WebhookDelivery.objects.filter(pk=failed.pk, status="delivered").first(),
                         what="redelivered")
    assert delivered.attempts == 3
    assert len({event["id"] for event in receiver.events()}) == 1
    assert AuditEntry.objects.filter(action="webhook.redelivered", subject_id=failed.pk).exists()


@pytest.mark.django_db
def test_an_endpoint_gets_only_the_events_it_asked_for_and_inactive_ones_none():
    settled_only = MerchantEndpoint.objects.create(url="http://127.0.0.1:9/a", event_types=["refund.settled"])
    MerchantEndpoint.objects.create(url="http://127.0.0.1:9/b", active=False)
    everything = MerchantEndpoint.objects.create(url="http://127.0.0.1:9/c")
    refund = Refund.objects.create(payment=make_payment(amount=5_000), amount_minor=100, currency="USD",
                                   reason="duplicate", status=S.SUBMITTED)
    outbound.announce_refund(refund, previous=None)
    refund.settle(at=None)
    refund.save()
    outbound.announce_refund(refund, previous=S.SUBMITTED)

    logged = sorted(WebhookDelivery.objects.values_list("endpoint_id", "event_type"))
    assert logged == sorted([(everything.pk, "refund.submitted"), (everything.pk, "refund.settled"),
                             (settled_only.pk, "refund.settled")])
    assert OutboxMessage.objects.filter(task="refundops.tasks.deliver_webhook").count() == 3  # one each


@pytest.mark.django_db
def test_a_change_that_rolls_back_is_never_announced():
    MerchantEndpoint.objects.create(url="http://127.0.0.1:9/a")
    refund = Refund.objects.create(payment=make_payment(amount=5_000), amount_minor=100, currency="USD",
                                   reason="duplicate", status=S.SUBMITTED)
    before = WebhookDelivery.objects.count(), OutboxMessage.objects.count()

    with pytest.raises(RuntimeError), transaction.atomic():
        refund.settle(at=None)
        refund.save()
        outbound.announce_refund(refund, previous=S.SUBMITTED)
        raise RuntimeError("the writer failed after the change")

    assert (WebhookDelivery.objects.count(), OutboxMessage.objects.count()) == before


@pytest.mark.django_db
def test_a_model_saved_outside_a_service_announces_nothing():
    """Models announce nothing themselves: the services do, in the transaction that decides."""
    MerchantEndpoint.objects.create(url="http://127.0.0.1:9/a")
    refund = Refund.objects.create(payment=make_payment(amount=5_000), amount_minor=100, currency="USD",
                                   reason="duplicate", status=S.SUBMITTED)
    refund.settle(at=None)
    refund.save()
    assert not WebhookDelivery.objects.exists()


@pytest.mark.django_db
@pytest.mark.usefixtures("held_policy")
def test_every_writer_announces_each_move_it_makes():
    """Each state a refund's history shows it moving into was announced, from the state it left:
    asked for and held, approved by a person, submitted and settled by the gateway, rejected,
    expired, failed and resubmitted, and made on the gateway directly."""
    MerchantEndpoint.objects.create(url="http://127.0.0.1:9/a")
    alice = approver("alice", limit=50_000)
    paid, rejected, expired, resubmitted = (held_refund(9_000) for _ in range(4))
    approve_refund(refund_id=paid.pk, approver=alice)
    accepted = RefundResult(processor_refund_id="re_paid", status="pending", amount=Money(9_000, "USD"))
    payouts.record_gateway_result(refund_id=paid.pk, result=accepted)
    payouts.record_gateway_result(refund_id=paid.pk, result=replace(accepted, status="succeeded"))
    reject_refund(refund_id=rejected.pk, approver=alice, note="not ours to pay")
    then = timezone.now() - timedelta(hours=settings.HELD_REFUND_EXPIRY_HOURS, minutes=1)
    Refund.objects.filter(pk=expired.pk).update(created_at=then, counted_at=then)
    assert expire_held_refunds() == 1
    approve_refund(refund_id=resubmitted.pk, approver=alice)
    payouts.record_gateway_failure(refund_id=resubmitted.pk, code="card_closed", message="card was closed")
    resubmit_refund(refund_id=resubmitted.pk, approver=alice, note="new card")
    external = make_payment(amount=5_000)
    record_external_refund(payment_id=external.pk, reason="customer_request",
                           result=RefundResult(processor_refund_id="re_ext", status="succeeded",
                                               amount=Money(500, "USD")),
                           event=WebhookEvent(processor="sandbox", event_id="evt_ext", type="refund.created",
                                              object_id="re_ext"))

    for refund in Refund.objects.all():
        states = [h.status for h in refund.history.order_by("history_date", "history_id")]
        moves = {(previous, status) for previous, status in zip([None, *states], states) if previous != status}
        announced = {(d.payload["data"]["previous_status"], d.payload["data"]["object"]["status"])
                     for d in WebhookDelivery.objects.filter(payload__data__object__id=refund.pk)}
        assert announced == moves, refund.origin
    assert sorted(Refund.objects.values_list("status", flat=True)) == sorted(
        [S.SETTLED, S.REJECTED, S.EXPIRED, S.APPROVED, S.SETTLED])
