"""Each role in a real Chromium, page by page: what it may see and do is written down here, not
read from the admin's own permission methods, so a wrong grant (or a missing refusal) fails.

For every registered admin page: the list answers 200 when the role may see the model and 403
when not; a row's page shows a Save button only where the role may change it; the add page
answers only where it may add (an addition to a control becomes a proposal). The auditor sees
every model, also ones added later, and changes nothing."""

from __future__ import annotations

import csv
import io
import re
from pathlib import Path

import pytest
from django.contrib import admin
from django.contrib.auth.models import User
from django.core.management import call_command
from django.urls import reverse
from playwright.sync_api import expect

from proposals.models import Proposal
from refundops.models import HoldRules, PlatformState
from tests.browser import (  # noqa: F401 (fixtures)
    _orm_beside_playwright,
    admin_url,
    browser,
    log_in,
    populate,
    shot,
)

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

MONEY_READ = {"refundops.Payment": "view", "refundops.Customer": "view", "refundops.Refund": "view",
              "refundops.Dispute": "view", "audit.Verdict": "view", "audit.AuditEntry": "view",
              "proposals.Proposal": "view"}

# role -> {model label: what it may do there}. Any model not named: 403.
MAY = {
    "finance approver": {
        **MONEY_READ, "refundops.DisputeEvidenceDraft": "view", "refundops.PaymentOperation": "view",
        "refundops.PaymentLink": "view", "refundops.PaymentLinkTemplate": "view add change",
        "refundops.RefundLimits": "view add change", "refundops.HoldRules": "view",
        "refundops.PolicyDraft": "view add change", "approvals.ApprovalAuthority": "view",
        "refundops.Merchant": "view change", "refundops.LedgerDiscrepancy": "view"},
    "fraud analyst": {**MONEY_READ, "refundops.HoldRules": "view add change", "refundops.RefundLimits": "view",
                      "refundops.PolicyDraft": "view add change"},
    "operator": {
        "refundops.Agent": "view change", "refundops.AgentKey": "view", "refundops.PlatformState": "view",
        "refundops.IdempotencyRecord": "view", "refundops.WebhookDelivery": "view",
        "refundops.GatewayCustomer": "view", "processors.SandboxControl": "view change",
        "processors.SandboxCharge": "view", "processors.SandboxRefund": "view", "processors.InboundEvent": "view",
        "audit.AuditEntry": "view", "proposals.Proposal": "view"},
    "administrator": {
        "auth.User": "view add change", "auth.Group": "view", "approvals.ApprovalAuthority": "view add change",
        "refundops.MerchantEndpoint": "view add change", "refundops.WebhookDelivery": "view",
        "refundops.Agent": "view", "refundops.AgentKey": "view", "audit.AuditEntry": "view",
        "proposals.Proposal": "view"},
    "auditor": {model._meta.label: "view" for model in admin.site._registry},
}


def _first_row(model):
    return model._default_manager.order_by("pk").first()


def _check_pages(page, base: str, role: str) -> list[str]:
    wrong = []
    may = MAY[role]
    for model in admin.site._registry:
        label, opts = model._meta.label, model._meta
        name = f"admin:{opts.app_label}_{opts.model_name}"
        ops = may.get(label, "").split()
        response = page.goto(base + reverse(f"{name}_changelist"))
        if response.status != (200 if "view" in ops else 403):
            wrong.append(f"{label} list: {response.status}")
            continue
        if "view" not in ops:
            continue
        row = _first_row(model)
        assert row is not None, f"populate() makes no {label}"
        page.goto(base + admin_url(f"{name}_change", row.pk))
        can_save = page.locator("input[name=_save]").count() > 0
        if can_save != ("change" in ops):
            wrong.append(f"{label} change page: save button {'shown' if can_save else 'missing'}")
        response = page.goto(base + reverse(f"{name}_add"))
        if "add" in ops and response.status != 200:
            wrong.append(f"{label} add: {response.status}")
        if "add" not in ops and response.status != 403:
            wrong.append(f"{label} add: {response.status}")
    shot(page, f"role-{role.replace(' ', '-')}-last-page")
    return wrong


@pytest.mark.parametrize("role", list(MAY))
def test_each_role_sees_and_may_change_exactly_its_own_pages(live_server, browser, role):
    populate()
    user = User.objects.create_user(f"as-{role.replace(' ', '-')}", password="pw-role")
    call_command("grant_role", user.username, role, stdout=open("/dev/null", "w"))
    page, broken = log_in(browser, live_server.url, user.username, "pw-role")
    listed = page.eval_on_selector_all(
        "#content-main div[class*=app-] tr[class*=model-]",
        "rows => rows.map(r => r.closest('div').className.match(/app-(\\w+)/)[1] + '.' + "
        "r.className.match(/model-(\\w+)/)[1])")
    assert sorted(listed) == sorted(label.split(".")[0] + "." + label.split(".")[1].lower() for label in MAY[role])
    shot(page, f"role-{role.replace(' ', '-')}-index")
    assert _check_pages(page, live_server.url, role) == []
    assert broken == []


def test_the_auditor_is_offered_no_action_that_changes_anything(live_server, browser):
    world = populate()
    User.objects.create_user("audra", password="pw-role")
    call_command("grant_role", "audra", "auditor", stdout=open("/dev/null", "w"))
    page, _ = log_in(browser, live_server.url, "audra", "pw-role")
    for url in ("/admin/refundops/refund/", "/admin/refundops/platformstate/", "/admin/refundops/agentkey/",
                "/admin/refundops/webhookdelivery/", "/admin/auth/user/"):
        page.goto(live_server.url + url)
        assert page.locator("select[name=action]").count() == 0, url
    page.goto(live_server.url + admin_url("admin:refundops_refund_change", world.held.pk))
    assert page.get_by_role("button", name=re.compile("Approve|Reject")).count() == 0
    shot(page, "role-auditor-held-refund")


def test_one_fraud_analyst_proposes_hold_rules_and_another_approves_them_by_clicking(live_server, browser):
    populate()
    for name in ("fran", "fred"):
        User.objects.create_user(name, password="pw-role")
        call_command("grant_role", name, "fraud analyst", stdout=open("/dev/null", "w"))
    current = HoldRules.objects.order_by("-version").first()

    page, _ = log_in(browser, live_server.url, "fran", "pw-role")
    page.goto(live_server.url + admin_url("admin:refundops_holdrules_change", current.pk))
    page.uncheck("#id_hold_customer_velocity")
    page.fill("#id_note", "velocity holds too noisy this week")
    page.click("input[name=_save]")
    expect(page.locator(".messagelist")).to_contain_text("takes effect when someone else with the right approves it")
    expect(page.locator("table.diff")).to_contain_text("hold_customer_velocity")
    expect(page.locator("#decision")).to_contain_text("You proposed this")
    assert page.get_by_role("button", name="Approve").count() == 0
    shot(page, "proposal-01-proposed")
    assert HoldRules.objects.order_by("-version").first().pk == current.pk

    page, _ = log_in(browser, live_server.url, "fred", "pw-role")
    page.goto(live_server.url + reverse("admin:proposals_proposal_changelist") + "?status__exact=pending")
    page.click(f"a:text-is('{Proposal.objects.get(proposed_by__username='fran').pk}')")
    page.fill("#decision-note", "agreed for one week")
    page.get_by_role("button", name="Approve").click()
    expect(page.locator(".messagelist")).to_contain_text("now in effect")
    shot(page, "proposal-02-approved")
    latest = HoldRules.objects.order_by("-version").first()
    assert (latest.version, latest.hold_customer_velocity, latest.created_by) == (
        current.version + 1, False, "fran, approved by fred")


def test_an_operator_turns_the_kill_switch_on_alone(live_server, browser):
    populate()
    User.objects.create_user("ola", password="pw-role")
    call_command("grant_role", "ola", "operator", stdout=open("/dev/null", "w"))
    page, _ = log_in(browser, live_server.url, "ola", "pw-role")
    page.goto(live_server.url + reverse("admin:refundops_platformstate_changelist"))
    page.check("input[name=_selected_action]")
    page.select_option("select[name=action]", "killswitch_on")
    page.click("button[name=index]")
    expect(page.locator(".messagelist")).to_contain_text("kill switch ON")
    shot(page, "operator-kill-switch-on")
    assert PlatformState.current().refunds_paused


def test_the_auditor_exports_the_held_refunds_as_filtered_on_screen(live_server, browser):
    world = populate()
    User.objects.create_user("audra", password="pw-role")
    call_command("grant_role", "audra", "auditor", stdout=open("/dev/null", "w"))
    page, broken = log_in(browser, live_server.url, "audra", "pw-role")
    page.goto(live_server.url + reverse("admin:refundops_refund_changelist"))
    page.locator("#changelist-filter a:text-is('Held for approval')").first.click()
    expect(page).to_have_url(re.compile(r"status__exact=held"))
    shot(page, "role-auditor-held-refunds-list")
    with page.expect_download() as download:
        page.click("a.export-csv")
    rows = list(csv.DictReader(io.StringIO(Path(download.value.path()).read_text())))
    assert download.value.suggested_filename.startswith("refundops-refund-")
    assert sorted(row["id"] for row in rows) == sorted([world.held.pk, world.held_big.pk])
    assert {row["status"] for row in rows} == {"held"}
    assert broken == []


# The pages beyond each model's list, add and change pages: role -> what it may open (200; else 403).
# "decide" is the Approve button on a held refund's page; exports are CSV downloads of a list.
OWN_PAGES = {
    "finance approver": {"held queue", "dashboard", "refund by hand", "order amount", "capture", "proposals",
                         "decide", "export refunds", "export verdicts", "export audit log"},
    "fraud analyst": {"held queue", "dashboard", "proposals", "export refunds", "export verdicts",
                      "export audit log"},
    "auditor": {"held queue", "dashboard", "proposals", "export refunds", "export verdicts", "export audit log",
                "export agent keys", "export users"},
    "operator": {"proposals", "export audit log", "export agent keys"},
    "administrator": {"proposals", "export audit log", "export agent keys", "export users"},
}


@pytest.mark.parametrize("role", list(OWN_PAGES))
def test_each_role_opens_exactly_its_own_custom_pages_and_exports(live_server, browser, role):
    world = populate()
    payment = world.held.payment
    username = f"own-{role.replace(' ', '-')}"
    User.objects.create_user(username, password="pw-role")
    call_command("grant_role", username, role, stdout=open("/dev/null", "w"))
    page, broken = log_in(browser, live_server.url, username, "pw-role")
    pages = {
        "held queue": reverse("admin:refundops_refund_held"),
        "dashboard": reverse("admin:refundops_dashboard"),
        "refund by hand": admin_url("admin:refundops_payment_refund", payment.pk),
        "order amount": admin_url("admin:refundops_payment_order_amount", payment.pk),
        "capture": admin_url("admin:refundops_payment_capture", payment.pk),
        "proposals": reverse("admin:proposals_proposal_changelist"),
    }
    exports = {
        "export refunds": reverse("admin:refundops_refund_export_csv") + "?status__exact=held",
        "export verdicts": reverse("admin:audit_verdict_export_csv"),
        "export audit log": reverse("admin:audit_auditentry_export_csv"),
        "export agent keys": reverse("admin:refundops_agentkey_export_csv"),
        "export users": reverse("admin:auth_user_export_csv"),
    }
    opened = set()
    for what, url in pages.items():
        status = page.goto(live_server.url + url).status
        assert status in (200, 403), (what, status)
        opened |= {what} if status == 200 else set()
    for what, url in exports.items():
        answer = page.request.get(live_server.url + url)
        assert answer.status in (200, 403), (what, answer.status)
        if answer.status == 200:
            assert answer.headers["content-type"].startswith("text/csv"), what
            opened.add(what)
    if "view" in MAY[role].get("refundops.Refund", ""):
        page.goto(live_server.url + admin_url("admin:refundops_refund_change", world.held.pk))
        opened |= {"decide"} if page.get_by_role("button", name="Approve").count() else set()
    shot(page, f"role-{role.replace(' ', '-')}-own-pages")
    assert opened == OWN_PAGES[role]
    assert broken == []
