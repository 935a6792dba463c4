"""Other people's money and networks: a merchant endpoint URL cannot reach inside our network
(checked when we connect, for every address the name resolves to), a call has one deadline and a
size cap, and a failure is kept as status and size, never the body. PayPal: one OAuth token per
app until it expires, and a forged webhook spends no PayPal call unless it is plausible, and then
only from a budget."""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from django.test import Client
from django.urls import include, path

from processors.models import InboundEvent
from refundops import merchant_http, outbound
from refundops.models import MerchantEndpoint, Refund, WebhookDelivery
from tests.fakes.fixtures import PAYPAL_WEBHOOK_ID, paypal_payment
from tests.fakes.paypal_server import FakePayPal

urlpatterns = [path("", include("refundops.urls")), path("webhooks/", include("refundops.webhook_urls"))]
pytestmark = [pytest.mark.urls(__name__), pytest.mark.django_db]


class Internal(ThreadingHTTPServer):
    """A page inside the network: counts requests, answers ``body`` (slowly, with ``drip``)."""

    def __init__(self, body: bytes = b"SECRET-INTERNAL-PAGE", *, status: int = 500, drip: float = 0.0):
        self.hits, self.body, self.status, self.drip = 0, body, status, drip
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                server.hits += 1
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                self.send_response(server.status)
                self.send_header("Content-Length", str(len(server.body)))
                self.end_headers()
                try:
                    for i in range(0, len(server.body), 1024):
                        self.wfile.write(server.body[i:i + 1024])
                        self.wfile.flush()
                        time.sleep(server.drip)
                except OSError:
                    pass

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def port(self) -> int:
        return self.server_address[1]


@pytest.fixture
def internal():
    server = Internal()
    yield server
    server.shutdown()


def deliver_to(url: str) -> WebhookDelivery:
    endpoint = MerchantEndpoint.objects.create(url=url)
    delivery = WebhookDelivery.objects.create(endpoint=endpoint, event_id="evt_1", event_type="refund.settled",
                                              payload={"id": "evt_1"})
    return outbound.attempt_delivery(delivery_id=delivery.pk)


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]", "[::ffff:127.0.0.1]", "0.0.0.0"])
def test_an_endpoint_on_this_machine_is_refused_when_we_connect(settings, internal, host):
    settings.MERCHANT_WEBHOOK_ALLOW_PRIVATE = False
    delivery = deliver_to(f"http://{host}:{internal.port}/hook")
    assert internal.hits == 0
    assert delivery.response_code is None and delivery.last_error.startswith("refused:"), delivery.last_error
    assert "SECRET" not in delivery.last_error


@pytest.mark.parametrize("address,why", [("169.254.169.254", "link-local"), ("10.1.2.3", "private"),
                                         ("192.168.0.1", "private"), ("100.64.0.1", "not a public"),
                                         ("240.0.0.1", "reserved"), ("fe80::1", "link-local")])
def test_private_link_local_and_reserved_addresses_are_refused(address, why):
    assert why in merchant_http.refused_reason(address)


def test_a_public_address_is_allowed():
    assert merchant_http.refused_reason("93.184.215.14") is None
    assert merchant_http.refused_reason("2606:2800:21f:cb07:6820:80da:af6b:8b2c") is None


def test_a_name_that_resolves_inside_is_refused_at_connect_time_whatever_it_said_when_saved(settings, internal,
                                                                                            monkeypatch):
    """DNS rebinding: the name was public when the endpoint was saved; when we connect it points
    at 127.0.0.1. The check runs on the address we connect to."""
    settings.MERCHANT_WEBHOOK_ALLOW_PRIVATE = False
    real = socket.getaddrinfo

    def rebinding(host, port, *args, **kwargs):
        if host == "merchant.example":
            return real("127.0.0.1", port, *args, **kwargs)
        return real(host, port, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", rebinding)
    delivery = deliver_to(f"http://merchant.example:{internal.port}/hook")
    assert internal.hits == 0 and "127.0.0.1" in delivery.last_error and "loopback" in delivery.last_error


def test_a_failed_delivery_keeps_status_and_size_never_the_body(internal):
    delivery = deliver_to(f"http://127.0.0.1:{internal.port}/hook")  # tests allow loopback receivers
    assert internal.hits == 1 and delivery.response_code == 500
    assert "SECRET" not in delivery.last_error and delivery.last_error == "HTTP 500 (20 bytes)"


def test_an_answer_over_the_cap_is_not_read_further(internal):
    internal.body = b"x" * (merchant_http.MAX_RESPONSE_BYTES * 4)
    delivery = deliver_to(f"http://127.0.0.1:{internal.port}/hook")
    assert delivery.response_code == 500 and f"over {merchant_http.MAX_RESPONSE_BYTES} bytes" in delivery.last_error


def test_a_slow_answer_meets_one_overall_deadline(settings, internal):
    settings.WEBHOOK_TIMEOUT_SECONDS = 1
    internal.status, internal.body, internal.drip = 200, b"y" * 20 * 1024, 0.2  # 4 s in 0.2 s trickles
    started = time.monotonic()
    delivery = deliver_to(f"http://127.0.0.1:{internal.port}/hook")
    assert time.monotonic() - started < 2.5
    assert delivery.status == WebhookDelivery.Status.PENDING and "within 1 seconds" in delivery.last_error


# -- PayPal ------------------------------------------------------------------------------------------

@pytest.fixture
def web() -> Client:
    return Client(enforce_csrf_checks=True)


def signed(fake: FakePayPal, event: dict, **overrides) -> dict[str, str]:
    headers = {**fake.sign_webhook(event, webhook_id=PAYPAL_WEBHOOK_ID), **overrides}
    return {f"HTTP_{k.upper().replace('-', '_')}": v for k, v in headers.items()}


def verify_calls(fake: FakePayPal) -> list:
    with fake.lock:
        return [r for r in fake.received if r.path == "/v1/notifications/verify-webhook-signature"]


def refund_event(fake: FakePayPal, payment) -> dict:
    return {"id": f"WH-{time.time_ns()}", "event_type": "PAYMENT.CAPTURE.REFUNDED",
            "resource": {"id": "1JU08902781691411", "status": "COMPLETED",
                         "links": [{"rel": "up", "href": f"{fake.url}/v2/payments/captures/"
                                                         f"{payment.processor_reference}"}]}}


def test_one_oauth_token_serves_every_call_until_it_expires(web, gateways, paypal_fake):
    payment = paypal_payment(paypal_fake, "80.00")
    for _ in range(3):
        event = refund_event(paypal_fake, payment)
        web.post("/webhooks/paypal/", data=json.dumps(event), content_type="application/json",
                 **signed(paypal_fake, event))
    assert paypal_fake.tokens_issued == 1


@pytest.mark.parametrize("override", [
    {"PAYPAL-CERT-URL": "https://evil.example/v1/notifications/certs/CERT-1"},
    {"PAYPAL-CERT-URL": "http://api.paypal.com/v1/notifications/certs/CERT-1"},
    {"PAYPAL-AUTH-ALGO": "HS256"},
    {"PAYPAL-TRANSMISSION-TIME": "2020-01-01T00:00:00Z"},
    {"PAYPAL-TRANSMISSION-TIME": "yesterday"},
])
def test_an_implausible_paypal_transmission_is_refused_without_asking_paypal(web, gateways, paypal_fake, override):
    payment = paypal_payment(paypal_fake, "80.00")
    event = refund_event(paypal_fake, payment)
    response = web.post("/webhooks/paypal/", data=json.dumps(event), content_type="application/json",
                        **signed(paypal_fake, event, **override))
    assert response.status_code == 400
    assert paypal_fake.tokens_issued == 0 and not verify_calls(paypal_fake)
    assert InboundEvent.objects.get().verified is False and not Refund.objects.exists()


def test_forged_but_plausible_transmissions_spend_only_a_budget_of_verify_calls(web, gateways, paypal_fake, settings):
    settings.PROCESSORS["paypal"]["default"]["webhook_verify_per_minute"] = 2
    payment = paypal_payment(paypal_fake, "80.00")
    answers = []
    for _ in range(4):
        event = refund_event(paypal_fake, payment)
        forged = paypal_fake.sign_webhook(event, webhook_id="WH-SOMEONE-ELSES")
        answers.append(web.post("/webhooks/paypal/", data=json.dumps(event), content_type="application/json",
                                **{f"HTTP_{k.upper().replace('-', '_')}": v for k, v in forged.items()}))
    assert [a.status_code for a in answers] == [400, 400, 503, 503]
    assert int(answers[2]["Retry-After"]) >= 1
    assert len(verify_calls(paypal_fake)) == 2
