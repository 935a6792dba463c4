"""An open reconciliation discrepancy holds the payment's agent refunds (``LEDGER_MISMATCH``) until
a finance approver resolves it with a note, on the Reconciliation page: audited, and the hold lifts.
The dashboard counts what is open."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest
from django.contrib.auth.models import Permission, User
from django.urls import reverse
from django.utils import timezone

from audit.models import AuditEntry, Verdict
from refundops.errors import ApiError
from refundops.models import LedgerDiscrepancy, Refund, RefundState
from refundops.policy import RefundAsk, Totals, evaluate_refund
from refundops.services.reconciliation import raise_discrepancy, resolve_discrepancy
from roles.definitions import FINANCE_APPROVER, FRAUD_ANALYST
from roles.services import grant_role
from tests.browser import admin_url
from tests.conftest import make_payment, make_staff, post

pytestmark = pytest.mark.django_db
Kind = LedgerDiscrepancy.Kind


def mismatch(payment, *, kind: str = Kind.PAID_NOT_SETTLED, reference: str = "sbre_paid0001") -> LedgerDiscrepancy:
    return raise_discrepancy(payment=payment, kind=kind, actor="system:reconciler", gateway_reference=reference,
                             ours={"refund_id": "rf_x", "amount_minor": 1_000, "currency": "USD", "status": "failed"},
                             theirs={"processor_refund_id": reference, "amount_minor": 1_000, "currency": "USD",
                                     "status": "succeeded"},
                             detail="sandbox paid 10.00 USD for rf_x, which is failed here")


def person(username: str, role) -> User:
    user = User.objects.create_user(username, password="pw")
    grant_role(user=user, role=role, actor="test")
    return User.objects.get(pk=user.pk)


def ask(api, payment, amount: int = 500):
    return post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": amount, "reason": "customer_request"})


def test_an_open_discrepancy_holds_agent_refunds_until_a_finance_approver_resolves_it(api, policy) -> None:
    payment = make_payment(amount=10_000)
    found = mismatch(payment)

    held = ask(api, payment)

    assert held.status_code == 202, held.json()
    assert held.json()["hold_reasons"] == ["LEDGER_MISMATCH"]
    checks = {c["name"]: c for c in Verdict.objects.get(pk=held.json()["verdict"]["id"]).checks}
    assert checks["ledger_reconciled"]["result"] == "hold" and "open reconciliation" in checks["ledger_reconciled"]["message"]
    assert ask(api, make_payment(amount=10_000)).status_code == 201, "another payment is not held"
    dry = post(api, "/api/v1/refunds/check", {"transaction_id": payment.pk, "amount": 500, "reason": "customer_request"})
    assert "LEDGER_MISMATCH" in str(dry.json())

    resolved = resolve_discrepancy(discrepancy_id=found.pk, user=person("fiona", FINANCE_APPROVER),
                                   note="refunded 10.00 by hand; rf_x marked settled")

    assert (resolved.status, resolved.resolved_by.username) == (LedgerDiscrepancy.Status.RESOLVED, "fiona")
    entry = AuditEntry.objects.get(action="ledger.discrepancy_resolved")
    assert (entry.actor, entry.subject_id, entry.data["discrepancy_id"], entry.data["note"]) == (
        "user:fiona", payment.pk, found.pk, "refunded 10.00 by hand; rf_x marked settled")
    approved = ask(api, payment)
    assert approved.status_code == 201 and approved.json()["refund"]["status"] == RefundState.APPROVED


def test_the_hold_stays_while_any_discrepancy_of_the_payment_is_open(api, policy) -> None:
    payment = make_payment(amount=10_000)
    first, second = mismatch(payment), mismatch(payment, kind=Kind.CAPTURE_MISMATCH, reference="sbch_x")
    resolve_discrepancy(discrepancy_id=first.pk, user=person("fiona", FINANCE_APPROVER), note="fixed")

    assert ask(api, payment).json()["hold_reasons"] == ["LEDGER_MISMATCH"]
    assert AuditEntry.objects.get(action="ledger.discrepancy_resolved").data["still_open_on_payment"] == 1
    resolve_discrepancy(discrepancy_id=second.pk, user=User.objects.get(username="fiona"), note="capture recorded")
    assert ask(api, payment).status_code == 201


def test_resolving_needs_the_finance_approver_role_a_note_and_an_open_discrepancy() -> None:
    found = mismatch(make_payment())
    analyst, approver = person("fred", FRAUD_ANALYST), person("fiona", FINANCE_APPROVER)

    with pytest.raises(ApiError) as refused:
        resolve_discrepancy(discrepancy_id=found.pk, user=analyst, note="looks fine")
    assert refused.value.code == "RESOLUTION_NOT_AUTHORIZED"
    with pytest.raises(ApiError) as refused:
        resolve_discrepancy(discrepancy_id=found.pk, user=approver, note="   ")
    assert (refused.value.code, refused.value.extra) == ("VALIDATION_ERROR", {"field": "note"})
    resolve_discrepancy(discrepancy_id=found.pk, user=approver, note="done")
    with pytest.raises(ApiError) as refused:
        resolve_discrepancy(discrepancy_id=found.pk, user=approver, note="again")
    assert refused.value.code == "DISCREPANCY_NOT_OPEN"
    assert AuditEntry.objects.filter(action="ledger.discrepancy_resolved").count() == 1


def test_a_resolved_discrepancy_found_again_is_a_new_open_row() -> None:
    payment = make_payment()
    first = mismatch(payment)
    resolve_discrepancy(discrepancy_id=first.pk, user=person("fiona", FINANCE_APPROVER), note="thought it fixed")

    again = mismatch(payment)

    assert again.pk != first.pk and again.status == LedgerDiscrepancy.Status.OPEN


def test_staff_refunds_are_not_held_for_it_the_policy_is_told_the_fact() -> None:
    payment = make_payment()
    totals = Totals(**{f.name: 0 for f in fields(Totals)})
    agent = RefundAsk(amount_minor=100, reason="customer_request", destination="original_method",
                      agent_id="ag_1", session_id="")
    decide = dict(payment=payment, limits=None, rules=None, totals=totals, now=timezone.now(), paused=False,
                  breaker_open=False)

    assert "LEDGER_MISMATCH" in evaluate_refund(ask=agent, ledger_mismatch=True, **decide).hold_reasons
    assert "LEDGER_MISMATCH" not in evaluate_refund(ask=agent, ledger_mismatch=False, **decide).hold_reasons
    staff = replace(agent, agent_id=None, requester_authority_minor=10**9)
    assert "LEDGER_MISMATCH" not in evaluate_refund(ask=staff, ledger_mismatch=True, **decide).hold_reasons


# -- the Reconciliation page and the dashboard tile ---------------------------------------------------
def test_finance_reads_both_sides_and_resolves_with_a_note_on_the_reconciliation_page(client) -> None:
    payment = make_payment()
    found = mismatch(payment)
    approver = person("fiona", FINANCE_APPROVER)
    client.force_login(approver)

    listing = client.get(reverse("admin:refundops_ledgerdiscrepancy_changelist") + "?status__exact=open")
    page = listing.content.decode()
    assert listing.status_code == 200 and found.pk in page
    assert "failed 10.00 USD (rf_x)" in page and "succeeded 10.00 USD (sbre_paid0001)" in page
    resolve_url = admin_url("admin:refundops_ledgerdiscrepancy_resolve", found.pk)
    assert resolve_url in page
    form = client.get(resolve_url)
    assert form.status_code == 200 and "LEDGER_MISMATCH" in form.content.decode()

    empty = client.post(resolve_url, {"note": ""})
    assert empty.status_code == 200 and "This field is required" in empty.content.decode()
    done = client.post(resolve_url, {"note": "refunded by hand"}, follow=True)

    assert done.redirect_chain[-1][0] == reverse("admin:refundops_ledgerdiscrepancy_changelist")
    found.refresh_from_db()
    assert (found.status, found.resolution_note, found.resolved_by) == ("resolved", "refunded by hand", approver)


def test_the_page_is_read_only_and_resolving_is_refused_without_the_right(client) -> None:
    found = mismatch(make_payment())
    client.force_login(person("fred", FRAUD_ANALYST))
    assert client.get(reverse("admin:refundops_ledgerdiscrepancy_changelist")).status_code == 403
    client.force_login(make_staff("viewer"))
    viewer = User.objects.get(username="viewer")
    viewer.user_permissions.add(Permission.objects.get(codename="view_ledgerdiscrepancy"))
    assert client.get(admin_url("admin:refundops_ledgerdiscrepancy_change", found.pk)).status_code == 200
    assert client.post(admin_url("admin:refundops_ledgerdiscrepancy_resolve", found.pk),
                       {"note": "x"}).status_code == 403
    assert client.post(admin_url("admin:refundops_ledgerdiscrepancy_change", found.pk),
                       {"status": "resolved"}).status_code == 403
    found.refresh_from_db()
    assert found.status == LedgerDiscrepancy.Status.OPEN


def test_the_dashboard_tile_counts_open_discrepancies_and_links_to_the_page(client) -> None:
    approver = person("fiona", FINANCE_APPROVER)
    client.force_login(approver)
    dashboard = reverse("admin:refundops_dashboard")
    assert 'id="reconciliation-tile"' in client.get(dashboard).content.decode()
    first, _ = mismatch(make_payment()), mismatch(make_payment())
    resolve_discrepancy(discrepancy_id=first.pk, user=approver, note="done")

    page = client.get(dashboard).content.decode()

    tile = page[page.index('id="reconciliation-tile"'):]
    tile = tile[:tile.index("</div>")]
    assert '<span class="figure">1</span>' in tile
    assert reverse("admin:refundops_ledgerdiscrepancy_changelist") + "?status__exact=open" in tile
    assert not Refund.objects.exists()


@pytest.mark.parametrize("origin", ["agent", "staff"])
def test_resubmitting_a_failed_refund_the_gateway_paid_waits_for_the_discrepancy(origin: str) -> None:
    """Issue 8 finding 1: paid at the gateway, recorded failed. The reconciler raises it; sending the
    failed refund again would pay twice, so the resubmission is held, whoever made the refund."""
    from approvals.services import resubmit_refund
    from tests.conftest import make_limits, make_rules
    from tests.test_approvals import approver
    from tests.test_resubmit import failed_refund

    make_limits(), make_rules()
    refund = failed_refund(3_000)
    if origin == "staff":
        Refund.objects.filter(pk=refund.pk).update(agent=None, origin=Refund.Origin.STAFF)
    mismatch(refund.payment)

    resubmitted = resubmit_refund(refund_id=refund.pk, approver=approver("alice", limit=50_000))

    assert (resubmitted.status, resubmitted.hold_reasons) == (RefundState.HELD, ["LEDGER_MISMATCH"])
    verdict = Verdict.objects.get(operation="refund.resubmit", refund_id=refund.pk)
    assert (verdict.outcome, verdict.hold_reasons) == ("held", ["LEDGER_MISMATCH"])
