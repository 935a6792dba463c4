"""An imported authorisation has no order amount a person confirmed: a person sets it in the
admin, and captures it there too, each through a service that is audited."""

from __future__ import annotations

import uuid

import pytest
from django.contrib.auth.models import User

from audit.models import AuditEntry, Verdict
from refundops.models import Payment, PaymentOperation
from tests.browser import admin_url, make_approver
from tests.conftest import make_customer, post

pytestmark = pytest.mark.django_db


@pytest.fixture
def root(client):
    user = User.objects.create_superuser("root", "root@example.com", "pw")
    client.force_login(user)
    return user


@pytest.fixture
def authorisation(gateways, stripe_fake):
    """An authorisation as import_payments brings one in from a gateway that kept no order amount."""
    intent = stripe_fake.add_payment_intent(9_000, captured=False)
    return Payment.objects.create(
        customer=make_customer(), processor="stripe", processor_reference=intent, authorization_reference=intent,
        currency="USD", amount_authorized_minor=9_000, status=Payment.Status.AUTHORIZED, method_type="card")


def test_a_person_sets_the_order_amount_and_an_agent_may_then_capture_up_to_it(client, root, authorisation,
                                                                                api, stripe_fake):
    refused = post(api, f"/api/v1/payments/{authorisation.pk}/capture", {"amount": 8_000})
    assert refused.json()["error"]["code"] == "AMOUNT_EXCEEDS_ORDER"

    response = client.post(admin_url("admin:refundops_payment_order_amount", authorisation.pk),
                           {"amount": "80.00", "note": "order 1001 confirmed by phone"})

    assert response.status_code == 302
    authorisation.refresh_from_db()
    assert authorisation.order_amount_minor == 8_000
    entry = AuditEntry.objects.get(action="payment.order_amount_set")
    assert (entry.actor, entry.subject_id) == ("user:root", authorisation.pk)
    assert entry.data["from"] is None and entry.data["to"] == 8_000
    assert authorisation.history.first().history_user == root
    captured = post(api, f"/api/v1/payments/{authorisation.pk}/capture", {"amount": 8_000})
    assert captured.status_code == 200, captured.json()
    assert stripe_fake.payment_intents[authorisation.processor_reference]["amount_received"] == 8_000


@pytest.mark.parametrize("amount,error", [("95.00", "authorised"), ("0", "more than zero"), ("1.234", "decimal")])
def test_an_order_amount_outside_the_authorisation_is_refused_and_changes_nothing(client, root, authorisation,
                                                                                   amount, error):
    response = client.post(admin_url("admin:refundops_payment_order_amount", authorisation.pk),
                           {"amount": amount})

    assert response.status_code == 200 and error in response.content.decode()
    authorisation.refresh_from_db()
    assert authorisation.order_amount_minor is None
    assert not AuditEntry.objects.filter(action="payment.order_amount_set").exists()


def test_a_captured_payment_takes_no_order_amount(client, root, authorisation):
    Payment.objects.filter(pk=authorisation.pk).update(status=Payment.Status.CAPTURED, amount_captured_minor=9_000)

    response = client.post(admin_url("admin:refundops_payment_order_amount", authorisation.pk), {"amount": "10.00"})

    assert "PAYMENT_NOT_CAPTURABLE" in response.content.decode()
    authorisation.refresh_from_db()
    assert authorisation.order_amount_minor is None


def test_a_person_captures_an_authorisation_from_the_admin(client, root, authorisation, stripe_fake):
    Payment.objects.filter(pk=authorisation.pk).update(order_amount_minor=7_000)
    key = uuid.uuid4().hex

    response = client.post(admin_url("admin:refundops_payment_capture", authorisation.pk),
                           {"amount": "70.00", "idempotency_key": key})
    client.post(admin_url("admin:refundops_payment_capture", authorisation.pk),  # a double submit
                {"amount": "70.00", "idempotency_key": key})

    assert response.status_code == 302
    authorisation.refresh_from_db()
    assert (authorisation.status, authorisation.amount_captured_minor) == (Payment.Status.CAPTURED, 7_000)
    operation = PaymentOperation.objects.get(payment=authorisation)
    assert Verdict.objects.get(pk=operation.verdict_id).staff_username == "root"
    assert len([r for r in stripe_fake.received if r.path.endswith("/capture")]) == 1


def test_people_who_may_not_change_payments_neither_set_the_order_amount_nor_capture(client, authorisation):
    client.force_login(make_approver())

    for name in ("admin:refundops_payment_order_amount", "admin:refundops_payment_capture"):
        assert client.post(admin_url(name, authorisation.pk), {"amount": "10.00"}).status_code == 403

    authorisation.refresh_from_db()
    assert authorisation.order_amount_minor is None and authorisation.status == Payment.Status.AUTHORIZED
