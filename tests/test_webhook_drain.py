"""Merchant webhook deliveries drain quickly (issue 27, finding 5; figures: bench/webhook_drain.py).

What made each delivery slow was not work but waiting: the checked connection left out urllib3's
TCP_NODELAY, so each request's body waited for the merchant's delayed ACK (~40 ms a delivery);
recording an attempt took four statements in a transaction. (Connections were already kept: the
test that says so guards it.)
"""

from __future__ import annotations

import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from unittest import mock

import pytest
import time_machine
from django.utils import timezone

from refundops import merchant_http, outbound
from refundops.models import MerchantEndpoint, WebhookDelivery
from tests.conftest import race

pytestmark = pytest.mark.django_db


class KeepAliveMerchant(ThreadingHTTPServer):
    """A merchant's server that keeps connections open (HTTP/1.1) and counts them."""

    daemon_threads = True

    def __init__(self) -> None:
        self.connections = 0
        self.posts = 0
        self.statuses: list[int] = []  # answered in turn, then 200
        self.delay = 0.0
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self) -> None:
                super().setup()
                server.connections += 1

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                server.posts += 1
                time.sleep(server.delay)
                self.send_response(server.statuses.pop(0) if server.statuses else 200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")

            def log_message(self, *args) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, args=(0.05,), daemon=True).start()


@pytest.fixture
def merchant(settings):
    settings.MERCHANT_WEBHOOK_ALLOW_PRIVATE = True
    server = KeepAliveMerchant()
    yield server
    server.shutdown()
    server.server_close()


def pending_delivery(endpoint: MerchantEndpoint, n: int) -> WebhookDelivery:
    return WebhookDelivery.objects.create(endpoint=endpoint, event_id=f"evt_{n}", event_type="refund.settled",
                                          payload={"id": f"evt_{n}"})


def test_a_checked_merchant_connection_sends_without_waiting_for_a_delayed_ack(merchant):
    connection = merchant_http._HTTP("127.0.0.1", merchant.server_address[1], timeout=2)
    sock = connection._new_conn()
    try:
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        sock.close()


def test_deliveries_to_one_endpoint_share_one_kept_connection(merchant):
    endpoint = MerchantEndpoint.objects.create(url=f"http://127.0.0.1:{merchant.server_address[1]}/hooks")

    sent = [outbound.attempt_delivery(delivery_id=pending_delivery(endpoint, n).pk) for n in range(3)]

    assert [d.status for d in sent] == [WebhookDelivery.Status.DELIVERED] * 3
    assert merchant.connections == 1


def test_recording_an_attempt_never_undoes_a_delivery_another_attempt_made(merchant):
    endpoint = MerchantEndpoint.objects.create(url=f"http://127.0.0.1:{merchant.server_address[1]}/hooks")
    delivery = pending_delivery(endpoint, 1)

    def the_other_attempt_lands_first(*args, **kwargs):
        WebhookDelivery.objects.filter(pk=delivery.pk).update(status=WebhookDelivery.Status.DELIVERED, attempts=1)
        return merchant_http.Answer(None, 0, "ConnectionResetError: reset by peer")

    with mock.patch.object(merchant_http, "post", side_effect=the_other_attempt_lands_first):
        answer = outbound.attempt_delivery(delivery_id=delivery.pk)

    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts, delivery.last_error) == (WebhookDelivery.Status.DELIVERED, 1, "")
    assert answer.status == WebhookDelivery.Status.DELIVERED


def test_a_delivery_merely_queued_behind_a_backlog_is_not_sent_again_on_every_sweep(settings):
    """The overdue sweep cannot tell a lost task from one still queued behind others. Sending again
    every sweep turned a backlog into more backlog (the fault harness: 8,000 deliver_webhook
    messages queued for 700 pending deliveries): each resend now waits as long as the delivery had
    already waited, so a delivery is sent a few times, not once a sweep."""
    settings.WEBHOOK_OVERDUE_SECONDS = 4
    endpoint = MerchantEndpoint.objects.create(url="https://merchant.example/hooks")
    start = timezone.now()
    WebhookDelivery.objects.create(endpoint=endpoint, event_id="evt_1", event_type="refund.settled",
                                   payload={"id": "evt_1"}, next_attempt_at=start)
    resent = []
    with time_machine.travel(start, tick=False) as clock:
        for _ in range(30):  # a minute of sweeps every 2 s, the delivery's message still queued
            clock.shift(2)
            resent.append(outbound.deliver_overdue())

    assert 1 <= sum(resent) <= 5, resent


# -- copies of one delivery's message: one POST a turn ----------------------------------------------

def merchant_endpoint(merchant) -> MerchantEndpoint:
    return MerchantEndpoint.objects.create(url=f"http://127.0.0.1:{merchant.server_address[1]}/hooks")


@pytest.mark.django_db(transaction=True)
def test_two_copies_of_one_delivery_handed_out_at_once_post_it_once(merchant):
    """A message the broker hands out again while the first copy still runs (its visibility timeout
    passed in a backlog, or a worker restarted): both copies ran the POST."""
    merchant.delay = 0.3
    delivery = pending_delivery(merchant_endpoint(merchant), 1)

    answers = race(2, lambda i: outbound.attempt_delivery(delivery_id=delivery.pk))

    assert merchant.posts == 1
    assert sorted(a is None for a in answers) == [False, True]
    delivery.refresh_from_db()
    assert (delivery.status, delivery.attempts) == (WebhookDelivery.Status.DELIVERED, 1)


def test_a_copy_that_comes_after_a_failed_attempt_waits_for_the_backoff(merchant):
    merchant.statuses = [500]
    delivery = pending_delivery(merchant_endpoint(merchant), 1)

    first = outbound.attempt_delivery(delivery_id=delivery.pk)
    second = outbound.attempt_delivery(delivery_id=delivery.pk)  # a copy of the same message

    assert first.status == WebhookDelivery.Status.PENDING and first.next_attempt_at > timezone.now()
    assert second is None and merchant.posts == 1
    with time_machine.travel(first.next_attempt_at, tick=False):  # its turn comes: the retry posts
        assert outbound.attempt_delivery(delivery_id=delivery.pk).status == WebhookDelivery.Status.DELIVERED
    assert merchant.posts == 2


def test_the_sweeps_copy_takes_the_turn_it_was_given_and_an_older_copy_does_not(merchant, settings):
    settings.WEBHOOK_OVERDUE_SECONDS = 4
    endpoint = merchant_endpoint(merchant)
    start = timezone.now()
    delivery = WebhookDelivery.objects.create(endpoint=endpoint, event_id="evt_1", event_type="refund.settled",
                                              payload={"id": "evt_1"}, next_attempt_at=start)
    with time_machine.travel(start + timezone.timedelta(seconds=10), tick=False):
        with mock.patch.object(outbound.outbox, "send_each_after_commit") as sent:
            assert outbound.deliver_overdue() == 1
        [[task, [copy]], _] = sent.call_args
        assert copy["delivery_id"] == delivery.pk
        assert outbound.attempt_delivery(delivery_id=delivery.pk) is None  # the lost task's own copy, late
        turn = timezone.datetime.fromisoformat(copy["turn"])
        assert outbound.attempt_delivery(delivery_id=delivery.pk, turn=turn).status == WebhookDelivery.Status.DELIVERED
    assert merchant.posts == 1
