"""Inbound gateway webhooks: verified or refused, applied once, in any order, from the gateway's
own current state (re-read from the fake gateways over real sockets)."""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone

import pytest
from django.test import Client
from django.urls import include, path

from audit.models import AuditEntry, Verdict
from processors import signing
from processors.base import RefundRequest
from processors.models import InboundEvent, SandboxControl, SandboxRefund
from processors.money import Money
from processors.registry import get_processor
from refundops.models import Dispute, Payment, PaymentLink, PaymentLinkTemplate, Refund, RefundState
from refundops.services import payouts
from tests.conftest import make_customer, make_limits, make_payment, post
from tests.fakes.fixtures import (
    PAYPAL_WEBHOOK_ID,
    SANDBOX_WEBHOOK_SECRET,
    paypal_payment,
    post_stripe_event,
    stripe_event,
    stripe_payment,
)
from tests.fakes.paypal_server import FakePayPal
from tests.fakes.stripe_server import FakeStripe

urlpatterns = [path("", include("refundops.urls")), path("webhooks/", include("refundops.webhook_urls"))]
pytestmark = [pytest.mark.urls(__name__), pytest.mark.django_db]
S = RefundState


@pytest.fixture
def web() -> Client:
    return Client(enforce_csrf_checks=True)  # as a gateway posts: no CSRF token


def refund_through_stripe(fake: FakeStripe, payment: Payment, amount: int, *, status: str = "pending") -> Refund:
    """An approved agent refund, paid by the worker's service against the fake Stripe."""
    refund = Refund.objects.create(payment=payment, amount_minor=amount, currency="USD", reason="duplicate",
                                   status=S.APPROVED)
    fake.next_refund_status = status
    return payouts.submit_refund(refund_id=refund.pk)


def refund_object(fake: FakeStripe, refund_id: str) -> dict:
    return dict(fake.refunds[refund_id])


def external_stripe_refund(fake: FakeStripe, payment: Payment, amount: int) -> str:
    """A refund made in Stripe's dashboard: no metadata of ours, a key we never used."""
    result = get_processor("stripe").refund(RefundRequest(
        payment=payouts.payment_ref(payment), amount=Money(amount, "USD"), reason="customer_request",
        idempotency_key=f"dashboard-{time.time_ns()}", refund_id="", verdict_id=""))
    fake.refunds[result.processor_refund_id]["metadata"] = {}
    return result.processor_refund_id


# -- verification ---------------------------------------------------------------------------------
def test_a_forged_event_is_refused_recorded_and_changes_nothing(web, gateways, stripe_fake):
    payment = stripe_payment(stripe_fake)
    refund = refund_through_stripe(stripe_fake, payment, 1_000)
    stripe_fake.set_refund_status(refund.processor_refund_id, "failed")
    event = stripe_event("charge.refund.updated", refund_object(stripe_fake, refund.processor_refund_id))

    response = post_stripe_event(web, event, secret="whsec_not_the_secret")

    assert response.status_code == 400
    assert response.json()["error"]["code"] == "invalid_signature"
    recorded = InboundEvent.objects.get()
    assert recorded.verified is False and "did not verify" in recorded.verification_error
    assert json.loads(recorded.payload)["id"] == event["id"] and recorded.applied_at is None
    refund.refresh_from_db()
    assert refund.status == S.SUBMITTED


def test_a_stale_event_is_refused_even_when_correctly_signed(web, gateways, stripe_fake):
    payment = stripe_payment(stripe_fake)
    refund = refund_through_stripe(stripe_fake, payment, 1_000)
    stripe_fake.set_refund_status(refund.processor_refund_id, "succeeded")
    event = stripe_event("charge.refund.updated", refund_object(stripe_fake, refund.processor_refund_id))

    response = post_stripe_event(web, event, timestamp=int(time.time()) - 3600)

    assert response.status_code == 400
    assert InboundEvent.objects.get().verified is False
    refund.refresh_from_db()
    assert refund.status == S.SUBMITTED


def test_a_forged_event_with_a_real_events_id_does_not_stop_the_real_one(web, gateways, stripe_fake):
    payment = stripe_payment(stripe_fake)
    refund = refund_through_stripe(stripe_fake, payment, 1_000)
    stripe_fake.set_refund_status(refund.processor_refund_id, "succeeded")
    event = stripe_event("charge.refund.updated", refund_object(stripe_fake, refund.processor_refund_id))

    assert post_stripe_event(web, event, secret="whsec_forger").status_code == 400
    assert post_stripe_event(web, event).status_code == 200

    refund.refresh_from_db()
    assert refund.status == S.SETTLED
    assert InboundEvent.objects.filter(event_id=event["id"]).count() == 2


# -- applied once, in any order -------------------------------------------------------------------
def test_a_replayed_event_is_answered_200_and_applied_once(web, gateways, stripe_fake):
    payment = stripe_payment(stripe_fake)
    refund = refund_through_stripe(stripe_fake, payment, 1_000)
    stripe_fake.set_refund_status(refund.processor_refund_id, "succeeded")
    event = stripe_event("charge.refund.updated", refund_object(stripe_fake, refund.processor_refund_id))

    first, second = post_stripe_event(web, event), post_stripe_event(web, event)

    assert (first.status_code, second.status_code) == (200, 200)
    assert (first.json()["duplicate"], second.json()["duplicate"]) == (False, True)
    recorded = InboundEvent.objects.get()
    assert recorded.deliveries == 2 and recorded.applied_at is not None and "submitted → settled" in recorded.outcome
    assert AuditEntry.objects.filter(subject_id=refund.pk, action="refund.settled").count() == 1


def test_duplicate_deliveries_of_an_external_refund_record_it_once(web, gateways, stripe_fake):
    payment = stripe_payment(stripe_fake, 5_000)
    gateway_refund = external_stripe_refund(stripe_fake, payment, 2_000)
    refund_event = stripe_event("charge.refund.updated", refund_object(stripe_fake, gateway_refund))
    charge = dict(stripe_fake.charges[stripe_fake.payment_intents[payment.processor_reference]["latest_charge"]])
    charge["refunds"] = {"object": "list", "data": [refund_object(stripe_fake, gateway_refund)]}
    charge_event = stripe_event("charge.refunded", charge)

    for event in (refund_event, charge_event, refund_event, charge_event):
        assert post_stripe_event(web, event).status_code == 200

    external = Refund.objects.get(payment=payment)
    assert external.origin == Refund.Origin.EXTERNAL and external.processor_refund_id == gateway_refund
    assert InboundEvent.objects.get(event_id=charge_event["id"]).outcome.endswith("already settled")


def test_a_failure_that_arrives_before_the_success_leaves_the_refund_failed(web, gateways, stripe_fake):
    payment = stripe_payment(stripe_fake, 5_000)
    refund = refund_through_stripe(stripe_fake, payment, 1_500)
    re_id = refund.processor_refund_id
    stripe_fake.set_refund_status(re_id, "succeeded")
    succeeded = stripe_event("charge.refund.updated", refund_object(stripe_fake, re_id))
    stripe_fake.set_refund_status(re_id, "failed", failure_reason="expired_or_canceled_card")
    failed = stripe_event("charge.refund.updated", refund_object(stripe_fake, re_id))

    assert post_stripe_event(web, failed).status_code == 200
    assert post_stripe_event(web, succeeded).status_code == 200  # late, and stale: the gateway says failed

    refund.refresh_from_db()
    assert refund.status == S.FAILED and refund.failure_code == "expired_or_canceled_card"
    payment.refresh_from_db()
    assert (payment.amount_refunded_minor, payment.amount_reserved_minor, payment.refundable_minor) == (0, 0, 5_000)


def test_a_refund_failing_after_success_makes_the_amount_refundable_again(web, gateways, stripe_fake, api, policy):
    payment = stripe_payment(stripe_fake, 5_000)
    refund = refund_through_stripe(stripe_fake, payment, 5_000, status="succeeded")
    assert refund.status == S.SETTLED
    payment.refresh_from_db()
    assert payment.refundable_minor == 0
    stripe_fake.set_refund_status(refund.processor_refund_id, "failed", failure_reason="lost_or_stolen_card")

    response = post_stripe_event(web, stripe_event("refund.failed",
                                                   refund_object(stripe_fake, refund.processor_refund_id)))

    assert response.status_code == 200
    refund.refresh_from_db()
    assert refund.status == S.FAILED
    assert [h.status for h in refund.history.order_by("history_date")][-2:] == [S.SETTLED, S.FAILED]
    payment.refresh_from_db()
    assert payment.refundable_minor == 5_000
    assert AuditEntry.objects.filter(subject_id=refund.pk, action="refund.failed").exists()
    again = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 5_000, "reason": "duplicate"})
    assert again.status_code == 201


def test_a_canceled_refund_is_canceled_and_frees_its_amount(web, gateways, stripe_fake):
    payment = stripe_payment(stripe_fake, 5_000)
    refund = refund_through_stripe(stripe_fake, payment, 2_000)
    stripe_fake.set_refund_status(refund.processor_refund_id, "canceled")

    post_stripe_event(web, stripe_event("charge.refund.updated", refund_object(stripe_fake, refund.processor_refund_id)))

    refund.refresh_from_db()
    payment.refresh_from_db()
    assert refund.status == S.CANCELED and payment.refundable_minor == 5_000


def test_news_of_our_refund_before_the_worker_recorded_it_is_not_taken_for_an_external_one(
        web, gateways, stripe_fake):
    payment = stripe_payment(stripe_fake, 5_000)
    refund = Refund.objects.create(payment=payment, amount_minor=1_000, currency="USD", reason="duplicate",
                                   status=S.APPROVED)
    request = RefundRequest(payment=payouts.payment_ref(payment), amount=refund.money, reason=refund.reason,
                            idempotency_key=payouts.gateway_idempotency_key(refund), refund_id=refund.pk,
                            verdict_id="")
    re_id = get_processor("stripe").refund(request).processor_refund_id  # the worker's call, unrecorded

    post_stripe_event(web, stripe_event("refund.created", refund_object(stripe_fake, re_id)))
    payouts.submit_refund(refund_id=refund.pk)  # the worker catches up: the same gateway refund

    refund.refresh_from_db()
    assert refund.status == S.SETTLED and refund.processor_refund_id == re_id
    assert Refund.objects.filter(payment=payment).count() == 1 and stripe_fake.refund_count == 1


# -- refunds made outside RefundOps ---------------------------------------------------------------
def test_an_external_refund_is_recorded_settled_with_a_verdict_saying_where_it_came_from(web, gateways, stripe_fake):
    payment = stripe_payment(stripe_fake, 5_000)
    gateway_refund = external_stripe_refund(stripe_fake, payment, 1_200)
    event = stripe_event("charge.refund.updated", refund_object(stripe_fake, gateway_refund))

    assert post_stripe_event(web, event).status_code == 200

    refund = Refund.objects.get(payment=payment)
    assert (refund.origin, refund.status, refund.amount_minor) == (Refund.Origin.EXTERNAL, S.SETTLED, 1_200)
    verdict = Verdict.objects.get(pk=refund.verdict_id)
    assert verdict.refund_id == refund.pk and "directly" in verdict.message and event["id"] in verdict.message
    assert AuditEntry.objects.filter(action="refund.external_recorded", subject_id=refund.pk).exists()
    payment.refresh_from_db()
    assert (payment.amount_refunded_minor, payment.refundable_minor) == (1_200, 3_800)


def test_an_external_refund_pushes_the_customer_over_the_daily_limit(web, gateways, stripe_fake, api, rules):
    make_limits(customer_daily_amount_minor=10_000)
    customer = make_customer()
    gateway_paid = stripe_payment(stripe_fake, 9_000, customer=customer)
    agent_paid = stripe_payment(stripe_fake, 5_000, customer=customer)
    gateway_refund = external_stripe_refund(stripe_fake, gateway_paid, 9_000)
    post_stripe_event(web, stripe_event("charge.refund.updated", refund_object(stripe_fake, gateway_refund)))

    response = post(api, "/api/v1/refunds", {"transaction_id": agent_paid.pk, "amount": 2_000,
                                             "reason": "customer_request"})

    assert response.status_code == 422
    assert response.json()["error"]["code"] == "DAILY_LIMIT_REACHED"


def test_an_external_refund_cancels_our_waiting_refund_that_no_longer_fits(web, gateways, stripe_fake):
    payment = stripe_payment(stripe_fake, 5_000)
    waiting = Refund.objects.create(payment=payment, amount_minor=3_000, currency="USD", reason="duplicate",
                                    status=S.APPROVED)
    gateway_refund = external_stripe_refund(stripe_fake, payment, 4_000)

    post_stripe_event(web, stripe_event("charge.refund.updated", refund_object(stripe_fake, gateway_refund)))

    waiting.refresh_from_db()
    payment.refresh_from_db()
    assert waiting.status == S.CANCELED
    assert (payment.amount_refunded_minor, payment.amount_reserved_minor) == (4_000, 0)


def test_an_external_refund_that_no_longer_fits_is_raised_as_a_discrepancy_and_answered_200_every_time(
        web, gateways, stripe_fake):
    """Our 3,000 is submitted here but Stripe failed it (its event not here yet), so Stripe let the
    dashboard refund 4,000 of the 5,000: our ledger cannot hold both. The gateway's refund is a fact;
    a person decides, and no delivery of the event is ever answered 500."""
    from refundops.models import LedgerDiscrepancy

    payment = stripe_payment(stripe_fake, 5_000)
    ours = refund_through_stripe(stripe_fake, payment, 3_000)
    stripe_fake.set_refund_status(ours.processor_refund_id, "failed")
    gateway_refund = external_stripe_refund(stripe_fake, payment, 4_000)
    refund_event = stripe_event("charge.refund.updated", refund_object(stripe_fake, gateway_refund))
    charge = dict(stripe_fake.charges[stripe_fake.payment_intents[payment.processor_reference]["latest_charge"]])
    charge["refunds"] = {"object": "list", "data": [refund_object(stripe_fake, gateway_refund)]}
    charge_event = stripe_event("charge.refunded", charge)

    answers = [post_stripe_event(web, event) for event in (refund_event, refund_event, charge_event)]

    assert [a.status_code for a in answers] == [200, 200, 200]
    assert answers[1].json()["duplicate"] is True  # the redelivery
    discrepancy = LedgerDiscrepancy.objects.get(payment=payment)  # raised once, for all three
    assert (discrepancy.kind, discrepancy.gateway_reference, discrepancy.status) == (
        LedgerDiscrepancy.Kind.UNKNOWN_REFUND, gateway_refund, LedgerDiscrepancy.Status.OPEN)
    assert discrepancy.theirs["amount_minor"] == 4_000 and discrepancy.ours["reserved_minor"] == 3_000
    assert discrepancy.pk in InboundEvent.objects.get(event_id=refund_event["id"]).outcome
    assert not Refund.objects.filter(processor_refund_id=gateway_refund).exists()
    assert AuditEntry.objects.filter(action="ledger.discrepancy", subject_id=payment.pk).count() == 1
    payment.refresh_from_db()
    assert (payment.amount_refunded_minor, payment.amount_reserved_minor) == (0, 3_000)


def test_an_external_refund_never_cancels_our_refund_whose_gateway_call_may_be_on_its_way(
        web, gateways, stripe_fake):
    from refundops.models import LedgerDiscrepancy
    from refundops.services import attempts

    payment = stripe_payment(stripe_fake, 5_000)
    in_flight = Refund.objects.create(payment=payment, amount_minor=3_000, currency="USD", reason="duplicate",
                                      status=S.APPROVED)
    attempts.open_attempt(in_flight)  # a worker is calling the gateway for it right now
    waiting = Refund.objects.create(payment=payment, amount_minor=1_000, currency="USD", reason="duplicate",
                                    status=S.HELD)
    gateway_refund = external_stripe_refund(stripe_fake, payment, 4_000)

    response = post_stripe_event(web, stripe_event("charge.refund.updated",
                                                   refund_object(stripe_fake, gateway_refund)))

    assert response.status_code == 200
    in_flight.refresh_from_db()
    waiting.refresh_from_db()
    # Canceling the held one cannot make room beside the one that may be paid: a person decides.
    assert (in_flight.status, waiting.status) == (S.APPROVED, S.HELD)
    assert LedgerDiscrepancy.objects.get(payment=payment).gateway_reference == gateway_refund


def test_an_external_refund_cancels_waiting_refunds_newest_first_only_as_far_as_needed(web, gateways, stripe_fake):
    payment = stripe_payment(stripe_fake, 5_000)
    submitted = refund_through_stripe(stripe_fake, payment, 1_000)
    older = Refund.objects.create(payment=payment, amount_minor=1_500, currency="USD", reason="duplicate",
                                  status=S.HELD)
    newer = Refund.objects.create(payment=payment, amount_minor=1_500, currency="USD", reason="duplicate",
                                  status=S.APPROVED)
    stripe_fake.next_refund_status = "succeeded"  # the dashboard's refund settles at once
    gateway_refund = external_stripe_refund(stripe_fake, payment, 2_000)

    assert post_stripe_event(web, stripe_event("charge.refund.updated",
                                               refund_object(stripe_fake, gateway_refund))).status_code == 200

    statuses = [Refund.objects.get(pk=r.pk).status for r in (submitted, older, newer)]
    assert statuses == [S.SUBMITTED, S.HELD, S.CANCELED]
    payment.refresh_from_db()
    assert (payment.amount_refunded_minor, payment.amount_reserved_minor) == (2_000, 2_500)


def test_a_paypal_capture_refunded_on_paypal_is_recorded_as_external(web, gateways, paypal_fake: FakePayPal):
    payment = paypal_payment(paypal_fake, "80.00")
    result = get_processor("paypal").refund(RefundRequest(
        payment=payouts.payment_ref(payment), amount=Money(2_500, "USD"), reason="customer_request",
        idempotency_key="paypal-dashboard-1", refund_id="", verdict_id=""))
    resource = {**paypal_fake.refunds[result.processor_refund_id]}
    resource.pop("refunded", None)
    resource.pop("capture_id", None)
    event = {"id": "WH-7YX49823S2290830K", "event_version": "1.0", "resource_type": "refund",
             "event_type": "PAYMENT.CAPTURE.REFUNDED", "summary": "A $25.00 USD capture payment was refunded",
             "create_time": datetime.now(timezone.utc).isoformat(), "resource": resource}
    headers = {f"HTTP_{k.upper().replace('-', '_')}": v
               for k, v in paypal_fake.sign_webhook(event, webhook_id=PAYPAL_WEBHOOK_ID).items()}

    first = web.post("/webhooks/paypal/", data=json.dumps(event), content_type="application/json", **headers)
    again = web.post("/webhooks/paypal/", data=json.dumps(event), content_type="application/json", **headers)

    assert (first.status_code, again.status_code) == (200, 200) and again.json()["duplicate"] is True
    refund = Refund.objects.get(payment=payment)
    assert (refund.origin, refund.status, refund.amount_minor) == (Refund.Origin.EXTERNAL, S.SETTLED, 2_500)


def test_a_forged_paypal_event_is_refused_and_paypal_down_asks_for_a_retry(web, gateways, paypal_fake: FakePayPal):
    payment = paypal_payment(paypal_fake, "80.00")
    event = {"id": "WH-FORGED", "event_type": "PAYMENT.CAPTURE.REFUNDED",
             "resource": {"id": "1JU08902781691411", "status": "COMPLETED",
                          "links": [{"rel": "up", "href": f"{paypal_fake.url}/v2/payments/captures/"
                                                          f"{payment.processor_reference}"}]}}
    headers = {f"HTTP_{k.upper().replace('-', '_')}": v
               for k, v in paypal_fake.sign_webhook(event, webhook_id="WH-SOMEONE-ELSES").items()}
    body = json.dumps(event)

    refused = web.post("/webhooks/paypal/", data=body, content_type="application/json", **headers)
    paypal_fake.set_mode("down")
    unverifiable = web.post("/webhooks/paypal/", data=body, content_type="application/json", **headers)

    assert (refused.status_code, unverifiable.status_code) == (400, 503)
    assert InboundEvent.objects.get().verified is False
    assert not Refund.objects.exists()


# -- disputes -------------------------------------------------------------------------------------
def dispute_event(fake: FakeStripe, event_type: str, dispute_id: str) -> dict:
    return stripe_event(event_type, dict(fake.disputes[dispute_id]))


def charge_of(fake: FakeStripe, payment: Payment) -> str:
    return fake.payment_intents[payment.processor_reference]["latest_charge"]


def test_a_dispute_opens_on_the_payment_and_a_later_refund_is_held(web, gateways, stripe_fake, api, policy):
    payment = stripe_payment(stripe_fake, 5_000)
    dispute_id = stripe_fake.add_dispute(charge_of(stripe_fake, payment))

    assert post_stripe_event(web, dispute_event(stripe_fake, "charge.dispute.created", dispute_id)).status_code == 200

    payment.refresh_from_db()
    assert (payment.dispute_status, payment.dispute_reference, payment.paid_twice) == ("open", dispute_id, False)
    dispute = Dispute.objects.get(payment=payment)
    assert dispute.status == Dispute.Status.OPEN and dispute.evidence_due_by is not None
    response = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 1_000,
                                             "reason": "customer_request"})
    assert response.status_code == 202 and "PAYMENT_DISPUTED" in response.json()["hold_reasons"]


def test_a_dispute_on_a_refunded_payment_marks_it_paid_twice(web, gateways, stripe_fake):
    payment = stripe_payment(stripe_fake, 5_000)
    refund_through_stripe(stripe_fake, payment, 5_000, status="succeeded")
    dispute_id = stripe_fake.add_dispute(charge_of(stripe_fake, payment))

    post_stripe_event(web, dispute_event(stripe_fake, "charge.dispute.created", dispute_id))

    payment.refresh_from_db()
    assert payment.paid_twice is True and payment.dispute_status == Payment.Dispute.OPEN
    assert AuditEntry.objects.filter(action="payment.paid_twice", subject_id=payment.pk).count() == 1


@pytest.mark.parametrize(("outcome", "expected"), [("won", "won"), ("lost", "lost")])
def test_a_closed_dispute_stays_closed_whatever_order_its_events_arrive_in(web, gateways, stripe_fake,
                                                                           outcome, expected):
    payment = stripe_payment(stripe_fake, 5_000)
    dispute_id = stripe_fake.add_dispute(charge_of(stripe_fake, payment))
    created = dispute_event(stripe_fake, "charge.dispute.created", dispute_id)
    stripe_fake.disputes[dispute_id]["status"] = outcome
    closed = dispute_event(stripe_fake, "charge.dispute.closed", dispute_id)

    post_stripe_event(web, closed)
    post_stripe_event(web, created)

    payment.refresh_from_db()
    assert payment.dispute_status == expected
    assert Dispute.objects.get(payment=payment).status == expected


def test_a_won_dispute_clears_paid_twice_when_it_was_the_only_one(web, gateways, stripe_fake):
    payment = stripe_payment(stripe_fake, 5_000)
    refund_through_stripe(stripe_fake, payment, 5_000, status="succeeded")
    dispute_id = stripe_fake.add_dispute(charge_of(stripe_fake, payment))
    post_stripe_event(web, dispute_event(stripe_fake, "charge.dispute.created", dispute_id))
    stripe_fake.disputes[dispute_id]["status"] = "won"

    post_stripe_event(web, dispute_event(stripe_fake, "charge.dispute.closed", dispute_id))

    payment.refresh_from_db()
    assert (payment.dispute_status, payment.paid_twice) == ("won", False)
    assert AuditEntry.objects.filter(action="payment.paid_twice_cleared", subject_id=payment.pk).count() == 1


def test_a_won_dispute_keeps_paid_twice_while_another_of_the_payment_is_lost(web, gateways, stripe_fake):
    payment = stripe_payment(stripe_fake, 5_000)
    refund_through_stripe(stripe_fake, payment, 2_000, status="succeeded")
    charge = charge_of(stripe_fake, payment)
    lost, won = stripe_fake.add_dispute(charge), stripe_fake.add_dispute(charge)
    for dispute_id in (lost, won):
        post_stripe_event(web, dispute_event(stripe_fake, "charge.dispute.created", dispute_id))
    stripe_fake.disputes[lost]["status"], stripe_fake.disputes[won]["status"] = "lost", "won"

    post_stripe_event(web, dispute_event(stripe_fake, "charge.dispute.closed", lost))
    post_stripe_event(web, dispute_event(stripe_fake, "charge.dispute.closed", won))

    payment.refresh_from_db()
    assert (payment.dispute_status, payment.dispute_reference, payment.paid_twice) == ("lost", lost, True)
    assert not AuditEntry.objects.filter(action="payment.paid_twice_cleared").exists()


def test_a_won_dispute_keeps_paid_twice_while_another_of_the_payment_is_open(web, gateways, stripe_fake):
    payment = stripe_payment(stripe_fake, 5_000)
    refund_through_stripe(stripe_fake, payment, 2_000, status="succeeded")
    charge = charge_of(stripe_fake, payment)
    still_open, won = stripe_fake.add_dispute(charge), stripe_fake.add_dispute(charge)
    for dispute_id in (still_open, won):
        post_stripe_event(web, dispute_event(stripe_fake, "charge.dispute.created", dispute_id))
    stripe_fake.disputes[won]["status"] = "won"

    post_stripe_event(web, dispute_event(stripe_fake, "charge.dispute.closed", won))

    payment.refresh_from_db()
    assert (payment.dispute_status, payment.dispute_reference, payment.paid_twice) == ("open", still_open, True)


def test_a_dispute_lost_after_a_refund_made_while_it_was_open_marks_the_payment_paid_twice(web, gateways,
                                                                                          stripe_fake):
    payment = stripe_payment(stripe_fake, 5_000)
    dispute_id = stripe_fake.add_dispute(charge_of(stripe_fake, payment))
    post_stripe_event(web, dispute_event(stripe_fake, "charge.dispute.created", dispute_id))
    refund_through_stripe(stripe_fake, payment, 5_000, status="succeeded")
    stripe_fake.disputes[dispute_id]["status"] = "lost"

    post_stripe_event(web, dispute_event(stripe_fake, "charge.dispute.closed", dispute_id))

    payment.refresh_from_db()
    assert (payment.dispute_status, payment.paid_twice) == ("lost", True)
    assert AuditEntry.objects.filter(action="payment.paid_twice", subject_id=payment.pk).count() == 1


# -- PayPal disputes --------------------------------------------------------------------------------
def post_paypal_event(client: Client, fake: FakePayPal, event: dict):
    headers = {f"HTTP_{k.upper().replace('-', '_')}": v
               for k, v in fake.sign_webhook(event, webhook_id=PAYPAL_WEBHOOK_ID).items()}
    return client.post("/webhooks/paypal/", data=json.dumps(event), content_type="application/json", **headers)


def test_a_paypal_dispute_opens_on_the_capture_and_is_re_read_from_paypal(web, gateways, paypal_fake):
    payment = paypal_payment(paypal_fake, "80.00")
    dispute_id = paypal_fake.add_dispute(payment.processor_reference)

    answer = post_paypal_event(web, paypal_fake, paypal_fake.dispute_event("CUSTOMER.DISPUTE.CREATED", dispute_id))

    assert answer.status_code == 200 and answer.json()["applied"] is True
    assert any(r.method == "GET" and r.path == f"/v1/customer/disputes/{dispute_id}" for r in paypal_fake.received)
    payment.refresh_from_db()
    assert (payment.dispute_status, payment.dispute_reference, payment.paid_twice) == ("open", dispute_id, False)
    dispute = Dispute.objects.get(payment=payment)
    assert (dispute.status, dispute.amount_minor, dispute.currency) == ("open", 8_000, "USD")
    assert dispute.reason == "MERCHANDISE_OR_SERVICE_NOT_RECEIVED" and dispute.evidence_due_by is not None
    assert InboundEvent.objects.get(event_id__startswith="WH-").object_id == dispute_id


@pytest.mark.parametrize(("outcome", "expected"), [("RESOLVED_SELLER_FAVOUR", "won"),
                                                    ("RESOLVED_BUYER_FAVOUR", "lost")])
def test_a_resolved_paypal_dispute_is_won_or_lost_as_paypal_says_now(web, gateways, paypal_fake, outcome, expected):
    payment = paypal_payment(paypal_fake, "80.00")
    dispute_id = paypal_fake.add_dispute(payment.processor_reference)
    created = paypal_fake.dispute_event("CUSTOMER.DISPUTE.CREATED", dispute_id)
    post_paypal_event(web, paypal_fake, created)
    paypal_fake.resolve_dispute(dispute_id, outcome)

    post_paypal_event(web, paypal_fake, paypal_fake.dispute_event("CUSTOMER.DISPUTE.RESOLVED", dispute_id))
    post_paypal_event(web, paypal_fake, {**created, "id": "WH-LATE-CREATED"})  # late, and stale

    payment.refresh_from_db()
    assert payment.dispute_status == expected and Dispute.objects.get(payment=payment).status == expected
    assert [e.action for e in AuditEntry.objects.filter(subject_id=payment.pk).order_by("id")] == [
        "dispute.opened", f"dispute.{expected}"]


def test_a_paypal_dispute_on_a_refunded_capture_marks_it_paid_twice(web, gateways, paypal_fake):
    payment = paypal_payment(paypal_fake, "80.00")
    refund = Refund.objects.create(payment=payment, amount_minor=8_000, currency="USD", reason="duplicate",
                                   status=S.APPROVED)
    assert payouts.submit_refund(refund_id=refund.pk).status == S.SETTLED
    dispute_id = paypal_fake.add_dispute(payment.processor_reference)

    post_paypal_event(web, paypal_fake, paypal_fake.dispute_event("CUSTOMER.DISPUTE.CREATED", dispute_id))

    payment.refresh_from_db()
    assert payment.paid_twice is True and payment.dispute_status == Payment.Dispute.OPEN
    entry = AuditEntry.objects.get(action="payment.paid_twice", subject_id=payment.pk)
    assert entry.data["amount_refunded_minor"] == 8_000


def test_a_paypal_dispute_paypal_does_not_show_is_acknowledged_and_kept_unapplied(web, gateways, paypal_fake):
    payment = paypal_payment(paypal_fake, "80.00")
    dispute_id = paypal_fake.add_dispute(payment.processor_reference)
    event = paypal_fake.dispute_event("CUSTOMER.DISPUTE.CREATED", dispute_id)
    del paypal_fake.disputes[dispute_id]

    answer = post_paypal_event(web, paypal_fake, event)

    assert answer.status_code == 200 and answer.json()["applied"] is False
    assert "INVALID_RESOURCE_ID" in InboundEvent.objects.get(event_id=event["id"]).error
    payment.refresh_from_db()
    assert payment.dispute_status == "none" and not Dispute.objects.exists()


# -- Stripe payment links ---------------------------------------------------------------------------
@pytest.fixture
def link_template() -> PaymentLinkTemplate:
    return PaymentLinkTemplate.objects.create(name="balance", message="Please pay $amount: $url",
                                              approved_at=datetime.now(timezone.utc))


@pytest.mark.parametrize("event_type", ["checkout.session.completed", "payment_intent.succeeded"])
def test_a_stripe_payment_link_paid_is_marked_paid_once(web, gateways, stripe_fake, api, policy, link_template,
                                                        event_type):
    payment = stripe_payment(stripe_fake, 5_000, order_reference="INV-77", amount_owed_minor=3_000)
    sent = post(api, "/api/v1/payment-links", {"order_reference": "INV-77", "template": link_template.pk,
                                               "amount": 3_000})
    assert sent.status_code == 201, sent.json()
    link = PaymentLink.objects.get(pk=sent.json()["payment_link"]["id"])
    session, intent = stripe_fake.pay_payment_link(link.processor_link_id)
    event = stripe_event(event_type, session if event_type.startswith("checkout") else intent)

    first, again = post_stripe_event(web, event), post_stripe_event(web, event)

    assert (first.status_code, again.status_code, again.json()["duplicate"]) == (200, 200, True)
    link.refresh_from_db()
    payment.refresh_from_db()
    assert link.status == PaymentLink.Status.PAID and payment.amount_owed_minor == 0
    entry = AuditEntry.objects.get(action="payment_link.paid", subject_id=link.pk)
    assert entry.actor == "system:webhook"


def test_a_checkout_session_not_yet_paid_leaves_the_link_sent(web, gateways, stripe_fake, api, policy,
                                                              link_template):
    stripe_payment(stripe_fake, 5_000, order_reference="INV-78", amount_owed_minor=3_000)
    sent = post(api, "/api/v1/payment-links", {"order_reference": "INV-78", "template": link_template.pk,
                                               "amount": 3_000})
    link = PaymentLink.objects.get(pk=sent.json()["payment_link"]["id"])
    session, _ = stripe_fake.pay_payment_link(link.processor_link_id)

    post_stripe_event(web, stripe_event("checkout.session.completed", {**session, "payment_status": "unpaid"}))

    link.refresh_from_db()
    assert link.status == PaymentLink.Status.SENT
    assert not AuditEntry.objects.filter(action="payment_link.paid").exists()


# -- the sandbox gateway ----------------------------------------------------------------------------
def post_sandbox_event(client: Client, event: dict, *, secret: str = SANDBOX_WEBHOOK_SECRET,
                       timestamp: int | None = None):
    body = json.dumps(event).encode()
    return client.post("/webhooks/sandbox/", data=body, content_type="application/json",
                       HTTP_SANDBOX_SIGNATURE=signing.sign(body, secret, timestamp=timestamp))


def test_a_signed_sandbox_event_settles_our_refund_and_a_forged_one_is_refused(web, gateways):
    SandboxControl.objects.update_or_create(pk=1, defaults={"mode": "up", "settle_delay_seconds": 3600})
    payment = make_payment(amount=4_000)
    refund = Refund.objects.create(payment=payment, amount_minor=1_000, currency="USD", reason="duplicate",
                                   status=S.APPROVED)
    refund = payouts.submit_refund(refund_id=refund.pk)
    assert refund.status == S.SUBMITTED
    SandboxRefund.objects.filter(reference=refund.processor_refund_id).update(
        settles_at=datetime.now(timezone.utc) - timedelta(seconds=1))
    event = {"id": "sbevt_1", "type": "refund.updated",
             "data": {"object": {"id": refund.processor_refund_id, "charge": payment.processor_reference}}}

    assert post_sandbox_event(web, event, secret="wrong").status_code == 400
    assert post_sandbox_event(web, event, timestamp=int(time.time()) - 3600).status_code == 400
    refund.refresh_from_db()
    assert refund.status == S.SUBMITTED
    assert post_sandbox_event(web, event).status_code == 200
    refund.refresh_from_db()
    assert refund.status == S.SETTLED
    assert InboundEvent.objects.filter(verified=False).count() == 2


def test_webhooks_need_no_csrf_token_and_take_only_post(web, gateways):
    assert web.get("/webhooks/stripe/").status_code == 405
    assert web.post("/webhooks/stripe/", data=b"{}", content_type="application/json").status_code == 400
    assert web.post("/webhooks/nowhere/", data=b"{}", content_type="application/json").status_code == 404


def test_an_event_whose_object_the_gateway_cannot_show_is_acknowledged_and_kept_unapplied(web, gateways,
                                                                                         stripe_fake):
    event = stripe_event("charge.refund.updated", {"id": "re_not_on_stripe", "object": "refund",
                                                   "status": "succeeded", "amount": 100})

    response = post_stripe_event(web, event)

    assert response.status_code == 200 and response.json()["applied"] is False
    recorded = InboundEvent.objects.get()
    assert recorded.applied_at is None and "resource_missing" in recorded.error
    assert not Refund.objects.exists()


def test_gateway_down_while_re_reading_asks_for_the_event_again_and_the_retry_applies_it(web, gateways,
                                                                                        stripe_fake):
    payment = stripe_payment(stripe_fake)
    refund = refund_through_stripe(stripe_fake, payment, 1_000)
    stripe_fake.set_refund_status(refund.processor_refund_id, "succeeded")
    event = stripe_event("charge.refund.updated", refund_object(stripe_fake, refund.processor_refund_id))
    stripe_fake.set_mode("rate_limited", retry_after=3)

    busy = post_stripe_event(web, event)
    stripe_fake.set_mode("up")
    retried = post_stripe_event(web, event)

    assert (busy.status_code, busy["Retry-After"]) == (503, "3")
    assert retried.status_code == 200 and retried.json()["duplicate"] is False
    refund.refresh_from_db()
    assert refund.status == S.SETTLED
    recorded = InboundEvent.objects.get()
    assert (recorded.deliveries, recorded.error) == (2, "") and recorded.applied_at is not None


def test_a_sandbox_dispute_opens_and_closes_on_the_payment(web, gateways):
    payment = make_payment(amount=4_000)
    opened = {"id": "sbevt_d1", "type": "dispute.created",
              "data": {"object": {"id": "sbdp_1", "charge": payment.processor_reference, "status": "needs_response",
                                  "amount": 4_000, "currency": "usd", "reason": "fraudulent"}}}
    closed = {"id": "sbevt_d2", "type": "dispute.closed",
              "data": {"object": {**opened["data"]["object"], "status": "lost"}}}

    post_sandbox_event(web, opened)
    payment.refresh_from_db()
    assert payment.dispute_status == Payment.Dispute.OPEN
    post_sandbox_event(web, closed)

    payment.refresh_from_db()
    assert payment.dispute_status == Payment.Dispute.LOST
    assert [e.action for e in AuditEntry.objects.filter(subject_id=payment.pk).order_by("id")] == [
        "dispute.opened", "dispute.lost"]


def test_a_failure_of_our_refund_before_the_worker_recorded_it_is_asked_for_again(web, gateways, stripe_fake):
    payment = stripe_payment(stripe_fake, 5_000)
    refund = Refund.objects.create(payment=payment, amount_minor=1_000, currency="USD", reason="duplicate",
                                   status=S.APPROVED)
    request = RefundRequest(payment=payouts.payment_ref(payment), amount=refund.money, reason=refund.reason,
                            idempotency_key=payouts.gateway_idempotency_key(refund), refund_id=refund.pk,
                            verdict_id="")
    re_id = get_processor("stripe").refund(request).processor_refund_id  # the worker's call, unrecorded
    stripe_fake.set_refund_status(re_id, "failed")
    event = stripe_event("charge.refund.updated", refund_object(stripe_fake, re_id))

    early = post_stripe_event(web, event)
    payouts.submit_refund(refund_id=refund.pk)  # the worker records its answer: the same gateway refund
    later = post_stripe_event(web, event)

    assert (early.status_code, early["Retry-After"], later.status_code) == (503, "60", 200)
    refund.refresh_from_db()
    assert refund.status == S.FAILED and refund.processor_refund_id == re_id
