"""Every admin page answers, and the admin changes nothing except through the services."""

from __future__ import annotations

import re

import pytest
from django.contrib import admin
from django.contrib.auth.models import User
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.urls import reverse

from approvals.models import ApprovalAuthority
from approvals.services import approve_refund, reject_refund
from audit.models import AuditEntry, Verdict
from processors.models import SandboxControl
from refundops.models import AgentKey, Payment, PlatformState, Refund, RefundState
from tests.browser import admin_pages, admin_url, make_approver, populate

pytestmark = pytest.mark.django_db


@pytest.fixture
def world(db):
    return populate()


@pytest.fixture
def root(client):
    user = User.objects.create_superuser("root", "root@example.com", "pw")
    ApprovalAuthority.objects.create(user=user, currency="USD", max_amount_minor=100_000)  # refunds alone up to it
    client.force_login(user)
    return user


def messages_of(response) -> list[str]:
    return [str(m) for m in response.context["messages"]] if response.context else []


def test_every_admin_page_answers_for_a_superuser(client, world, root):
    pages = admin_pages(root)
    assert len(pages) >= 4 * len(admin.site._registry) - 4  # auth's User may be the only user row
    failures = [(what, url, client.get(url).status_code, expected) for what, url, expected in pages]
    assert [f for f in failures if f[2] != f[3]] == []
    for name in ("admin:index", "admin:refundops_dashboard", "admin:refundops_refund_held"):
        assert client.get(reverse(name)).status_code == 200


def test_an_approver_sees_only_what_their_permissions_allow_and_every_such_page_answers(client, world):
    approver = make_approver()
    client.force_login(approver)
    pages = admin_pages(approver)
    seen = {what.split()[0] for what, _, _ in pages}
    assert seen == {"refundops.Refund", "refundops.Payment", "audit.Verdict", "audit.AuditEntry",
                    "approvals.ApprovalAuthority"}
    assert [(what, client.get(url).status_code) for what, url, expected in pages
            if client.get(url).status_code != expected] == []
    assert client.get(reverse("admin:refundops_agentkey_changelist")).status_code == 403


def _changelist_queries(client, model) -> int:
    url = reverse(f"admin:{model._meta.app_label}_{model._meta.model_name}_changelist")
    with CaptureQueriesContext(connection) as queries:
        assert client.get(url).status_code == 200
    return len(queries)


def test_changelists_run_the_same_number_of_queries_however_many_rows(client, root):
    populate()
    before = {model: _changelist_queries(client, model) for model in admin.site._registry}
    populate()
    populate()
    after = {model: _changelist_queries(client, model) for model in admin.site._registry}
    grew = {model._meta.label: (before[model], after[model]) for model in before if after[model] > before[model]}
    assert grew == {}


def test_the_audit_log_cannot_be_added_changed_or_deleted_even_by_a_superuser(client, world, root):
    entry = AuditEntry.objects.order_by("id").first()
    change = admin_url("admin:audit_auditentry_change", entry.pk)
    page = client.get(change)
    assert page.status_code == 200 and b'name="_save"' not in page.content
    assert client.post(change, {"actor": "forged"}).status_code == 403
    assert client.get(reverse("admin:audit_auditentry_add")).status_code == 403
    assert client.post(admin_url("admin:audit_auditentry_delete", entry.pk)).status_code == 403
    listing = client.get(reverse("admin:audit_auditentry_changelist"))
    assert b"delete_selected" not in listing.content
    entry.refresh_from_db()
    assert entry.actor != "forged"


def test_a_refunds_state_cannot_be_edited_or_reverted_from_its_history(client, world, root):
    refund = world.held
    change = admin_url("admin:refundops_refund_change", refund.pk)
    assert client.post(change, {"status": "approved"}).status_code == 403
    version = refund.history.order_by("history_id").first()
    # simple_history's own links carry the raw id (its view does not unquote), so this one does too.
    revert = reverse("admin:refundops_refund_simple_history", args=[refund.pk, version.history_id])
    assert client.get(revert).status_code == 200
    assert client.post(revert, {"status": "approved"}).status_code == 403
    refund.refresh_from_db()
    assert refund.status == RefundState.HELD


def test_refund_page_shows_the_verdicts_checks_as_a_table_and_the_history_with_reasons(client, world, root):
    page = client.get(admin_url("admin:refundops_refund_change", world.held.pk)).content.decode()
    assert '<table class="checks-table">' in page
    assert "approval_threshold" in page and "payment_flagged" in page
    assert f"verdict {world.held.verdict_id}: held" in page  # the change reason in the state history
    assert "90.00 USD" in page and 'action="/admin/refundops/refund/' in page  # approve form for a held one


def test_approve_action_approves_within_authority_and_explains_a_refusal(client, world, django_capture_on_commit_callbacks):
    approver = make_approver(limit=10_000)  # USD only: the EUR refund is outside their authority
    client.force_login(approver)
    url = reverse("admin:refundops_refund_changelist")
    with django_capture_on_commit_callbacks(execute=False) as callbacks:
        response = client.post(url, {"action": "approve_selected", "_selected_action": [world.held.pk, world.held_big.pk]},
                               follow=True)
    notes = messages_of(response)
    assert any("Approved 1" in n and world.held.pk in n for n in notes)
    assert any(world.held_big.pk in n and "no refund authority in EUR" in n for n in notes)
    world.held.refresh_from_db()
    world.held_big.refresh_from_db()
    assert (world.held.status, world.held_big.status) == (RefundState.APPROVED, RefundState.HELD)
    assert len(callbacks) == 1  # the approved one is handed to the worker on commit
    assert AuditEntry.objects.filter(action="refund.approved", subject_id=world.held.pk,
                                     actor=f"user:{approver.username}").exists()


def test_reject_from_the_held_queue_records_the_note_and_returns_to_the_queue(client, world):
    client.force_login(make_approver())
    queue = reverse("admin:refundops_refund_held")
    response = client.post(admin_url("admin:refundops_refund_reject", world.held.pk),
                           {"note": "customer already reimbursed", "next": queue})
    assert response.status_code == 302 and response.url == queue
    world.held.refresh_from_db()
    assert world.held.status == RefundState.REJECTED
    assert world.held.history.latest().history_change_reason == "rejected by alice: customer already reimbursed"


def test_a_user_without_the_approve_permission_cannot_decide(client, world):
    viewer = User.objects.create_user("viewer", password="pw", is_staff=True)
    viewer.user_permissions.add(*make_approver("tmp").user_permissions.exclude(codename="approve_refund"))
    client.force_login(viewer)
    assert client.post(admin_url("admin:refundops_refund_approve", world.held.pk)).status_code == 403
    listing = client.get(reverse("admin:refundops_refund_changelist")).content
    assert b"approve_selected" not in listing


def test_the_held_queue_lists_waiting_refunds_oldest_first_with_reasons_and_authority(client, world):
    client.force_login(make_approver(limit=10_000))
    page = client.get(reverse("admin:refundops_refund_held")).content.decode()
    assert page.index(world.held.pk) < page.index(world.held_big.pk)  # created first, listed first
    assert "<li>The amount is above the amount an agent may refund without a person.</li>" \
           "<li>The payment is flagged by fraud screening.</li>" in page  # refundops.holds, in the verdict's order
    assert "within your authority" in page and "no authority in EUR" in page
    assert world.approved.pk not in page


def test_staff_refund_from_the_payment_page_goes_through_the_policy_and_a_double_submit_pays_once(client, root):
    populate()
    payment = Payment.objects.filter(refunds__isnull=True, status="captured", currency="USD",
                                     dispute_status="none").first()
    url = admin_url("admin:refundops_payment_refund", payment.pk)
    page = client.get(url)
    key = re.search(r'name="idempotency_key" value="(\w+)"', page.content.decode()).group(1)
    form = {"amount": "12.34", "reason": "product_issue", "note": "damaged in transit", "idempotency_key": key}
    first = client.post(url, form)
    again = client.post(url, form)
    refund = Refund.objects.get(payment=payment)
    assert first.url == again.url == admin_url("admin:refundops_refund_change", refund.pk)
    assert (refund.amount_minor, refund.origin, refund.requested_by, refund.status) == (
        1_234, Refund.Origin.STAFF, root, RefundState.APPROVED)
    assert Verdict.objects.filter(refund_id=refund.pk, staff_username="root").exists()
    assert Verdict.objects.filter(deduplicated=True, staff_username="root").count() == 1


@pytest.mark.parametrize("amount,error", [
    ("12.345", "2 decimal places"), ("-1", "more than zero"), ("x", "such as"),
    # Decimal reads these; none is money (each once answered 500).
    ("Infinity", "such as"), ("-inf", "such as"), ("NaN", "such as"), ("sNaN", "such as"),
    ("1e999999999", "at most"), ("1e-999999999", "2 decimal places")])
def test_staff_refund_form_refuses_amounts_that_are_not_money(client, root, amount, error):
    populate()
    payment = Payment.objects.filter(refunds__isnull=True, status="captured").first()
    response = client.post(admin_url("admin:refundops_payment_refund", payment.pk),
                           {"amount": amount, "reason": "duplicate", "idempotency_key": "k1"})
    assert response.status_code == 200 and error in response.content.decode()
    assert not Refund.objects.filter(payment=payment).exists()


def test_a_refused_staff_refund_is_explained_and_the_form_gets_a_new_key(client, root):
    populate()
    payment = Payment.objects.filter(refunds__isnull=True, status="captured", currency="USD").first()
    url = admin_url("admin:refundops_payment_refund", payment.pk)
    response = client.post(url, {"amount": "999999", "reason": "duplicate", "idempotency_key": "k-big"})
    assert response.status_code == 200
    assert any(n.startswith("AMOUNT_EXCEEDS_REFUNDABLE") for n in messages_of(response))
    assert 'value="k-big"' not in response.content.decode()


def test_platform_switch_actions_go_through_the_audited_service(client, world, root):
    url = reverse("admin:refundops_platformstate_changelist")
    client.get(url)
    for action in ("killswitch_on", "agents_off"):
        client.post(url, {"action": action, "_selected_action": [1]})
    state = PlatformState.current()
    assert state.refunds_paused and state.agents_disabled and state.changed_by == "user:root"
    assert list(AuditEntry.objects.filter(action__in=["killswitch.on", "agents.disabled"])
                .values_list("actor", flat=True)) == ["user:root", "user:root"]
    page = client.get(reverse("admin:refundops_dashboard")).content.decode()
    assert re.search(r'Kill switch(</a>)? <span class="figure">ON</span>', page)


def test_revoking_keys_from_the_admin_is_audited_and_the_hash_is_never_shown(client, world, root):
    key = AgentKey.objects.first()
    listing = client.get(reverse("admin:refundops_agentkey_changelist"))
    detail = client.get(admin_url("admin:refundops_agentkey_change", key.pk))
    for page in (listing, detail):
        assert key.prefix in page.content.decode() and key.key_hash not in page.content.decode()
    client.post(reverse("admin:refundops_agentkey_changelist"),
                {"action": "revoke_selected", "_selected_action": [key.pk]})
    key.refresh_from_db()
    assert key.revoked_at is not None
    assert AuditEntry.objects.filter(action="key.revoked", subject_id=key.prefix, actor="user:root").exists()


def test_operators_rehearse_an_outage_with_the_sandbox_control(client, world, root):
    control = SandboxControl.current()
    url = admin_url("admin:processors_sandboxcontrol_change", control.pk)
    response = client.post(url, {"mode": "down", "settle_delay_seconds": "30"})
    assert response.status_code == 302
    control.refresh_from_db()
    assert (control.mode, control.settle_delay_seconds) == ("down", 30)
    assert AuditEntry.objects.filter(action="sandbox.changed", actor="user:root").exists()


def test_the_dashboard_draws_accessible_charts_with_money_per_currency(client, world, root):
    page = client.get(reverse("admin:refundops_dashboard")).content.decode()
    assert page.count("<svg") >= 7
    assert "Refund value per day in USD, against the global daily limit" in page
    assert "global daily limit" in page and "<title>" in page and 'role="img"' in page
    assert "115.00 USD in 2 refunds" in page  # approved 25.00 and held 90.00 both count, today
    assert "APPROVAL_REQUIRED" in page and "PAYMENT_FLAGGED" in page  # held by rule
    assert "1 replays" in page  # the duplicate blocked by idempotency
    assert "Customer request (2)" in page and "Product issue (1)" in page  # USD and EUR charts
    assert Payment.objects.get(paid_twice=True).pk in page
    assert not re.search(r'(src|href)="(https?:)?//', page)  # nothing fetched from elsewhere


def test_the_admin_index_links_the_dashboard_and_the_held_queue(client, world):
    client.force_login(make_approver())
    page = client.get(reverse("admin:index")).content.decode()
    assert reverse("admin:refundops_dashboard") in page and reverse("admin:refundops_refund_held") in page


def test_an_operator_grants_and_revokes_capabilities_through_the_audited_service(client, world, root):
    agent = AgentKey.objects.first().agent
    keep = [c for c in agent.capabilities if c != "refunds.create"]
    response = client.post(admin_url("admin:refundops_agent_change", agent.pk), {
        "capabilities": keep, "keys-TOTAL_FORMS": "1", "keys-INITIAL_FORMS": "1", "keys-MIN_NUM_FORMS": "0",
        "keys-MAX_NUM_FORMS": "1000"})
    assert response.status_code == 302, response.content.decode()[:2000]
    agent.refresh_from_db()
    assert "refunds.create" not in agent.capabilities and set(agent.capabilities) == set(keep)
    entry = AuditEntry.objects.get(action="capability.revoked", subject_id=agent.pk)
    assert entry.actor == "user:root" and entry.data["capability"] == "refunds.create"


def test_dashboard_reports_count_people_not_agents_and_follow_each_hold_to_its_end(world):
    from refundops import reports

    alice = make_approver("alice", currencies=("USD", "EUR"), limit=100_000)
    approve_refund(refund_id=world.held.pk, approver=alice)
    reject_refund(refund_id=world.held_big.pk, approver=alice)
    data = reports.dashboard()
    # The agent's refund approved by the policy is logged as refund.approved too, but by no person.
    assert data.decisions_by_person == {"alice": {"approved": 1, "rejected": 1}}
    assert data.held_by_rule == {
        "APPROVAL_REQUIRED": {"approved": 1, "rejected": 1, "expired": 0, "waiting": 0, "canceled": 0},
        "PAYMENT_FLAGGED": {"approved": 1, "rejected": 0, "expired": 0, "waiting": 0, "canceled": 0}}
    usd = next(c for c in data.per_currency if c.currency == "USD")
    assert (usd.days[-1].count, usd.days[-1].amount_minor) == (2, 11_500)  # approved 25.00 + 90.00
    assert [c.currency for c in data.per_currency] == ["USD"]  # a rejected refund no longer counts
    assert sum(data.duplicates_by_day.values()) == 1 and data.held_now == 0


def test_auditors_find_audit_entries_by_an_id_inside_their_data(client, world, root):
    listing = client.get(reverse("admin:audit_auditentry_changelist"), {"q": world.held.payment_id})
    assert listing.status_code == 200
    found = list(listing.context["cl"].result_list)
    assert [e.subject_id for e in found] == [world.held.pk] and found[0].data["payment_id"] == world.held.payment_id


def test_dashboard_shows_the_backlog_waiting_for_each_gateway(client, root, policy):
    from tests.conftest import make_payment

    payment = make_payment(amount=5_000)
    refund = Refund(payment=payment, amount_minor=100, currency="USD", reason="duplicate")
    refund.save()
    refund.approve_automatically()
    refund.save()
    page = client.get(reverse("admin:refundops_dashboard"))
    assert page.status_code == 200
    assert re.search(r"Waiting for sandbox\s*<span class=\"figure\">1</span>", page.content.decode())


def test_a_merchant_webhook_delivery_is_redelivered_from_the_admin(client, root):
    from refundops.models import MerchantEndpoint, WebhookDelivery

    endpoint = MerchantEndpoint.objects.create(url="http://127.0.0.1:9/hook")
    delivery = WebhookDelivery.objects.create(endpoint=endpoint, event_id="evt_1", event_type="refund.settled",
                                              payload={"id": "evt_1"}, status=WebhookDelivery.Status.FAILED,
                                              attempts=10)
    response = client.post(reverse("admin:refundops_webhookdelivery_changelist"),
                           {"action": "redeliver_selected", "_selected_action": [delivery.pk]}, follow=True)
    assert response.status_code == 200
    delivery.refresh_from_db()
    assert delivery.status == WebhookDelivery.Status.PENDING
    assert AuditEntry.objects.filter(subject_id=delivery.pk, actor="user:root").exists()
