"""Tenancy: a merchant owns payments, customers, agents and endpoints, and an agent acts only
within its merchant. Anything of another merchant answers exactly as an id that does not exist
(order references too). Agents' reads are recorded, one INSERT each. Finance can require
``agent.session_id`` per merchant; when not required, a refund without one counts as one session
per key and hour, for the session's amount limit and its rate limit."""

from __future__ import annotations

import uuid

import pytest
from django.contrib.auth import get_user_model
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone
from rest_framework.test import APIClient

from refundops.models import (
    DEFAULT_MERCHANT_ID,
    AgentRead,
    Dispute,
    Merchant,
    MerchantEndpoint,
    PaymentLinkTemplate,
    Refund,
    WebhookDelivery,
)
from tests.conftest import make_agent_key, make_customer, make_limits, make_payment, make_rules, post

pytestmark = pytest.mark.django_db


def client_for(merchant: Merchant | None = None) -> APIClient:
    key, raw = make_agent_key(merchant=merchant)
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    client.key = key
    return client


@pytest.fixture
def acme(db) -> Merchant:
    return Merchant.objects.create(name="Acme")


@pytest.fixture
def theirs(acme):
    """A payment of Acme's (with a staff refund, a dispute and an order owing money)."""
    customer = make_customer(merchant=acme)
    payment = make_payment(customer=customer, merchant=acme, order_reference="ACME-1001", amount_owed_minor=2_000)
    refund = Refund.objects.create(payment=payment, amount_minor=100, currency="USD", reason="duplicate",
                                   origin=Refund.Origin.STAFF)
    dispute = Dispute.objects.create(payment=payment, amount_minor=1_000, currency="USD", reason="fraudulent")
    return payment, refund, dispute


def same_as_missing(response, missing, own_id: str, missing_id: str) -> None:
    assert response.status_code == missing.status_code == 404
    error, absent = response.json()["error"], missing.json()["error"]
    assert error["code"] == absent["code"] and error.keys() == absent.keys()
    assert error["message"].replace(own_id, "ID") == absent["message"].replace(missing_id, "ID")


def test_another_merchants_payment_refund_and_dispute_are_not_found(policy, theirs):
    payment, refund, dispute = theirs
    api = client_for()  # the default merchant's agent
    fake_txn, fake_rf, fake_dp = "txn_" + "0" * 24, "rf_" + "0" * 24, "dp_" + "0" * 24
    same_as_missing(api.get(f"/api/v1/payments/{payment.pk}"), api.get(f"/api/v1/payments/{fake_txn}"),
                    payment.pk, fake_txn)
    same_as_missing(api.get(f"/api/v1/refunds/{refund.pk}"), api.get(f"/api/v1/refunds/{fake_rf}"),
                    refund.pk, fake_rf)
    for path in ("/api/v1/refunds", "/api/v1/refunds/check"):
        mine = post(api, path, {"transaction_id": payment.pk, "reason": "duplicate", "amount": 100})
        none = post(api, path, {"transaction_id": fake_txn, "reason": "duplicate", "amount": 100})
        same_as_missing(mine, none, payment.pk, fake_txn)
    for action in ("void", "capture"):
        body = {"amount": 100} if action == "capture" else {}
        same_as_missing(post(api, f"/api/v1/payments/{payment.pk}/{action}", body),
                        post(api, f"/api/v1/payments/{fake_txn}/{action}", body), payment.pk, fake_txn)
    same_as_missing(post(api, f"/api/v1/disputes/{dispute.pk}/evidence-drafts", {"summary": "x"}),
                    post(api, f"/api/v1/disputes/{fake_dp}/evidence-drafts", {"summary": "x"}), dispute.pk, fake_dp)
    assert Refund.objects.filter(payment=payment).count() == 1  # the staff one only


def test_another_merchants_order_reference_is_not_found_either(policy, theirs):
    approver = get_user_model().objects.create_user("finance", is_staff=True)
    template = PaymentLinkTemplate.objects.create(name="balance", message="Pay $amount: $url",
                                                  approved_by=approver, approved_at=timezone.now())
    api = client_for()
    body = {"template": template.pk, "amount": 500_000}
    guessed = post(api, "/api/v1/payment-links", {**body, "order_reference": "ACME-1001"})
    missing = post(api, "/api/v1/payment-links", {**body, "order_reference": "NOPE-1001"})
    same_as_missing(guessed, missing, "ACME-1001", "NOPE-1001")
    assert (guessed.status_code, guessed.json()["error"]["code"]) == (404, "ORDER_NOT_FOUND")
    assert theirs[0].pk not in guessed.json()["error"]["message"]


def test_an_agent_acts_within_its_own_merchant(policy, acme, theirs):
    payment = theirs[0]
    api = client_for(acme)
    assert api.get(f"/api/v1/payments/{payment.pk}").status_code == 200
    assert api.get(f"/api/v1/refunds/{theirs[1].pk}").status_code == 200
    response = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "reason": "duplicate", "amount": 100})
    assert response.status_code == 201, response.json()


def test_rows_made_before_merchants_belong_to_the_default_merchant(policy):
    payment = make_payment()
    assert payment.merchant_id == payment.customer.merchant_id == DEFAULT_MERCHANT_ID
    assert client_for().key.agent.merchant_id == DEFAULT_MERCHANT_ID


def test_agents_reads_are_recorded_with_one_insert_each(policy, theirs, acme):
    api = client_for(acme)
    payment, refund, _ = theirs
    api.get(f"/api/v1/payments/{payment.pk}")  # the key's first use is stamped once: not the steady state
    with CaptureQueriesContext(connection) as queries:
        assert api.get(f"/api/v1/payments/{payment.pk}").status_code == 200
    inserts = [q["sql"] for q in queries if q["sql"].startswith("INSERT")]
    assert len(inserts) == 1 and "refundops_agentread" in inserts[0] and len(queries) == 3
    api.get(f"/api/v1/refunds/{refund.pk}")
    client_for().get(f"/api/v1/payments/{payment.pk}")  # another merchant's agent probing: kept, found nothing
    reads = list(AgentRead.objects.order_by("id").values_list("agent_id", "operation", "payment_id", "refund_id"))
    agent = api.key.agent_id
    assert reads[-3:-1] == [(agent, "payment.lookup", payment.pk, ""), (agent, "refund.get", payment.pk, refund.pk)]
    assert reads[-1][1:] == ("payment.lookup", "", "")


def test_a_merchant_can_require_a_session_id_on_refunds(acme):
    make_limits()
    make_rules()
    acme.require_session_id = True
    acme.save()
    api = client_for(acme)
    payment = make_payment(merchant=acme)
    without = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "reason": "duplicate", "amount": 100})
    assert without.status_code == 400 and without.json()["error"]["field"] == "agent.session_id"
    named = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "reason": "duplicate", "amount": 100,
                                          "agent": {"session_id": "chat-1"}})
    assert named.status_code == 201


def test_refunds_without_a_session_count_as_one_session_per_key_and_hour(quiet_breaker):
    make_limits(session_amount_minor=1_000)
    make_rules()
    api = client_for()
    answers = [post(api, "/api/v1/refunds", {"transaction_id": make_payment().pk, "reason": "duplicate",
                                             "amount": 600}) for _ in range(2)]
    assert answers[0].status_code == 201
    assert answers[1].status_code == 422 and answers[1].json()["error"]["code"] == "DAILY_LIMIT_REACHED"
    refund = Refund.objects.get(pk=answers[0].json()["refund"]["id"])
    assert refund.agent_session_id.startswith(f"key:{api.key.prefix}:")
    other = client_for()  # another key has a session of its own
    assert post(other, "/api/v1/refunds", {"transaction_id": make_payment().pk, "reason": "duplicate",
                                           "amount": 600}).status_code == 201


def test_the_session_rate_limit_counts_requests_without_a_session(policy, settings):
    settings.RATE_LIMIT_SESSION_PER_MINUTE = 2
    api = client_for()
    codes = [post(api, "/api/v1/refunds/check", {"transaction_id": "txn_x", "reason": "duplicate"}).status_code
             for _ in range(3)]
    assert codes[:2] == [404, 404] and codes[2] == 429


def test_a_refund_is_announced_only_to_its_merchants_endpoints(policy, acme, django_capture_on_commit_callbacks):
    ours = MerchantEndpoint.objects.create(url="https://default.example/hook")
    acmes = MerchantEndpoint.objects.create(url="https://acme.example/hook", merchant=acme)
    api = client_for(acme)
    payment = make_payment(merchant=acme)
    post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "reason": "duplicate", "amount": 100,
                                  "agent": {"session_id": f"s-{uuid.uuid4().hex}"}})
    assert WebhookDelivery.objects.filter(endpoint=acmes).exists()
    assert not WebhookDelivery.objects.filter(endpoint=ours).exists()


def test_create_agent_names_the_merchant_it_acts_for(acme):
    import json
    from io import StringIO

    from django.core.management import call_command

    out = StringIO()
    call_command("create_agent", "acme-bot", "--capability", "payments.read", "--merchant", "Acme", "--json",
                 stdout=out)
    assert json.loads(out.getvalue())["merchant_id"] == acme.pk
