"""Every admin page each demo role can reach, in Chromium at 1366 × 768 (a common laptop): the
page never scrolls sideways (a wide table may scroll inside its own box, but every button, form
control and action link stays on screen), and money is shown as money, never as an integer of
minor units. Screenshots of finance's main pages at 1366 and 1920 go to artifacts/screenshots/."""

from __future__ import annotations

import io
import json
import re

import pytest
from django.contrib import admin
from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import RequestFactory
from django.urls import reverse
from simple_history.admin import SimpleHistoryAdmin

from refundops.callers import Caller
from refundops.models import Payment, Refund
from tests.browser import _orm_beside_playwright, admin_url, agent_refund, browser, populate, shot  # noqa: F401
from tests.conftest import make_agent_key

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]

LAPTOP = {"width": 1366, "height": 768}
DEMO_ROLES = ["approver", "fraud", "auditor", "operator", "admin"]

# What a page shows that is off screen or clipped: the page's own width, and each control (buttons,
# inputs, the action menu, object tools, links in a row that act on it) that lies beyond the window
# or beyond the box it scrolls in. Also visible text naming minor units ("amount_minor", "Amount
# minor: 5000"), leaving out the labels and help of inputs (a form may take minor units).
MEASURE = """() => {
  const off = [];
  const clipped = (el, r) => {
    for (let a = el.parentElement; a; a = a.parentElement) {
      if (getComputedStyle(a).overflowX === 'visible') continue;
      const b = a.getBoundingClientRect();
      if (r.left < b.left - 1 || r.right > b.right + 1) return true;
    }
    return false;
  };
  const controls = '#content button, #content input:not([type=hidden]), #content select, #content textarea, '
    + '#content .object-tools a, #content td a.action, #content a.button';
  for (const el of document.querySelectorAll(controls)) {
    const r = el.getBoundingClientRect();
    if (!r.width || el.closest('.collapsed, details:not([open])')) continue;
    if (r.right > innerWidth + 1 || r.left < 0 || clipped(el, r))
      off.push((el.getAttribute('aria-label') || el.value || el.textContent || el.name || el.tagName).trim().slice(0, 40));
  }
  const copy = document.querySelector('#content').cloneNode(true);
  copy.querySelectorAll('label[for], [id$=_helptext], input, select, textarea, pre, script, style').forEach(n => n.remove());
  const minor = (copy.textContent.match(/.{0,30}(_minor\\b|\\bminor units\\b|\\bminor\\s*:).{0,20}/gi) || []);
  return {page: document.scrollingElement.scrollWidth, width: innerWidth, off, minor};
}"""


@pytest.fixture
def demo() -> dict:
    """The demo's staff, payments and held refunds, and a request a check denied."""
    out = io.StringIO()
    call_command("demo_data", "--json", stdout=out)
    caller = Caller.for_key(make_agent_key()[0])
    big = Payment.objects.filter(currency="USD", amount_captured_minor=45_000).get()
    agent_refund(caller, big, 99_999_999)  # denied by a check: the refund list leaves it out by default
    return json.loads(out.getvalue())


def reachable_pages(user: User, *, everything: bool) -> list[tuple[str, str]]:
    """(what, url) of the pages ``user`` reaches: the index, each list with the change page of its
    newest row, one history page, and finance's own pages where the user may view refunds.

    ``everything=False`` keeps only the pages that look different for this user than for the
    auditor (who views every model and acts on none): lists where the user has actions or may add,
    change pages the user may change, the held queue. The auditor's visit covers the others."""
    request = RequestFactory().get("/admin/")
    request.user = user
    pages = [("index", reverse("admin:index"))]
    history = None
    for model, model_admin in admin.site._registry.items():
        if not model_admin.has_view_or_change_permission(request):
            continue
        name = f"admin:{model._meta.app_label}_{model._meta.model_name}"
        acts = bool(model_admin.get_actions(request)) or model_admin.has_add_permission(request)
        if everything or acts:
            pages.append((f"{model._meta.label} list", reverse(f"{name}_changelist")))
        row = model_admin.get_queryset(request).order_by("-pk").first()
        if row is not None and (everything or model_admin.has_change_permission(request, row)):
            pages.append((f"{model._meta.label} change", admin_url(f"{name}_change", row.pk)))
        if row is not None and history is None and everything and isinstance(model_admin, SimpleHistoryAdmin):
            history = (f"{model._meta.label} history", admin_url(f"{name}_history", row.pk))
    if user.has_perm("refundops.view_refund"):
        pages.append(("held queue", reverse("admin:refundops_refund_held")))
        if everything:
            pages.append(("dashboard", reverse("admin:refundops_dashboard")))
    return pages + ([history] if history else [])


def log_in_at(browser, base: str, username: str, password: str, viewport=LAPTOP):
    page = browser.new_context(viewport=viewport).new_page()
    page.goto(f"{base}/admin/login/")
    page.fill("#id_username", username)
    page.fill("#id_password", password)
    page.click("input[type=submit]")
    page.wait_for_selector("#user-tools")
    return page


def test_every_page_each_role_reaches_fits_1366_pixels_and_shows_money_as_money(live_server, browser, demo):
    populate()  # a row behind every page (proposals, drafts, discrepancies, deliveries, …)
    wrong = []
    for username in DEMO_ROLES:
        login = next(s for s in demo["staff"] if s["username"] == username)
        page = log_in_at(browser, live_server.url, username, login["password"])
        pages = reachable_pages(User.objects.get(username=username), everything=username == "auditor")
        assert len(pages) >= 3, username
        for what, url in pages:
            response = page.goto(live_server.url + url, wait_until="domcontentloaded")
            assert response.status == 200, (username, what, url, response.status)
            seen = page.evaluate(MEASURE)
            if seen["page"] > seen["width"]:
                wrong.append(f"{username}: {what}: the page is {seen['page']} px wide")
            if seen["off"]:
                wrong.append(f"{username}: {what}: off screen: {seen['off'][:5]}")
            if seen["minor"]:
                wrong.append(f"{username}: {what}: minor units: {seen['minor'][:3]}")
        page.context.close()
    assert wrong == []


def test_finance_pages_at_1366_and_1920(live_server, browser, demo):
    """The held queue: Approve and Reject on screen, "waiting" on two lines at most, each hold reason
    in a sentence. Screenshots of the held queue, the refund list, a verdict and the dashboard."""
    login = next(s for s in demo["staff"] if s["username"] == "approver")
    held_id = demo["held_refunds"][0]["refund_id"]
    for width, height in ((1366, 768), (1920, 1080)):
        page = log_in_at(browser, live_server.url, "approver", login["password"], {"width": width, "height": height})
        page.goto(live_server.url + reverse("admin:refundops_refund_held"))
        row = page.locator(f"tr[data-refund='{held_id}']")
        for button in ("Approve", "Reject"):
            box = row.get_by_role("button", name=f"{button} {held_id}").bounding_box()
            assert box["x"] + box["width"] <= width, (button, box)
        waiting = row.locator("td.waiting")
        line = float(waiting.evaluate("td => parseFloat(getComputedStyle(td).lineHeight) || 16"))
        assert waiting.locator("span").first.bounding_box()["height"] <= 2 * line + 2
        assert "above the amount an agent may refund without a person" in row.inner_text()
        shot(page, f"w{width}-held-queue")
        for name in ("refund", "payment"):  # every column in sight, none behind the table's scroll bar
            page.goto(live_server.url + reverse(f"admin:refundops_{name}_changelist"))
            shot(page, f"w{width}-{name}-list")
            fits = page.evaluate("() => { const t = document.querySelector('#result_list');"
                                 " return [t.getBoundingClientRect().width, t.parentElement.clientWidth]; }")
            assert fits[0] <= fits[1], (name, width, fits)
        page.goto(live_server.url + admin_url("admin:audit_verdict_change", Refund.objects.get(pk=held_id).verdict_id))
        shot(page, f"w{width}-verdict")
        edges = page.evaluate("() => { const t = document.querySelector('table.checks-table');"
                              " return [t.getBoundingClientRect().right, t.closest('.form-row').getBoundingClientRect().right]; }")
        assert edges[0] <= edges[1], ("the verdict's checks are clipped", width, edges)
        page.goto(live_server.url + reverse("admin:refundops_dashboard"))
        shot(page, f"w{width}-dashboard")
        icon = page.locator("link[rel=icon]").get_attribute("href")
        assert page.request.get(live_server.url + icon if icon.startswith("/") else icon).status == 200
        page.context.close()
