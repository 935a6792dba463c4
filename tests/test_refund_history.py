"""A new refund is written once, in the state its verdict moves it into, yet its history reads as
if it had been saved in turn: asked for, then approved, held or denied, each row with the change
reason and the acting user simple_history would have recorded, and each state announced."""

from __future__ import annotations

import re

import pytest
from django.contrib.admin.utils import quote
from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import Client

from approvals.models import ApprovalAuthority
from refundops.callers import Caller
from refundops.models import MerchantEndpoint, Refund, RefundState, WebhookDelivery
from tests.conftest import make_limits, make_payment, make_rules, post

pytestmark = pytest.mark.django_db


def rows(refund: Refund) -> list[tuple]:
    return [(h.status, h.history_type, h.history_change_reason, h.history_user, h.hold_reasons, h.failure_code)
            for h in refund.history.order_by("history_date", "history_id")]


def announced(refund: Refund) -> set[tuple]:
    return {(d.payload["data"]["previous_status"], d.payload["data"]["object"]["status"],
             d.payload["data"]["object"].get("failure_code"))
            for d in WebhookDelivery.objects.filter(payload__data__object__id=refund.pk)}


def test_an_agents_approved_refund_has_both_rows_and_both_events(api, policy):
    MerchantEndpoint.objects.create(url="http://127.0.0.1:9/a")
    body = post(api, "/api/v1/refunds", {"transaction_id": make_payment().pk, "amount": 1_000,
                                         "reason": "duplicate"}).json()
    refund = Refund.objects.get(pk=body["refund"]["id"])
    label = Caller.for_key(api.key).label

    assert rows(refund) == [
        (RefundState.REQUESTED, "+", f"requested by {label}", None, [], ""),
        (RefundState.APPROVED, "~", f"verdict {body['verdict']['id']}: approved", None, [], ""),
    ]
    first, last = refund.history.order_by("history_date", "history_id")
    assert first.history_date < last.history_date
    assert (first.id, first.amount_minor, first.created_at) == (refund.pk, 1_000, refund.created_at)
    assert announced(refund) == {(None, "requested", None), ("requested", "approved", None)}


def test_a_denied_refund_keeps_its_code_off_the_requested_row(api, policy):
    MerchantEndpoint.objects.create(url="http://127.0.0.1:9/a")
    make_limits(allowed_reasons=["duplicate"])
    body = post(api, "/api/v1/refunds", {"transaction_id": make_payment().pk, "amount": 1_000,
                                         "reason": "fraudulent"}).json()
    refund = Refund.objects.get(pk=body["error"]["refund_id"])
    code = body["error"]["code"]

    assert rows(refund) == [
        (RefundState.REQUESTED, "+", f"requested by {Caller.for_key(api.key).label}", None, [], ""),
        (RefundState.DENIED, "~", f"verdict {body['error']['verdict_id']}: denied ({code})", None, [], code),
    ]
    assert announced(refund) == {(None, "requested", None), ("requested", "denied", code)}


def test_a_staff_refund_held_in_the_admin_names_the_person_on_both_rows(limits):
    make_rules()
    MerchantEndpoint.objects.create(url="http://127.0.0.1:9/a")
    user = User.objects.create_user("asker", password="pw")
    call_command("grant_role", "asker", "finance approver", stdout=open("/dev/null", "w"))
    ApprovalAuthority.objects.create(user=user, currency="USD", max_amount_minor=100)  # a 40.00 refund is above it
    client = Client()
    client.force_login(User.objects.get(pk=user.pk))
    payment = make_payment(amount=10_000)
    url = f"/admin/refundops/payment/{quote(payment.pk)}/refund/"
    key = re.search(r'name="idempotency_key" value="(\w+)"', client.get(url).content.decode()).group(1)

    client.post(url, {"amount": "40.00", "reason": "product_issue", "idempotency_key": key})

    refund = Refund.objects.get(payment=payment)
    assert refund.status == RefundState.HELD
    (requested, held) = rows(refund)
    assert requested == (RefundState.REQUESTED, "+", "requested by user:asker", user, [], "")
    assert held[:4] == (RefundState.HELD, "~", f"verdict {refund.verdict_id}: held", user)
    assert held[4] == refund.hold_reasons and "ABOVE_REQUESTER_AUTHORITY" in held[4]
    assert announced(refund) == {(None, "requested", None), ("requested", "held", None)}
