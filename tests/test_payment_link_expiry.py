"""Unpaid payment links expire after ``PAYMENT_LINK_EXPIRY_HOURS``: a beat task deactivates each
at its gateway first (so nobody can pay it once we say it expired), then marks it expired, which
frees the owed amount for another link. A paid link never expires; an outage waits for the next run."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from django.conf import settings as django_settings

from audit.models import AuditEntry
from refundops import tasks
from refundops.models import PaymentLink, PaymentLinkTemplate
from refundops.services.payments import outstanding_links_minor
from tests.conftest import make_payment, post
from tests.fakes.fixtures import stripe_payment

pytestmark = pytest.mark.django_db


@pytest.fixture
def template() -> PaymentLinkTemplate:
    return PaymentLinkTemplate.objects.create(name="balance", message="Please pay $amount: $url",
                                              approved_at=datetime.now(timezone.utc))


@pytest.fixture
def expiry(settings):
    settings.PAYMENT_LINK_EXPIRY_HOURS = 48
    return settings


def send(api, template, payment, amount: int = 3_000) -> PaymentLink:
    sent = post(api, "/api/v1/payment-links", {"transaction_id": payment.pk, "template": template.pk,
                                               "amount": amount})
    assert sent.status_code == 201, sent.json()
    return PaymentLink.objects.get(pk=sent.json()["payment_link"]["id"])


def age(link: PaymentLink, hours: float) -> None:
    PaymentLink.objects.filter(pk=link.pk).update(sent_at=datetime.now(timezone.utc) - timedelta(hours=hours))


def test_an_unpaid_stripe_link_past_its_time_is_deactivated_at_stripe_and_expires(
        expiry, gateways, stripe_fake, api, policy, template):
    payment = stripe_payment(stripe_fake, 5_000, amount_owed_minor=3_000)
    link = send(api, template, payment)
    age(link, 49)

    assert tasks.expire_payment_links.delay().get() == 1

    link.refresh_from_db()
    assert link.status == PaymentLink.Status.EXPIRED
    assert stripe_fake.payment_links[link.processor_link_id]["active"] is False
    with pytest.raises(ValueError, match="deactivated"):
        stripe_fake.pay_payment_link(link.processor_link_id)
    assert outstanding_links_minor(payment) == 0  # the owed amount may be asked for again
    entry = AuditEntry.objects.get(action="payment_link.expired", subject_id=link.pk)
    assert entry.data["processor_link_id"] == link.processor_link_id
    send(api, template, payment)


def test_a_link_younger_than_the_expiry_or_already_paid_is_left_alone(
        expiry, gateways, stripe_fake, api, policy, template):
    payment = stripe_payment(stripe_fake, 5_000, amount_owed_minor=6_000)
    young, paid = send(api, template, payment), send(api, template, payment)
    age(young, 47)
    age(paid, 100)
    PaymentLink.objects.filter(pk=paid.pk).update(status=PaymentLink.Status.PAID)

    assert tasks.expire_payment_links.delay().get() == 0

    assert set(PaymentLink.objects.values_list("status", flat=True)) == {"sent", "paid"}
    assert all(link["active"] for link in stripe_fake.payment_links.values())


def test_a_stripe_outage_leaves_the_link_for_the_next_run(expiry, gateways, stripe_fake, api, policy, template):
    payment = stripe_payment(stripe_fake, 5_000, amount_owed_minor=3_000)
    link = send(api, template, payment)
    age(link, 49)
    stripe_fake.set_mode("down")

    assert tasks.expire_payment_links.delay().get() == 0
    link.refresh_from_db()
    assert link.status == PaymentLink.Status.SENT

    stripe_fake.set_mode("up")
    assert tasks.expire_payment_links.delay().get() == 1
    link.refresh_from_db()
    assert link.status == PaymentLink.Status.EXPIRED


def test_a_sandbox_link_expires_here_and_its_page_takes_no_payment(expiry, client, api, policy, template):
    payment = make_payment(amount=5_000, amount_owed_minor=2_000)
    link = send(api, template, payment, 2_000)
    age(link, 49)

    tasks.expire_payment_links.delay().get()

    link.refresh_from_db()
    assert link.status == PaymentLink.Status.EXPIRED
    client.post(f"/pay/{link.pk}")
    link.refresh_from_db()
    payment.refresh_from_db()
    assert link.status == PaymentLink.Status.EXPIRED and payment.amount_owed_minor == 2_000


def test_beat_runs_the_expiry_and_the_time_is_configurable():
    assert django_settings.CELERY_BEAT_SCHEDULE["expire-payment-links"]["task"] == \
        "refundops.tasks.expire_payment_links"
    assert django_settings.PAYMENT_LINK_EXPIRY_HOURS > 0
