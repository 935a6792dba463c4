"""Helpers for the admin tests: a small world with a row behind every admin page, the list of
every admin URL (from ``admin.site._registry``, so a newly registered model is covered without
touching the tests), and a headless Chromium from Debian's package."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from django.contrib import admin
from django.contrib.admin.utils import quote
from django.contrib.auth.models import Group, Permission, User
from django.test import RequestFactory
from django.db import connections
from django.urls import reverse
from django.utils import timezone

from approvals.models import ApprovalAuthority
from audit.models import EvidencePack, Verdict
from processors.models import InboundEvent, SandboxControl
from django_otp.plugins.otp_totp.models import TOTPDevice
from playwright.sync_api import Page, expect, sync_playwright

from proposals.models import Proposal
from refundops.callers import Caller
from refundops.models import (
    Dispute,
    DisputeEvidenceDraft,
    GatewayCustomer,
    LedgerDiscrepancy,
    MerchantEndpoint,
    PaymentLink,
    PaymentLinkTemplate,
    PaymentOperation,
    PlatformState,
    PolicyDraft,
    Refund,
    RefundLimits,
    WebhookDelivery,
)
from refundops.services import payouts
from refundops.services.drafts import draft_fields
from refundops.services.reconciliation import raise_discrepancy
from refundops.services.refunds import request_refund
from tests.conftest import make_agent_key, make_limits, make_payment, make_rules

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
SCREENSHOTS = Path(__file__).resolve().parent.parent / "artifacts" / "screenshots"


@dataclass
class World:
    approved: Refund
    held: Refund
    held_big: Refund


def agent_refund(caller: Caller, payment, amount: int, *, key: str | None = None, reason: str = "customer_request"):
    return request_refund(caller=caller, idempotency_key=key or uuid.uuid4().hex,
                          data={"transaction_id": payment.pk, "amount": amount, "reason": reason,
                                "agent": {"session_id": "sess-1", "model": "test-model",
                                          "reasoning": "customer says the parcel never arrived"}})


def populate() -> World:
    """Rows for every admin page: refunds made through the service (approved, held, a replay),
    a dispute with a draft, a void, a payment link, the sandbox ledger. Safe to call twice."""
    for currency in ("USD", "EUR"):
        make_limits(currency, approval_threshold_minor=5_000)
    make_rules()
    Group.objects.get_or_create(name="Finance approvers")
    approver = make_approver(f"approver-{uuid.uuid4().hex[:6]}", currencies=("USD", "EUR"))
    TOTPDevice.objects.create(user=approver, name="authenticator", confirmed=True)
    Proposal.objects.create(kind=Proposal.Kind.HOLD_RULES, summary="hold rules", changes={"hold_flagged": False},
                            diff={"hold_flagged": [True, False]}, proposed_by=approver)
    key, _ = make_agent_key()
    caller = Caller.for_key(key)
    approved_payment = make_payment(amount=8_000)
    approved = agent_refund(caller, approved_payment, 2_500, key="same-key").body["refund"]
    agent_refund(caller, approved_payment, 2_500, key="same-key")  # a replay: deduplicated
    held = agent_refund(caller, make_payment(amount=20_000, fraud_flags=["velocity"]), 9_000).body["refund"]
    held_big = agent_refund(caller, make_payment(amount=90_000, currency="EUR"), 80_000,
                            reason="product_issue").body["refund"]
    PlatformState.current()
    SandboxControl.current()
    limits = RefundLimits.objects.filter(currency="USD").order_by("-version").first()
    PolicyDraft.objects.create(kind="limits", currency="USD", note="a lower threshold", values={
        **{f: getattr(limits, f) for f in draft_fields("limits")}, "approval_threshold_minor": 2_000})

    disputed = make_payment(amount=5_000, dispute_status="open", paid_twice=True)
    verdict = Verdict.objects.create(operation="dispute.draft", outcome="approved", payment_id=disputed.pk,
                                     agent_id=key.agent_id, agent_name=key.agent.name)
    dispute = Dispute.objects.create(payment=disputed, amount_minor=5_000, currency="USD", reason="fraudulent")
    DisputeEvidenceDraft.objects.create(dispute=dispute, summary="Delivered and signed for", verdict=verdict,
                                        drafted_by=key.agent)
    authorised = make_payment(amount=3_000, captured=False)
    PaymentOperation.objects.create(payment=authorised, kind="void", currency="USD", agent=key.agent,
                                    verdict=verdict, status="succeeded", finished_at=timezone.now())
    template = PaymentLinkTemplate.objects.create(name=f"owed-{uuid.uuid4().hex[:6]}",
                                                  message="Please pay $amount for $order_reference: $url")
    PaymentLink.objects.create(template=template, payment=make_payment(amount_owed_minor=1_200), amount_minor=1_200,
                               currency="USD", url="https://pay.example/l/1", verdict=verdict, agent=key.agent)
    caller.record_read("payment.lookup", payment_id=approved_payment.pk)  # an AgentRead row
    payouts.submit_refund(refund_id=approved["id"])  # to the sandbox gateway: a SandboxRefund row
    endpoint = MerchantEndpoint.objects.create(url="https://merchant.example/hooks", event_types=["refund.settled"])
    WebhookDelivery.objects.create(endpoint=endpoint, event_id="evt_demo", event_type="refund.settled",
                                   payload={"id": "evt_demo"}, status=WebhookDelivery.Status.DELIVERED, attempts=1)
    InboundEvent.objects.create(processor="sandbox", event_id=f"evt_{uuid.uuid4().hex[:8]}", type="refund.updated",
                                object_id="sbre_1", verified=False, verification_error="signature does not match")
    GatewayCustomer.objects.create(processor="stripe", reference=f"cus_{uuid.uuid4().hex[:8]}",
                                   customer=approved_payment.customer)
    mismatched = make_payment(amount=6_000)
    raise_discrepancy(payment=mismatched, kind=LedgerDiscrepancy.Kind.PAID_NOT_SETTLED, actor="system:reconciler",
                      gateway_reference=f"sbre_{uuid.uuid4().hex[:8]}",
                      ours={"refund_id": "rf_demo", "amount_minor": 1_000, "currency": "USD", "status": "failed"},
                      theirs={"amount_minor": 1_000, "currency": "USD", "status": "succeeded"},
                      detail="sandbox paid 10.00 USD for rf_demo, which is failed here")
    EvidencePack.objects.create(requested_by="auditor", first_day=timezone.now().date(),
                                last_day=timezone.now().date(), status=EvidencePack.Status.DONE, steps_total=15,
                                steps_done=15, exception_count=0)
    return World(approved=Refund.objects.get(pk=approved["id"]), held=Refund.objects.get(pk=held["id"]),
                 held_big=Refund.objects.get(pk=held_big["id"]))


def make_approver(username: str = "alice", *, limit: int = 50_000, currencies=("USD",)) -> User:
    """A finance approver: sees refunds and verdicts, may approve up to ``limit`` per currency."""
    user = User.objects.create_user(username=username, password="pw-" + username, is_staff=True)
    user.user_permissions.set(Permission.objects.filter(
        codename__in=["view_refund", "view_payment", "view_verdict", "approve_refund", "view_auditentry",
                       "view_approvalauthority"]))
    for currency in currencies:
        ApprovalAuthority.objects.create(user=user, currency=currency, max_amount_minor=limit)
    return User.objects.get(pk=user.pk)  # fresh, so the permission cache is empty


def admin_url(name: str, *ids: str) -> str:
    """An admin URL for prefixed ids: the admin escapes "_" (``txn_22…`` would read as ``txn"…``)."""
    return reverse(name, args=[quote(i) for i in ids])


def admin_pages(user: User) -> list[tuple[str, str, int]]:
    """(what, url, expected status) for every registered model's changelist, add page, and the
    change and history pages of its first row, as ``user`` may see them."""
    request = RequestFactory().get("/admin/")
    request.user = user
    pages = []
    for model, model_admin in admin.site._registry.items():
        opts = model._meta
        name = f"admin:{opts.app_label}_{opts.model_name}"
        if not model_admin.has_view_or_change_permission(request):
            continue
        pages.append((f"{opts.label} list", reverse(f"{name}_changelist"), 200))
        pages.append((f"{opts.label} add", reverse(f"{name}_add"),
                      200 if model_admin.has_add_permission(request) else 403))
        first = model_admin.get_queryset(request).order_by("pk").first()
        assert first is not None, f"tests.browser.populate() makes no {opts.label}: add one so its pages are checked"
        pages.append((f"{opts.label} change", admin_url(f"{name}_change", first.pk), 200))
        pages.append((f"{opts.label} history", admin_url(f"{name}_history", first.pk), 200))
    return pages


def launch(playwright):
    return playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)


@pytest.fixture(autouse=True)
def _orm_beside_playwright(monkeypatch):
    # Playwright's sync API runs an event loop in this thread; the test's own ORM calls are still
    # plain synchronous calls, made between browser steps.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")


@pytest.fixture
def browser():
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        chromium = launch(playwright)
        yield chromium
        chromium.close()
        # ORM calls made while Playwright's loop runs open a connection of their own; close it
        # here, or dropping the test database finds it still in use.
        connections.close_all()


def shot(page: Page, name: str) -> None:
    page.screenshot(path=str(SCREENSHOTS / f"{name}.png"), full_page=True)


def log_in(browser, base: str, username: str, password: str) -> tuple[Page, list[str]]:
    page = browser.new_context(viewport={"width": 1440, "height": 1000}).new_page()
    broken: list[str] = []
    page.on("response", lambda r: broken.append(f"{r.status} {r.url}") if r.status >= 500 or (
        "/static/" in r.url and r.status >= 400) else None)
    page.goto(f"{base}/admin/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("input[type=submit]")
    expect(page.locator("#user-tools")).to_contain_text(username)
    return page, broken
