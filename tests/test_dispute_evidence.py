"""Dispute evidence an agent drafted goes to the gateway only when a person submits it from the
admin: Stripe ``disputes.update`` with the evidence and ``submit``, PayPal ``provide-evidence``.
Each submission is audited and keeps the gateway's answer; a refusal leaves the draft for a person
to try again, an outage lets the same request be sent again."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
from django.contrib.auth.models import User
from django.urls import reverse
from django.utils import timezone

from audit.models import AuditEntry
from refundops.callers import Caller
from refundops.models import Dispute, DisputeEvidenceDraft, Payment
from refundops.services.disputes import draft_dispute_evidence, submit_dispute_evidence
from tests.conftest import make_agent_key, make_customer
from tests.fakes.fixtures import paypal_payment, stripe_payment

pytestmark = pytest.mark.django_db

TEXTS = {"summary": "The customer received the order and wrote to thank us.",
         "customer_communication": "2026-03-02 customer: arrived, thanks!",
         "refund_policy": "Refunds within 30 days of delivery, shown at checkout.",
         "shipping_documentation": "UPS 1Z999AA10123456784, delivered 2026-03-01, signed by J. Doe"}


def drafted(payment: Payment, reference: str, **texts: str) -> DisputeEvidenceDraft:
    case = Dispute.objects.create(payment=payment, processor_dispute_id=reference, amount_minor=payment.amount_captured_minor,
                                  currency=payment.currency, reason="product_not_received",
                                  evidence_due_by=timezone.now() + timedelta(days=7))
    key, _ = make_agent_key()
    answer = draft_dispute_evidence(caller=Caller.for_key(key), dp_id=case.pk, data=texts or TEXTS,
                                    idempotency_key=f"draft-{case.pk}")
    assert answer.status == 201, answer.body
    return DisputeEvidenceDraft.objects.get(pk=answer.body["draft"]["id"])


@pytest.fixture
def person(client):
    user = User.objects.create_superuser("dana", "dana@example.com", "pw")
    client.force_login(user)
    return user


def submit_in_admin(client, draft: DisputeEvidenceDraft):
    return client.post(reverse("admin:refundops_disputeevidencedraft_changelist"),
                       {"action": "submit_to_gateway", "_selected_action": [draft.pk]}, follow=True)


# -- Stripe ------------------------------------------------------------------------------------------

def test_a_person_submits_a_draft_to_stripe_from_the_admin_and_stripes_answer_is_kept(
        client, person, gateways, stripe_fake):
    payment = stripe_payment(stripe_fake, 5_000)
    reference = stripe_fake.add_dispute(stripe_fake.payment_intents[payment.processor_reference]["latest_charge"],
                                        reason="product_not_received")
    draft = drafted(payment, reference)

    page = submit_in_admin(client, draft)

    stored = stripe_fake.disputes[reference]
    assert stored["status"] == "under_review" and stored["evidence_details"]["submission_count"] == 1
    text = stored["evidence"]["uncategorized_text"]
    assert TEXTS["summary"] in text and TEXTS["customer_communication"] in text
    assert TEXTS["shipping_documentation"] in text
    assert stored["evidence"]["refund_policy_disclosure"] == TEXTS["refund_policy"]
    draft.refresh_from_db()
    assert (draft.status, draft.submitted_by) == (DisputeEvidenceDraft.Status.SUBMITTED, person)
    assert draft.gateway_response["status"] == "under_review"
    entry = AuditEntry.objects.get(action="dispute.evidence_submitted")
    assert entry.actor == "user:dana" and entry.data["gateway"]["status"] == "under_review"
    assert "submitted to stripe" in page.content.decode()


def test_a_draft_stripe_refuses_is_kept_with_stripes_words_for_a_person_to_try_again(
        client, person, gateways, stripe_fake):
    payment = stripe_payment(stripe_fake, 5_000)
    reference = stripe_fake.add_dispute(stripe_fake.payment_intents[payment.processor_reference]["latest_charge"])
    stripe_fake.close_dispute(reference, "lost")  # Stripe closed it; we have not heard yet
    draft = drafted(payment, reference)

    page = submit_in_admin(client, draft)

    draft.refresh_from_db()
    assert draft.status == DisputeEvidenceDraft.Status.FAILED
    assert "can no longer be updated" in draft.gateway_response["message"]
    assert AuditEntry.objects.filter(action="dispute.evidence_refused").exists()
    assert "can no longer be updated" in page.content.decode()


def test_an_outage_leaves_the_draft_to_send_again_as_the_same_request(client, person, gateways, stripe_fake):
    payment = stripe_payment(stripe_fake, 5_000)
    reference = stripe_fake.add_dispute(stripe_fake.payment_intents[payment.processor_reference]["latest_charge"])
    draft = drafted(payment, reference)
    stripe_fake.set_mode("down")

    submit_in_admin(client, draft)
    draft.refresh_from_db()
    assert draft.status == DisputeEvidenceDraft.Status.DRAFT
    stripe_fake.set_mode("up")
    submit_in_admin(client, draft)

    draft.refresh_from_db()
    assert draft.status == DisputeEvidenceDraft.Status.SUBMITTED
    keys = [r.header("Idempotency-Key") for r in stripe_fake.received if r.path == f"/v1/disputes/{reference}"]
    assert len(keys) == 2 and keys[0] == keys[1]


def test_evidence_longer_than_stripe_takes_is_refused_before_calling_it(gateways, stripe_fake):
    payment = stripe_payment(stripe_fake, 5_000)
    reference = stripe_fake.add_dispute(stripe_fake.payment_intents[payment.processor_reference]["latest_charge"])
    draft = drafted(payment, reference, summary="x" * 15_000, customer_communication="y" * 15_000)
    staff = User.objects.create_user("eve", is_staff=True)

    submitted = submit_dispute_evidence(draft_id=draft.pk, user=staff)

    assert submitted.status == DisputeEvidenceDraft.Status.FAILED
    assert submitted.gateway_response["error"] == "evidence_too_long"
    assert not [r for r in stripe_fake.received if r.path.startswith("/v1/disputes/")]


# -- PayPal ------------------------------------------------------------------------------------------

def test_a_person_submits_a_draft_to_paypal_as_provide_evidence(client, person, gateways, paypal_fake):
    payment = paypal_payment(paypal_fake, "50.00")
    reference = paypal_fake.add_dispute(payment.processor_reference)
    draft = drafted(payment, reference, summary="Delivered.", refund_policy="x" * 2_500)

    submit_in_admin(client, draft)

    stored = paypal_fake.disputes[reference]
    assert stored["status"] == "UNDER_REVIEW"
    notes = [e["notes"] for e in stored["evidences"]]
    assert notes[0].endswith("Delivered.") and all(len(n) <= 2_000 for n in notes)
    assert "".join(notes[1:]).count("x") == 2_500  # the policy, in as many notes as PayPal needs
    assert {e["evidence_type"] for e in stored["evidences"]} == {"OTHER"}
    draft.refresh_from_db()
    assert draft.status == DisputeEvidenceDraft.Status.SUBMITTED
    assert draft.gateway_response["status"] == "UNDER_REVIEW"


def test_a_sandbox_dispute_is_submitted_without_a_gateway(client, person):
    from tests.conftest import make_payment
    draft = drafted(make_payment(customer=make_customer()), "")

    submit_in_admin(client, draft)

    draft.refresh_from_db()
    assert draft.status == DisputeEvidenceDraft.Status.SUBMITTED
    assert json.dumps(draft.gateway_response)  # recorded, whatever it says
