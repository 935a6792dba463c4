"""The admin in a real headless Chromium: log in as the demo approver, read the dashboard, approve
a held refund by clicking, and open every admin page. A screenshot of each step is kept in
artifacts/screenshots/ (gitignored)."""

from __future__ import annotations

import io
import json
import re
import uuid

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from playwright.sync_api import expect

from approvals.models import ApprovalAuthority
from refundops.callers import Caller
from refundops.models import LedgerDiscrepancy, Payment, Refund, RefundState
from tests.browser import _orm_beside_playwright, admin_pages, admin_url, agent_refund, browser, log_in, populate, shot  # noqa: F401 (fixtures)
from tests.conftest import make_agent_key

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def demo() -> dict:
    out = io.StringIO()
    call_command("demo_data", "--json", stdout=out)
    return json.loads(out.getvalue())


def test_the_demo_approver_reads_the_dashboard_and_approves_a_held_refund_by_clicking(live_server, demo, browser):
    login = next(s for s in demo["staff"] if s["username"] == "approver")
    key, _ = make_agent_key()
    big = Payment.objects.filter(currency="USD", amount_captured_minor=45_000).get()
    held = agent_refund(Caller.for_key(key), big, 30_000, key=uuid.uuid4().hex).body
    assert held["status"] == "held", held
    refund_id = held["refund"]["id"]

    page, broken = log_in(browser, live_server.url, login["username"], login["password"])
    expect(page.locator("#finance-links")).to_contain_text("Finance dashboard")
    # The admin's own stylesheet is served and applied: the header is not unstyled.
    assert page.evaluate("getComputedStyle(document.querySelector('#header')).backgroundColor") != "rgba(0, 0, 0, 0)"
    shot(page, "01-approver-index")

    page.click("text=Finance dashboard")
    expect(page.locator("h1")).to_have_text("Finance dashboard")
    expect(page.locator("#switches")).to_contain_text("Kill switch")
    assert page.locator("svg.chart").count() >= 7
    expect(page.locator("#daily-USD svg title").first).to_contain_text("Refund value per day in USD")
    expect(page.locator("#held-by-rule")).to_contain_text("APPROVAL_REQUIRED")
    shot(page, "02-dashboard")

    page.goto(f"{live_server.url}/admin/refundops/refund/held/")
    row = page.locator(f"tr[data-refund='{refund_id}']")
    expect(row).to_contain_text("300.00 USD")
    expect(row).to_contain_text("The amount is above the amount an agent may refund without a person.")
    expect(row).to_contain_text("within your authority")
    shot(page, "03-held-queue")

    row.locator("input[name=note]").fill("order checked, parcel lost")
    row.get_by_role("button", name=f"Approve {refund_id}").click()
    expect(page.locator(".messagelist")).to_contain_text(f"Approved 1: {refund_id}")
    expect(page.locator(f"tr[data-refund='{refund_id}']")).to_have_count(0)
    shot(page, "04-approved")

    refund = Refund.objects.get(pk=refund_id)
    # The eager worker may have paid it, and on a slow machine the sandbox may have settled it too.
    assert refund.status in (RefundState.APPROVED, RefundState.SUBMITTED, RefundState.SETTLED)
    assert refund.history.filter(history_change_reason="approved by approver: order checked, parcel lost").exists()

    page.goto(live_server.url + admin_url("admin:refundops_refund_change", refund_id))
    expect(page.locator("table.checks-table").first).to_contain_text("approval_threshold")
    expect(page.locator("fieldset", has_text="State history")).to_contain_text("approver")
    shot(page, "05-refund-detail")

    approver = User.objects.get(username=login["username"])
    populate()  # a row behind every page the approver may open (the demo has no proposals, drafts, …)
    for what, url, expected in admin_pages(approver):
        response = page.goto(live_server.url + url)
        assert response.status == expected, (what, url, response.status)
        shot(page, "approver-" + re.sub(r"\W+", "-", what))
    assert broken == []


def test_every_admin_page_renders_in_chromium(live_server, browser):
    populate()
    root = User.objects.create_superuser("root", "root@example.com", "root-pw")
    ApprovalAuthority.objects.create(user=root, currency="USD", max_amount_minor=100_000)  # refunds alone up to it
    page, broken = log_in(browser, live_server.url, "root", "root-pw")
    pages = admin_pages(User.objects.get(username="root"))
    for what, url, expected in pages:
        response = page.goto(live_server.url + url)
        assert response.status == expected, (what, url, response.status)
        if expected == 200:
            expect(page.locator("#content h1, #content h2").first).to_be_visible()
            assert "Server Error" not in page.content()
        shot(page, "root-" + re.sub(r"\W+", "-", what))
    payment = Payment.objects.filter(refunds__isnull=True, status="captured", currency="USD",
                                     dispute_status="none").first()
    page.goto(live_server.url + admin_url("admin:refundops_payment_change", payment.pk))
    page.click("text=Refund this payment")
    page.fill("#id_amount", "12.34")
    page.select_option("#id_reason", "product_issue")
    page.fill("#id_note", "refund asked for by phone")
    shot(page, "root-staff-refund-form")
    page.click("input[type=submit][value='Request refund']")
    expect(page.locator(".messagelist")).to_contain_text("12.34 USD: approved")
    expect(page.locator("h1")).to_have_text("View refund")
    shot(page, "root-staff-refund-made")
    assert Refund.objects.get(payment=payment).origin == Refund.Origin.STAFF

    for name, url, heading in [("dashboard", "/admin/refundops/refund/dashboard/", "Finance dashboard"),
                               ("held-queue", "/admin/refundops/refund/held/", "Held refunds")]:
        page.goto(live_server.url + url)
        expect(page.locator("h1")).to_have_text(heading)
        shot(page, f"root-{name}")

    # Reconciliation: from the dashboard's tile to the open discrepancy, both sides, resolved with a note.
    found = LedgerDiscrepancy.objects.get(status=LedgerDiscrepancy.Status.OPEN)
    page.goto(live_server.url + "/admin/refundops/refund/dashboard/")
    expect(page.locator("#reconciliation-tile .figure")).to_have_text("1")
    page.click("#reconciliation-tile a")
    expect(page.locator("#result_list")).to_contain_text(found.pk)
    expect(page.locator("#result_list")).to_contain_text("failed 10.00 USD (rf_demo)")
    expect(page.locator("#result_list")).to_contain_text("succeeded 10.00 USD")
    shot(page, "root-reconciliation")
    page.click("text=Resolve…")
    expect(page.locator("#both-sides")).to_contain_text("failed 10.00 USD (rf_demo)")
    page.fill("#id_note", "refunded by hand, gateway id noted")
    shot(page, "root-reconciliation-resolve")
    page.click("input[type=submit][value='Resolve']")
    expect(page.locator(".messagelist")).to_contain_text(f"Resolved {found.pk}: refunded by hand")
    found.refresh_from_db()
    assert (found.status, found.resolved_by.username) == ("resolved", "root")
    page.goto(live_server.url + "/admin/refundops/refund/dashboard/")
    expect(page.locator("#reconciliation-tile .figure")).to_have_text("0")
    assert broken == []


def test_finance_writes_a_draft_and_backtests_it_on_its_page(live_server, browser):
    from refundops.models import PolicyDraft
    from tests.conftest import make_limits, make_payment, make_rules

    make_limits(approval_threshold_minor=5_000)
    make_rules()
    caller = Caller.for_key(make_agent_key()[0])
    refunds = [agent_refund(caller, make_payment(amount=10_000), amount).body["refund"] for amount in (3_000, 8_000, 1_000)]
    assert [r["status"] for r in refunds] == ["approved", "held", "approved"]
    User.objects.create_superuser("finance", "finance@example.com", "finance-pw")
    page, broken = log_in(browser, live_server.url, "finance", "finance-pw")

    page.goto(live_server.url + "/admin/refundops/policydraft/add/")
    page.select_option("#id_kind", "limits")
    page.select_option("#id_currency", "USD")
    page.fill("#id_note", "threshold down to 20.00")
    page.fill("#id_changes", '{"approval_threshold_minor": 2000}')
    page.click("input[type=submit][name=_save]")
    draft = PolicyDraft.objects.get()
    assert draft.values["approval_threshold_minor"] == 2_000
    expect(page.locator("#backtest h2")).to_have_text("Backtest")

    page.fill("#backtest-days", "7")
    page.click("text=Run the backtest")
    expect(page.locator(".backtest-summary")).to_contain_text("3 recorded requests since")
    expect(page.locator(".backtest-summary")).to_contain_text("1 would change")
    chart = page.locator("svg.backtest-chart")
    expect(chart).to_be_visible()
    assert chart.locator("rect.bar").count() == 6
    assert chart.locator("rect.bar.draft.held title").text_content() == "draft held: 2"
    shot(page, "finance-draft-backtest")
    row = page.locator(".backtest-changes tbody tr")
    expect(row).to_have_count(1)
    expect(row).to_contain_text("approved")
    expect(row).to_contain_text("held APPROVAL_REQUIRED")
    row.locator("a").click()
    expect(page.locator("h1")).to_contain_text("refund")
    assert refunds[0]["id"] in page.url.replace("_5F", "_")

    # In shadow: a live request the draft would hold is approved all the same, and shows up as a
    # disagreement; then the draft is proposed for a second person.
    page.goto(live_server.url + admin_url("admin:refundops_policydraft_change", draft.pk))
    page.click("input[type=submit][value='Run in shadow']")
    expect(page.locator(".messagelist")).to_contain_text("runs in shadow")
    live = agent_refund(caller, make_payment(amount=10_000), 3_000).body["refund"]
    assert live["status"] == "approved"
    page.click("text=Where the shadow and the active version disagreed")
    expect(page.locator(".shadow-summary")).to_contain_text("disagreed with the active version on 1")
    expect(page.locator(".shadow-disagreements tbody tr")).to_contain_text("held APPROVAL_REQUIRED")
    shot(page, "finance-draft-disagreements")
    page.goto(live_server.url + admin_url("admin:refundops_policydraft_change", draft.pk))
    page.click("input[type=submit][value='Promote (propose)']")
    expect(page.locator("#decision h2")).to_have_text("Waiting for a second person")
    draft.refresh_from_db()
    assert (draft.status, draft.shadow) == ("proposed", True)
    assert broken == []
