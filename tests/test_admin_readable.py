"""Finance's pages say things a person reads: hold reasons as sentences (from one place), money as
money, a passing check saying what passed, the refund list showing refunds (denied requests behind
their own filter), and no heading, link or label that leads nowhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from django.contrib.auth.models import User
from django.core.management import call_command
from django.urls import reverse

from audit.models import Verdict
from refundops import holds, policy
from refundops.callers import Caller
from refundops.models import Refund, RefundState
from refundops.services import payouts
from tests.browser import admin_url, agent_refund
from tests.conftest import make_agent_key, make_limits, make_payment, make_rules

pytestmark = pytest.mark.django_db


@pytest.fixture
def auditor(client):
    user = User.objects.create_user("audra", password="pw")
    call_command("grant_role", "audra", "auditor", stdout=open("/dev/null", "w"))
    client.force_login(user)
    return user


@pytest.fixture
def refunds():
    make_limits("USD", approval_threshold_minor=20_000)
    make_rules()
    caller = Caller.for_key(make_agent_key()[0])
    small = agent_refund(caller, make_payment(amount=5_000), 1_000).body["refund"]
    held = agent_refund(caller, make_payment(amount=50_000, fraud_flags=["velocity"]), 30_000).body["refund"]
    denied = agent_refund(caller, make_payment(amount=5_000), 99_999_999).body
    return {"small": Refund.objects.get(pk=small["id"]), "held": Refund.objects.get(pk=held["id"]),
            "denied": Refund.objects.get(verdict_id=denied["error"]["verdict_id"])}


def test_every_hold_code_the_policy_gives_has_a_sentence():
    source = Path(policy.__file__).read_text()
    codes = set(re.findall(r'rule\(\s*"\w+",\s*"([A-Z_]+)"', source)) | set(re.findall(r'"(LEDGER_MISMATCH)"', source))
    assert "APPROVAL_REQUIRED" in codes and "CUSTOMER_VELOCITY" in codes
    assert {code: holds.HOLD_REASONS.get(code) for code in codes if not holds.HOLD_REASONS.get(code)} == {}
    assert all(sentence.endswith(".") and sentence[0].isupper() for sentence in holds.HOLD_REASONS.values())
    assert holds.hold_reason_sentences(["SOMETHING_NEW"]) == ["SOMETHING_NEW"]  # unknown: the code itself


def test_a_passing_check_says_what_passed_and_a_hold_says_why(refunds):
    small = {c["name"]: c for c in refunds["small"].verdict.checks}
    assert small["approval_threshold"]["result"] == "pass"
    assert small["approval_threshold"]["message"] == "10.00 USD is within the 200.00 USD an agent may refund alone."
    assert "above" not in small["approval_threshold_cumulative"].get("message", "")
    held = {c["name"]: c for c in refunds["held"].verdict.checks}
    assert held["approval_threshold"]["message"] == "300.00 USD is above the 200.00 USD an agent may refund alone."


def test_the_refund_list_shows_refunds_with_readable_hold_reasons_and_denied_requests_behind_a_filter(
        client, auditor, refunds):
    page = client.get(reverse("admin:refundops_refund_changelist")).content.decode()
    assert refunds["held"].pk in page and refunds["small"].pk in page
    assert refunds["denied"].pk not in page
    assert '["APPRO' not in page and "[&quot;" not in page
    assert holds.HOLD_REASONS["PAYMENT_FLAGGED"] in page
    denied = client.get(reverse("admin:refundops_refund_changelist") + "?status__exact=denied").content.decode()
    assert refunds["denied"].pk in denied and refunds["held"].pk not in denied
    every = client.get(reverse("admin:refundops_refund_changelist") + "?status__exact=all").content.decode()
    assert refunds["denied"].pk in every and refunds["held"].pk in every
    counted = client.get(reverse("admin:refundops_refund_changelist") + "?_facets=True").content.decode()
    assert "Denied by a check (1)" in counted and "Held for approval (1)" in counted


def test_the_verdict_shows_money_as_money_and_inputs_readably(client, auditor, refunds):
    page = client.get(admin_url("admin:audit_verdict_change", refunds["held"].verdict_id)).content.decode()
    checks = page[page.index('class="checks-table"'):]
    assert "minor units" not in page
    assert "300.00 USD" in checks and "200.00 USD" in checks and ">30000<" not in checks
    assert "{&quot;" not in checks and '{"' not in checks  # inputs are not JSON
    assert "agent_day_minor" not in page
    held_because = page[page.index('<ul class="hold-reasons">'):]
    assert held_because.startswith('<ul class="hold-reasons"><li>300.00 USD is above the 200.00 USD an agent may '
                                   'refund alone. <small>(APPROVAL_REQUIRED)</small></li>')


def test_a_settled_refund_does_not_say_submit_attempts_0(client, auditor, refunds):
    payouts.submit_refund(refund_id=refunds["small"].pk)
    refund = Refund.objects.get(pk=refunds["small"].pk)
    assert refund.status in (RefundState.SUBMITTED, RefundState.SETTLED)
    page = client.get(admin_url("admin:refundops_refund_change", refund.pk)).content.decode()
    assert "Submit attempts" not in page
    assert re.search(r"Sent again by a person:.*?never", page, re.S)


def test_no_raw_app_heading_no_view_site_link_to_nowhere_and_a_favicon(client, auditor):
    page = client.get(reverse("admin:index")).content.decode()
    assert "OTP_TOTP" not in page and "Otp_Totp" not in page
    link = re.search(r'href="([^"]+)">View site<', page)
    assert link is None or client.get(link.group(1)).status_code == 200
    icon = re.search(r'<link rel="icon"[^>]*href="([^"]+)"', page)
    assert icon, "no favicon link"
