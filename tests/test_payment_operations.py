"""Voids, captures, payment links and dispute drafts through the API: what they do at the gateway,
what they refuse, and that every call leaves a verdict."""

from __future__ import annotations

import threading
import uuid
from datetime import timedelta

import pytest
from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.exceptions import PermissionDenied
from django.db import connection
from django.utils import timezone

from audit.models import AuditEntry, Verdict
from processors import sandbox
from processors.models import SandboxCharge
from refundops.callers import Caller
from refundops.errors import ApiError
from refundops.models import (
    Dispute,
    DisputeEvidenceDraft,
    Payment,
    PaymentLink,
    PaymentLinkTemplate,
    PaymentOperation,
)
from refundops.services import payments
from refundops.services.disputes import draft_dispute_evidence, submit_dispute_evidence
from tests.conftest import make_agent_key, make_payment, post

pytestmark = pytest.mark.django_db


def authorization(amount: int = 8_000, **fields) -> Payment:
    return make_payment(amount=amount, captured=False, **{"order_amount_minor": amount, **fields})


def refusal(response, code: str, status: int) -> Verdict:
    """Assert the refusal and return the verdict that recorded it."""
    assert response.status_code == status, response.json()
    error = response.json()["error"]
    assert error["code"] == code
    verdict = Verdict.objects.get(pk=error["verdict_id"])
    assert verdict.outcome == Verdict.Outcome.DENIED and verdict.code == code
    return verdict


# -- void --------------------------------------------------------------------------------------------

def test_void_releases_an_uncaptured_authorisation_at_the_gateway(api):
    payment = authorization()
    response = post(api, f"/api/v1/payments/{payment.pk}/void", {"note": "order cancelled"})
    assert response.status_code == 200, response.json()
    body = response.json()
    assert body["payment"]["status"] == "voided" and body["operation"]["status"] == "succeeded"
    payment.refresh_from_db()
    assert payment.status == Payment.Status.VOIDED
    assert SandboxCharge.objects.get(reference=payment.processor_reference).voided
    verdict = Verdict.objects.get(pk=body["verdict"]["id"])
    assert verdict.operation == "payment.void" and verdict.outcome == "approved"
    assert verdict.payment_id == payment.pk and verdict.gateway_response["status"] == "voided"
    operation = PaymentOperation.objects.get(pk=body["operation"]["id"])
    assert operation.verdict_id == verdict.id  # the gateway write names its verdict
    assert {"payment.void_decided", "payment.void_succeeded"} <= set(
        AuditEntry.objects.values_list("action", flat=True))


def test_void_of_a_captured_payment_is_refused_and_recorded(api):
    payment = make_payment()
    verdict = refusal(post(api, f"/api/v1/payments/{payment.pk}/void", {}), "PAYMENT_NOT_VOIDABLE", 422)
    assert verdict.operation == "payment.void" and verdict.payment_id == payment.pk
    assert verdict.checks[0]["name"] == "payment_voidable" and verdict.checks[0]["result"] == "fail"
    assert not PaymentOperation.objects.exists()
    assert not SandboxCharge.objects.get(reference=payment.processor_reference).voided


def test_void_replays_the_first_answer_and_refuses_another_body_with_the_same_key(api):
    payment = authorization()
    first = post(api, f"/api/v1/payments/{payment.pk}/void", {}, key="void-1")
    again = post(api, f"/api/v1/payments/{payment.pk}/void", {}, key="void-1")
    assert first.status_code == again.status_code == 200
    assert again.json()["deduplicated"] is True and again.json()["operation"] == first.json()["operation"]
    other = post(api, f"/api/v1/payments/{payment.pk}/void", {"note": "x"}, key="void-1")
    refusal(other, "IDEMPOTENCY_KEY_REUSED", 409)
    other_payment = authorization()
    refusal(post(api, f"/api/v1/payments/{other_payment.pk}/void", {}, key="void-1"), "IDEMPOTENCY_KEY_REUSED", 409)
    assert PaymentOperation.objects.count() == 1
    assert Verdict.objects.filter(operation="payment.void", deduplicated=True).count() == 1


def test_void_when_the_gateway_is_down_changes_nothing_and_can_be_tried_again(api):
    payment = authorization()
    sandbox.set_mode("down")
    response = post(api, f"/api/v1/payments/{payment.pk}/void", {})
    assert response.status_code == 503 and response.json()["error"]["code"] == "GATEWAY_UNAVAILABLE"
    operation = PaymentOperation.objects.get(pk=response.json()["error"]["operation_id"])
    assert operation.status == "failed" and operation.failure_code == "gateway_down"
    payment.refresh_from_db()
    assert payment.status == Payment.Status.AUTHORIZED
    sandbox.set_mode("up")
    assert post(api, f"/api/v1/payments/{payment.pk}/void", {}).status_code == 200


def test_gateway_decline_is_a_502_and_leaves_the_payment_as_it_was(api):
    payment = authorization()
    SandboxCharge.objects.filter(reference=payment.processor_reference).update(captured_minor=8_000)
    response = post(api, f"/api/v1/payments/{payment.pk}/void", {})
    assert response.status_code == 502
    error = response.json()["error"]
    assert error["code"] == "GATEWAY_DECLINED" and error["gateway_code"] == "already_captured"
    assert Verdict.objects.get(pk=error["verdict_id"]).gateway_response["error"] == "already_captured"
    payment.refresh_from_db()
    assert payment.status == Payment.Status.AUTHORIZED


def test_unknown_payment_is_not_found_for_void_and_capture(api):
    refusal(post(api, "/api/v1/payments/txn_nope/void", {}), "PAYMENT_NOT_FOUND", 404)
    refusal(post(api, "/api/v1/payments/txn_nope/capture/", {"amount": 1}), "PAYMENT_NOT_FOUND", 404)


@pytest.mark.django_db(transaction=True)
def test_racing_voids_with_different_keys_reach_the_gateway_once():
    payment = authorization()
    key, _ = make_agent_key()
    caller = Caller.for_key(key)
    barrier = threading.Barrier(8)
    answers = []

    def void() -> None:
        try:
            barrier.wait()
            answers.append(payments.void_authorization(caller=caller, txn_id=payment.pk, data={},
                                                       idempotency_key=uuid.uuid4().hex))
        finally:
            connection.close()

    threads = [threading.Thread(target=void) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(a.status for a in answers) == [200] + [422] * 7
    assert PaymentOperation.objects.filter(payment=payment).count() == 1
    assert Verdict.objects.filter(operation="payment.void").count() == 8


# -- capture -----------------------------------------------------------------------------------------

def test_capture_up_to_the_order_amount_sets_the_captured_amount(api):
    payment = authorization(amount=8_000, order_amount_minor=7_500)
    response = post(api, f"/api/v1/payments/{payment.pk}/capture", {"amount": 7_500})
    assert response.status_code == 200, response.json()
    body = response.json()
    assert body["payment"]["amount_captured"] == 7_500 and body["payment"]["status"] == "captured"
    payment.refresh_from_db()
    assert payment.amount_captured_minor == 7_500 and payment.captured_at is not None
    assert SandboxCharge.objects.get(reference=payment.processor_reference).captured_minor == 7_500
    verdict = Verdict.objects.get(pk=body["verdict"]["id"])
    assert verdict.amount_minor == 7_500 and verdict.checks[1]["limit"] == 7_500


def test_capture_above_the_order_amount_is_refused_and_recorded(api):
    payment = authorization(amount=8_000, order_amount_minor=7_500)
    verdict = refusal(post(api, f"/api/v1/payments/{payment.pk}/capture", {"amount": 7_501}),
                      "AMOUNT_EXCEEDS_ORDER", 422)
    assert verdict.operation == "payment.capture" and verdict.amount_minor == 7_501
    assert verdict.checks[-1] == {"name": "amount_within_order", "result": "fail", "inputs": {"amount": 7_501},
                                  "limit": 7_500, "observed": 7_501}
    payment.refresh_from_db()
    assert payment.amount_captured_minor == 0 and not PaymentOperation.objects.exists()


def test_capture_without_a_confirmed_order_amount_stays_with_a_person(api):
    payment = authorization(order_amount_minor=None)
    response = post(api, f"/api/v1/payments/{payment.pk}/capture", {"amount": 1})
    refusal(response, "AMOUNT_EXCEEDS_ORDER", 422)
    assert "a person must capture" in response.json()["error"]["message"]


def test_capture_of_a_captured_or_voided_payment_is_refused(api):
    refusal(post(api, f"/api/v1/payments/{make_payment().pk}/capture", {"amount": 1}), "PAYMENT_NOT_CAPTURABLE", 422)
    voided = authorization()
    post(api, f"/api/v1/payments/{voided.pk}/void", {})
    refusal(post(api, f"/api/v1/payments/{voided.pk}/capture", {"amount": 1}), "PAYMENT_NOT_CAPTURABLE", 422)
    captured = authorization()
    post(api, f"/api/v1/payments/{captured.pk}/capture", {"amount": 100})
    refusal(post(api, f"/api/v1/payments/{captured.pk}/void", {}), "PAYMENT_NOT_VOIDABLE", 422)


@pytest.mark.parametrize("body,field", [({}, "amount"), ({"amount": "100"}, "amount"), ({"amount": 1.5}, "amount"),
                                        ({"amount": 0}, "amount"), ({"amount": 1, "ammount": 1}, "ammount")])
def test_capture_amount_is_strict(api, body, field):
    payment = authorization()
    response = post(api, f"/api/v1/payments/{payment.pk}/capture", body)
    refusal(response, "VALIDATION_ERROR", 400)
    assert response.json()["error"]["field"] == field


# -- payment links -----------------------------------------------------------------------------------

@pytest.fixture
def template(db) -> PaymentLinkTemplate:
    approver = get_user_model().objects.create_user("finance", is_staff=True)
    return PaymentLinkTemplate.objects.create(
        name="balance", message="Hi $customer_name, please pay $amount for $order_reference: $url",
        approved_by=approver, approved_at=timezone.now())


def owing(owed: int = 5_000, **fields) -> Payment:
    return make_payment(order_reference=f"INV-{uuid.uuid4().hex[:6]}", amount_owed_minor=owed, **fields)


def test_payment_link_for_an_amount_owed_is_sent_and_tracked_until_paid(api, template):
    payment = owing(5_000)
    response = post(api, "/api/v1/payment-links", {"order_reference": payment.order_reference,
                                                   "template": template.pk, "amount": 5_000})
    assert response.status_code == 201, response.json()
    link = response.json()["payment_link"]
    url = f"{settings.PUBLIC_BASE_URL}/pay/{link['id']}"
    assert link["id"].startswith("pl_") and link["url"] == url and link["status"] == "sent"
    assert link["message"] == (f"Hi {payment.customer.name}, please pay 50.00 USD for "
                               f"{payment.order_reference}: {url}")
    assert PaymentLink.objects.get(pk=link["id"]).verdict_id == response.json()["verdict"]["id"]
    paid = payments.mark_payment_link_paid(link_id=link["id"], actor="system:webhook")
    assert paid.status == "paid" and paid.paid_at is not None
    payments.mark_payment_link_paid(link_id=link["id"])  # applied once
    payment.refresh_from_db()
    assert payment.amount_owed_minor == 0
    assert AuditEntry.objects.filter(action="payment_link.paid").count() == 1


def test_payment_link_for_more_than_is_owed_is_refused_and_recorded(api, template):
    payment = owing(5_000)
    verdict = refusal(post(api, "/api/v1/payment-links", {"transaction_id": payment.pk, "template": template.pk,
                                                          "amount": 5_001}), "AMOUNT_NOT_OWED", 422)
    assert verdict.operation == "payment_link.send" and verdict.amount_minor == 5_001
    assert verdict.checks[-1]["name"] == "amount_owed" and verdict.checks[-1]["limit"] == 5_000
    refusal(post(api, "/api/v1/payment-links", {"transaction_id": make_payment().pk, "template": template.pk,
                                                "amount": 1}), "AMOUNT_NOT_OWED", 422)
    assert not PaymentLink.objects.exists()


def test_open_links_count_against_what_is_owed(api, template):
    payment = owing(5_000)
    body = {"transaction_id": payment.pk, "template": template.pk, "amount": 3_000}
    assert post(api, "/api/v1/payment-links", body).status_code == 201
    refusal(post(api, "/api/v1/payment-links", body), "AMOUNT_NOT_OWED", 422)
    assert post(api, "/api/v1/payment-links", {**body, "amount": 2_000}).status_code == 201


@pytest.mark.django_db(transaction=True)
def test_racing_links_never_ask_for_more_than_is_owed():
    payment = owing(5_000)
    approver = get_user_model().objects.create_user("finance-race", is_staff=True)
    template = PaymentLinkTemplate.objects.create(name="race", message="$url", approved_by=approver,
                                                  approved_at=timezone.now())
    key, _ = make_agent_key()
    barrier = threading.Barrier(6)
    answers = []

    def send() -> None:
        try:
            barrier.wait()
            answers.append(payments.send_payment_link(
                caller=Caller.for_key(key), idempotency_key=uuid.uuid4().hex,
                data={"transaction_id": payment.pk, "template": template.pk, "amount": 2_000}))
        finally:
            connection.close()

    threads = [threading.Thread(target=send) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(a.status for a in answers) == [201, 201, 422, 422, 422, 422]
    assert payments.outstanding_links_minor(payment) == 4_000


@pytest.mark.parametrize("change", [{"approved_at": None}, {"active": False}])
def test_payment_link_from_an_unapproved_or_retired_template_is_refused(api, template, change):
    PaymentLinkTemplate.objects.filter(pk=template.pk).update(**change)
    payment = owing()
    verdict = refusal(post(api, "/api/v1/payment-links", {"transaction_id": payment.pk, "template": template.pk,
                                                          "amount": 100}), "TEMPLATE_NOT_APPROVED", 422)
    assert verdict.payment_id == payment.pk
    refusal(post(api, "/api/v1/payment-links", {"transaction_id": payment.pk, "template": "tpl_unknown",
                                                "amount": 100}), "TEMPLATE_NOT_APPROVED", 422)


@pytest.mark.parametrize("body", [{"amount": 100}, {"transaction_id": "txn_1", "order_reference": "o", "amount": 100},
                                  {"transaction_id": "txn_1"}])
def test_payment_link_needs_one_payment_reference_and_an_amount(api, template, body):
    refusal(post(api, "/api/v1/payment-links", {"template": template.pk, **body}), "VALIDATION_ERROR", 400)


def test_payment_link_for_an_unknown_order_is_not_found(api, template):
    refusal(post(api, "/api/v1/payment-links", {"order_reference": "nope", "template": template.pk, "amount": 1}),
            "ORDER_NOT_FOUND", 404)


def test_stripe_payment_link_is_created_through_the_adapter_after_the_decision(api, template, gateways,
                                                                                stripe_fake):
    payment = owing(5_000, processor="stripe", processor_reference="pi_123")
    response = post(api, "/api/v1/payment-links", {"transaction_id": payment.pk, "template": template.pk,
                                                   "amount": 5_000})
    assert response.status_code == 201, response.json()
    link = response.json()["payment_link"]
    made = stripe_fake.payment_links[PaymentLink.objects.get(pk=link["id"]).processor_link_id]
    assert link["url"] == made["url"] and made["line_items"][0]["amount_total"] == 5_000
    sent = next(r for r in stripe_fake.received if r.path == "/v1/payment_links")
    assert sent.header("Idempotency-Key") == f"refundops:{link['id']}"
    assert made["metadata"]["verdict_id"] == response.json()["verdict"]["id"]


def test_stripe_outage_frees_the_owed_amount_for_another_link(api, template, gateways, stripe_fake):
    payment = owing(5_000, processor="stripe", processor_reference="pi_456")
    body = {"transaction_id": payment.pk, "template": template.pk, "amount": 5_000}
    stripe_fake.set_mode("down")
    response = post(api, "/api/v1/payment-links", body)
    assert response.status_code == 503 and response.json()["error"]["code"] == "GATEWAY_UNAVAILABLE"
    assert PaymentLink.objects.get(pk=response.json()["error"]["payment_link_id"]).status == "failed"
    assert not stripe_fake.payment_links
    stripe_fake.set_mode("up")
    assert post(api, "/api/v1/payment-links", body).status_code == 201
    assert len(stripe_fake.payment_links) == 1


def test_payment_links_for_a_gateway_without_them_are_refused(api, template):
    payment = owing(5_000, processor="paypal", processor_reference="CAP-1")
    refusal(post(api, "/api/v1/payment-links", {"transaction_id": payment.pk, "template": template.pk,
                                                "amount": 100}), "PAYMENT_LINKS_UNSUPPORTED", 422)


# -- dispute evidence --------------------------------------------------------------------------------

def dispute(**fields) -> Dispute:
    payment = make_payment()
    return Dispute.objects.create(**{"payment": payment, "amount_minor": payment.amount_captured_minor,
                                     "currency": "USD", "reason": "product_not_received",
                                     "evidence_due_by": timezone.now() + timedelta(days=7), **fields})


def test_agent_drafts_evidence_and_only_staff_submit_it(api):
    case = dispute()
    response = post(api, f"/api/v1/disputes/{case.pk}/evidence-drafts",
                    {"summary": "Delivered and signed for.", "shipping_documentation": "UPS 1Z999"})
    assert response.status_code == 201, response.json()
    body = response.json()
    assert body["draft"]["status"] == "draft" and body["dispute"]["id"] == case.pk
    draft = DisputeEvidenceDraft.objects.get(pk=body["draft"]["id"])
    assert draft.drafted_by == api.key.agent and draft.verdict_id == body["verdict"]["id"]
    assert Verdict.objects.get(pk=draft.verdict_id).payment_id == case.payment_id
    clerk = get_user_model().objects.create_user("clerk")
    with pytest.raises(PermissionDenied):
        submit_dispute_evidence(draft_id=draft.pk, user=clerk)
    staff = get_user_model().objects.create_user("disputes", is_staff=True)
    submitted = submit_dispute_evidence(draft_id=draft.pk, user=staff)
    assert submitted.status == "submitted" and submitted.submitted_by == staff
    assert submitted.history.first().history_user == staff
    with pytest.raises(ApiError) as again:
        submit_dispute_evidence(draft_id=draft.pk, user=staff)
    assert again.value.code == "DISPUTE_NOT_OPEN"


def test_unknown_dispute_is_not_found(api):
    refusal(post(api, "/api/v1/disputes/dp_nope/evidence-drafts", {"summary": "x"}), "DISPUTE_NOT_FOUND", 404)


@pytest.mark.parametrize("fields", [{"status": "lost"}, {"evidence_due_by": timezone.now() - timedelta(hours=1)}])
def test_closed_or_overdue_dispute_takes_no_draft(api, fields):
    case = dispute(**fields)
    refusal(post(api, f"/api/v1/disputes/{case.pk}/evidence-drafts", {"summary": "x"}), "DISPUTE_NOT_OPEN", 422)
    assert not DisputeEvidenceDraft.objects.exists()


def test_empty_draft_is_a_validation_error(api):
    refusal(post(api, f"/api/v1/disputes/{dispute().pk}/evidence-drafts", {"summary": "  "}), "VALIDATION_ERROR", 400)


def test_draft_replays_by_key_through_the_service():
    case = dispute()
    key, _ = make_agent_key()
    caller = Caller.for_key(key)
    first = draft_dispute_evidence(caller=caller, dp_id=case.pk, data={"summary": "a"}, idempotency_key="d1")
    again = draft_dispute_evidence(caller=caller, dp_id=case.pk, data={"summary": "a"}, idempotency_key="d1")
    assert again.body["deduplicated"] is True and again.body["draft"] == first.body["draft"]
    assert DisputeEvidenceDraft.objects.count() == 1
