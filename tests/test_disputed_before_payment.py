"""A dispute that opens between a refund's approval and its payment: the worker's last look.

An agent's refund the policy approved alone is canceled rather than paid, since losing the
dispute as well would pay the customer twice; a refund a person approved knowing of the dispute
is paid. Through the fake Stripe, its signed dispute events and the worker's own service.
"""

from __future__ import annotations

import uuid

import pytest
from django.contrib.auth.models import Permission, User
from django.test import Client
from django.urls import include, path

from approvals.models import ApprovalAuthority
from approvals.services import approve_refund
from audit.models import AuditEntry
from django.utils import timezone

from processors.base import ProcessorUnavailable, RefundRequest
from processors.money import Money
from processors.registry import get_processor
from refundops.models import GatewayAttempt, MerchantEndpoint, Payment, Refund, RefundState, WebhookDelivery
from refundops.services import attempts, payouts
from tests.conftest import post
from tests.fakes.fixtures import post_stripe_event, stripe_event, stripe_payment
from tests.fakes.stripe_server import FakeStripe

urlpatterns = [path("", include("refundops.urls")), path("webhooks/", include("refundops.webhook_urls"))]
pytestmark = [pytest.mark.urls(__name__), pytest.mark.django_db]


def open_dispute(fake: FakeStripe, payment: Payment) -> str:
    charge = fake.payment_intents[payment.processor_reference]["latest_charge"]
    dispute_id = fake.add_dispute(charge)
    answer = post_stripe_event(Client(), stripe_event("charge.dispute.created", dict(fake.disputes[dispute_id])))
    assert answer.status_code == 200
    return dispute_id


def approver() -> User:
    user = User.objects.create_user(username=f"approver-{uuid.uuid4().hex[:6]}", is_staff=True)
    user.user_permissions.add(Permission.objects.get(codename="approve_refund"))
    ApprovalAuthority.objects.create(user=user, currency="USD", max_amount_minor=100_000)
    return User.objects.get(pk=user.pk)


def test_a_refund_approved_automatically_is_canceled_not_paid_when_a_dispute_opens_first(
        api, policy, gateways, stripe_fake):
    endpoint = MerchantEndpoint.objects.create(url="https://merchant.example/hooks")
    payment = stripe_payment(stripe_fake, 5_000)
    answer = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 2_000,
                                           "reason": "customer_request"})
    assert answer.status_code == 201 and answer.json()["refund"]["status"] == RefundState.APPROVED
    refund_id = answer.json()["refund"]["id"]
    dispute_id = open_dispute(stripe_fake, payment)

    refund = payouts.submit_refund(refund_id=refund_id)

    assert refund.status == RefundState.CANCELED and dispute_id in refund.failure_message
    assert stripe_fake.refund_count == 0
    payment.refresh_from_db()
    assert (payment.amount_refunded_minor, payment.amount_reserved_minor, payment.paid_twice) == (0, 0, False)
    entry = AuditEntry.objects.get(action="refund.canceled", subject_id=refund_id)
    assert entry.actor == payouts.WORKER and entry.data["processor_dispute_id"] == dispute_id
    assert WebhookDelivery.objects.filter(endpoint=endpoint, event_type="refund.canceled",
                                          payload__data__object__id=refund_id).count() == 1


def test_a_refund_a_person_approved_while_the_payment_was_disputed_is_paid(api, policy, gateways, stripe_fake):
    payment = stripe_payment(stripe_fake, 5_000)
    open_dispute(stripe_fake, payment)
    answer = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 2_000,
                                           "reason": "customer_request"})
    assert answer.status_code == 202 and "PAYMENT_DISPUTED" in answer.json()["hold_reasons"]
    approve_refund(refund_id=answer.json()["refund"]["id"], approver=approver(), note="goods never shipped")

    refund = payouts.submit_refund(refund_id=answer.json()["refund"]["id"])

    assert refund.status == RefundState.SETTLED and stripe_fake.refund_count == 1
    assert not AuditEntry.objects.filter(action="refund.canceled", subject_id=refund.pk).exists()


def test_a_refund_approved_automatically_on_an_undisputed_payment_is_paid(api, policy, gateways, stripe_fake):
    payment = stripe_payment(stripe_fake, 5_000)
    answer = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 2_000,
                                           "reason": "customer_request"})

    refund = payouts.submit_refund(refund_id=answer.json()["refund"]["id"])

    assert refund.status == RefundState.SETTLED and stripe_fake.refund_count == 1
    assert Refund.objects.get(pk=refund.pk).processor_refund_id


def test_a_refund_whose_gateway_call_may_have_gone_out_is_not_canceled_but_looked_up(
        api, policy, gateways, stripe_fake, settings):
    settings.PROCESSORS["stripe"]["default"]["timeout"] = 0.5
    payment = stripe_payment(stripe_fake, 5_000)
    refund_id = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 2_000,
                                              "reason": "customer_request"}).json()["refund"]["id"]
    stripe_fake.set_mode("slow_after", slow_seconds=1.5)  # Stripe pays, the answer never arrives
    with pytest.raises(payouts.ProcessorUnavailable):
        payouts.submit_refund(refund_id=refund_id)
    stripe_fake.set_mode("up")
    open_dispute(stripe_fake, payment)

    refund = payouts.submit_refund(refund_id=refund_id)  # the retry asks Stripe first

    assert refund.status in (RefundState.SUBMITTED, RefundState.SETTLED)
    assert stripe_fake.refund_count == 1  # paid once, recorded truly, never canceled on a guess


@pytest.mark.django_db
def test_a_refund_whose_lost_call_the_gateway_never_saw_is_canceled_once_that_is_known(
        api, policy, gateways, stripe_fake):
    payment = stripe_payment(stripe_fake, 5_000)
    refund_id = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 2_000,
                                              "reason": "customer_request"}).json()["refund"]["id"]
    stripe_fake.set_mode("down")
    with pytest.raises(payouts.ProcessorUnavailable):
        payouts.submit_refund(refund_id=refund_id)  # a 503: whether money moved is Stripe's to say
    stripe_fake.set_mode("up")
    open_dispute(stripe_fake, payment)

    refund = payouts.submit_refund(refund_id=refund_id)  # looked up: no refund of ours at Stripe

    assert refund.status == RefundState.CANCELED
    assert stripe_fake.refund_count == 0
    assert AuditEntry.objects.filter(subject_id=refund_id, action="refund.attempt_absent").exists()


@pytest.mark.django_db
def test_a_dispute_while_a_call_is_in_flight_is_audited_not_guessed(api, policy, gateways, stripe_fake):
    payment = stripe_payment(stripe_fake, 5_000)
    refund_id = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 2_000,
                                              "reason": "customer_request"}).json()["refund"]["id"]
    refund = Refund.objects.get(pk=refund_id)
    GatewayAttempt.objects.create(refund=refund, idempotency_key=attempts.idempotency_key(refund),
                                  outcome=GatewayAttempt.Outcome.SUCCEEDED,
                                  lease_until=timezone.now())
    open_dispute(stripe_fake, payment)

    refund = payouts.cancel_if_disputed_since_approval(refund_id=refund_id)

    assert refund.status == RefundState.APPROVED
    assert AuditEntry.objects.filter(subject_id=refund_id, action="refund.disputed_in_flight").exists()


def lost_dispute(fake: FakeStripe, payment: Payment) -> str:
    """A dispute we first hear of as lost (its "created" event never reached us): the customer has
    the money back through the card network already."""
    charge = fake.payment_intents[payment.processor_reference]["latest_charge"]
    dispute_id = fake.add_dispute(charge, status="lost")
    answer = post_stripe_event(Client(), stripe_event("charge.dispute.closed", dict(fake.disputes[dispute_id])))
    assert answer.status_code == 200
    payment.refresh_from_db()
    assert payment.dispute_status == Payment.Dispute.LOST
    return dispute_id


def test_a_refund_approved_automatically_is_canceled_not_paid_when_the_dispute_is_first_heard_lost(
        api, policy, gateways, stripe_fake):
    """Found by the model (tests/test_model.py, never_paid_twice_silently): on 635a33b the worker
    paid it (settled, 30.00 refunded by PayPal and the sandbox after a chargeback of the whole
    payment, ``paid_twice`` false, no discrepancy): only an open dispute stopped it."""
    payment = stripe_payment(stripe_fake, 5_000)
    answer = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 2_000,
                                           "reason": "customer_request"})
    assert answer.status_code == 201
    refund_id = answer.json()["refund"]["id"]
    dispute_id = lost_dispute(stripe_fake, payment)

    refund = payouts.submit_refund(refund_id=refund_id)

    assert refund.status == RefundState.CANCELED and dispute_id in refund.failure_message
    assert "lost" in refund.failure_message
    assert stripe_fake.refund_count == 0
    payment.refresh_from_db()
    assert (payment.amount_refunded_minor, payment.amount_reserved_minor, payment.paid_twice) == (0, 0, False)


def test_a_refund_asked_after_the_dispute_was_lost_is_held_for_a_person(api, policy, gateways, stripe_fake):
    """On 635a33b approved at once (201) and paid: the policy held open disputes only."""
    payment = stripe_payment(stripe_fake, 5_000)
    lost_dispute(stripe_fake, payment)

    answer = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 2_000,
                                           "reason": "customer_request"})

    assert answer.status_code == 202 and "PAYMENT_DISPUTED" in answer.json()["hold_reasons"]


@pytest.mark.parametrize("dispute", ["open", "lost"])
def test_a_refund_a_person_pays_on_a_disputed_payment_marks_it_paid_twice(api, policy, gateways, stripe_fake,
                                                                          dispute):
    """A person may pay it (theirs to answer for), and the payment says it may be paid back twice, as
    when the dispute comes after the refund. On 635a33b ``paid_twice`` stayed false: it was set only
    when dispute news arrived."""
    payment = stripe_payment(stripe_fake, 5_000)
    (open_dispute if dispute == "open" else lost_dispute)(stripe_fake, payment)
    answer = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 2_000,
                                           "reason": "customer_request"})
    approve_refund(refund_id=answer.json()["refund"]["id"], approver=approver(), note="goods never shipped")

    refund = payouts.submit_refund(refund_id=answer.json()["refund"]["id"])

    assert refund.status == RefundState.SETTLED and stripe_fake.refund_count == 1
    payment.refresh_from_db()
    assert payment.paid_twice is True
    assert AuditEntry.objects.filter(action="payment.paid_twice", subject_id=payment.pk,
                                     data__refund_id=refund.pk).count() == 1


@pytest.mark.parametrize("dispute", ["open", "lost"])
def test_a_refund_made_on_the_gateway_dashboard_of_a_disputed_payment_marks_it_paid_twice(
        policy, gateways, stripe_fake, dispute):
    """Money left on the gateway directly (its dashboard), after the dispute: a person paid it, as
    through our approval. On daa024f ``paid_twice`` stayed false: only record_gateway_result marked
    it, and record_external_refund (webhook, reconciliation, import) never did."""
    payment = stripe_payment(stripe_fake, 5_000)
    dispute_id = (open_dispute if dispute == "open" else lost_dispute)(stripe_fake, payment)
    made = get_processor("stripe").refund(RefundRequest(
        payment=payouts.payment_ref(payment), amount=Money(1_200, "USD"), reason="customer_request",
        idempotency_key=f"dashboard-{uuid.uuid4().hex}", refund_id="", verdict_id=""))
    stripe_fake.refunds[made.processor_refund_id]["metadata"] = {}

    answer = post_stripe_event(Client(), stripe_event("charge.refund.updated",
                                                      dict(stripe_fake.refunds[made.processor_refund_id])))

    assert answer.status_code == 200
    refund = Refund.objects.get(payment=payment)
    assert refund.origin == Refund.Origin.EXTERNAL and refund.status == RefundState.SETTLED
    payment.refresh_from_db()
    assert payment.paid_twice is True
    entry = AuditEntry.objects.get(action="payment.paid_twice", subject_id=payment.pk)
    assert entry.data["refund_id"] == refund.pk and entry.data["processor_dispute_id"] == dispute_id


def test_a_refund_a_person_approved_on_a_lost_dispute_whose_answer_is_lost_marks_it_paid_twice(
        api, policy, gateways, stripe_fake):
    """Found by the model (never_paid_twice_silently, MODEL_SEED=1, example 100, step 4,880, on daa024f
    with the dashboard fix): the gateway paid, its answer was lost, and until a look-up found the
    refund (never, on a book that cannot list every refund) the payment was not marked; a dispute
    that comes while an answer is unknown marks it (gateway_events._paid_twice), this order did not.
    On 373afd0: paid_twice False."""
    payment = stripe_payment(stripe_fake, 5_000)
    lost_dispute(stripe_fake, payment)
    answer = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 2_000,
                                           "reason": "customer_request"})
    approve_refund(refund_id=answer.json()["refund"]["id"], approver=approver(), note="goods never shipped")
    stripe_fake.set_mode("drop_after", requests=1, path="/v1/refunds")

    with pytest.raises(ProcessorUnavailable):
        payouts.submit_refund(refund_id=answer.json()["refund"]["id"])

    assert stripe_fake.refund_count == 1  # it paid; we never heard
    payment.refresh_from_db()
    assert payment.paid_twice is True
    entry = AuditEntry.objects.get(action="payment.paid_twice", subject_id=payment.pk)
    assert entry.data["why"] == "answer unknown"
