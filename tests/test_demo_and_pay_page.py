"""The demo a newcomer starts with, and the sandbox's hosted payment page."""

from __future__ import annotations

import json
import uuid

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError
from django.test import Client
from rest_framework.test import APIClient

from refundops.models import Payment, PaymentLink

pytestmark = pytest.mark.django_db


def demo(capsys) -> dict:
    call_command("demo_data", "--json")
    return json.loads(capsys.readouterr().out)


def agent(data: dict) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {data['agent']['key']}")
    return client


def post(client, path, body):
    return client.post(path, body, format="json", HTTP_IDEMPOTENCY_KEY=uuid.uuid4().hex)


def test_demo_data_shows_every_path_with_logins_and_a_key(capsys):
    data = demo(capsys)
    paths = {p["path"] for p in data["payments"]}
    assert {"old capture outside the refund window", "disputed", "flagged by fraud", "recent email change",
            "uncaptured authorisation", "order with an amount owed"} <= paths
    fresh = [p for p in data["payments"] if p["path"] == "fresh capture"]
    assert len({p["customer_id"] for p in fresh}) >= 5
    assert {s["role"] for s in data["staff"]} == {"finance approver", "fraud analyst", "auditor", "operator",
                                                  "administrator"}
    for staff in data["staff"]:
        client = Client()
        client.post("/admin/login/", {"username": staff["username"], "password": staff["password"]})
        assert client.get("/admin/").status_code == 200, staff
    assert data["agent"]["key"].startswith("rk_")
    with pytest.raises(CommandError):
        call_command("demo_data")  # only into an empty database


def test_every_demo_path_answers_as_its_name_says(capsys):
    data = demo(capsys)
    client = agent(data)
    by_path = {p["path"]: p["id"] for p in reversed(data["payments"])}

    def refund(path: str, **body):
        return post(client, "/api/v1/refunds", {"transaction_id": by_path[path], "reason": "customer_request",
                                                "amount": 1_000, **body})

    assert refund("fresh capture").status_code == 201
    assert refund("old capture outside the refund window").json()["error"]["code"] == "REFUND_WINDOW_EXPIRED"
    assert "PAYMENT_DISPUTED" in refund("disputed").json()["hold_reasons"]
    assert "PAYMENT_FLAGGED" in refund("flagged by fraud").json()["hold_reasons"]
    assert "RECENT_CONTACT_CHANGE" in refund("recent email change").json()["hold_reasons"]
    assert refund("uncaptured authorisation").json()["error"]["code"] == "PAYMENT_NOT_REFUNDABLE"
    big = refund("fresh capture, above the approval threshold", amount=45_000)
    assert big.status_code == 202 and "APPROVAL_REQUIRED" in big.json()["hold_reasons"]
    voided = post(client, f"/api/v1/payments/{by_path['uncaptured authorisation']}/void", {})
    assert voided.status_code == 200, voided.json()


def test_a_sandbox_payment_link_is_paid_on_the_hosted_page(capsys):
    data = demo(capsys)
    owed = next(p for p in data["payments"] if p["path"] == "order with an amount owed")
    response = post(agent(data), "/api/v1/payment-links",
                    {"transaction_id": owed["id"], "template": data["payment_link_template"], "amount": 2_500})
    assert response.status_code == 201, response.json()
    link = response.json()["payment_link"]
    page = Client()
    path = "/pay/" + link["id"]
    assert link["url"].endswith(path)
    shown = page.get(path)
    assert shown.status_code == 200 and b"25.00 USD" in shown.content and b"Pay 25.00 USD" in shown.content
    paid = page.post(path)
    assert paid.status_code == 200 and b"Paid on" in paid.content
    assert PaymentLink.objects.get(pk=link["id"]).status == "paid"
    assert Payment.objects.get(pk=owed["id"]).amount_owed_minor == 0
    assert page.get("/pay/pl_unknown").status_code == 404
