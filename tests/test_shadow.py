"""Shadow mode: a draft evaluated on every live request beside the active version, recorded on the
verdict, never enforced; a page of disagreements; promoting (a proposal a second person approves)
or dropping is one step, audited."""

from __future__ import annotations

import uuid

import pytest
from django.contrib.auth.models import User
from django.test import Client

from audit.models import AuditEntry, Verdict
from proposals.models import Proposal
from proposals.services import ProposalError, approve_proposal
from refundops.callers import Caller
from refundops.models import PolicyDraft, Refund, RefundLimits
from refundops.selectors import active_limits
from refundops.services.drafts import (DraftError, create_draft, draft_fields, drop_draft, promote_draft,
                                       set_shadow)
from refundops.services.refunds import request_refund
from tests.browser import admin_url
from tests.conftest import make_agent_key, make_limits, make_payment, make_rules

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("quiet_breaker")]


@pytest.fixture
def world():
    make_limits(approval_threshold_minor=5_000)
    make_rules()
    return Caller.for_key(make_agent_key()[0])


@pytest.fixture
def finance():
    return User.objects.create_superuser("finance", "f@example.com", "pw")


@pytest.fixture
def second():
    return User.objects.create_superuser("second", "s@example.com", "pw")


def ask(caller, amount: int, reason: str = "customer_request", **payment):
    return request_refund(caller=caller, idempotency_key=uuid.uuid4().hex,
                          data={"transaction_id": make_payment(amount=50_000, **payment).pk, "amount": amount,
                                "reason": reason})


def shadow_of(answer, draft) -> dict:
    verdict_id = answer.body.get("verdict", {}).get("id") or answer.body["error"]["verdict_id"]
    return Verdict.objects.get(pk=verdict_id).shadow[draft.pk]


def test_a_shadow_is_recorded_on_every_live_request_and_never_enforced(world, finance):
    stricter = create_draft(kind="limits", currency="USD", person=finance,
                            changes={"approval_threshold_minor": 1_000, "allowed_reasons": ["duplicate"]})
    set_shadow(draft_id=stricter.pk, on=True, person=finance)

    approved = ask(world, 3_000, reason="duplicate")  # the shadow would hold it: approved all the same
    assert approved.status == 201 and approved.body["refund"]["status"] == "approved"
    assert shadow_of(approved, stricter) == {"kind": "limits", "outcome": "held", "code": "",
                                             "hold_reasons": ["APPROVAL_REQUIRED"], "amount_minor": 3_000,
                                             "agrees": False}
    refused_by_shadow = ask(world, 500)  # customer_request: the shadow refuses it, the active approves
    assert refused_by_shadow.status == 201
    assert shadow_of(refused_by_shadow, stricter)["code"] == "REASON_NOT_ALLOWED"
    same = ask(world, 9_000, reason="duplicate")  # held by both, for the same reason
    assert same.status == 202 and shadow_of(same, stricter)["agrees"] is True
    assert Refund.objects.filter(status="approved").count() == 2


def test_a_lenient_shadow_releases_nothing(world, finance):
    lenient = create_draft(kind="rules", person=finance, changes={"hold_flagged": False})
    set_shadow(draft_id=lenient.pk, on=True, person=finance)
    held = ask(world, 1_000, fraud_flags=["velocity"])
    assert held.status == 202 and held.body["hold_reasons"] == ["PAYMENT_FLAGGED"]
    assert shadow_of(held, lenient) == {"kind": "rules", "outcome": "approved", "code": "", "hold_reasons": [],
                                        "amount_minor": 1_000, "agrees": False}


def test_one_shadow_per_series_and_none_after_a_drop(world, finance):
    first = create_draft(kind="limits", currency="USD", changes={"approval_threshold_minor": 1}, person=finance)
    second = create_draft(kind="limits", currency="USD", changes={"approval_threshold_minor": 2}, person=finance)
    rules = create_draft(kind="rules", changes={}, person=finance)
    for draft in (first, second, rules):
        set_shadow(draft_id=draft.pk, on=True, person=finance)
    first.refresh_from_db()
    assert not first.shadow  # switched off when the second one of its series went on
    answer = ask(world, 100)
    assert set(Verdict.objects.get(pk=answer.body["verdict"]["id"]).shadow) == {second.pk, rules.pk}

    drop_draft(draft_id=second.pk, person=finance, note="too strict")
    assert set(Verdict.objects.get(pk=ask(world, 100).body["verdict"]["id"]).shadow) == {rules.pk}
    assert AuditEntry.objects.filter(action="policy_draft.dropped", subject_id=second.pk).exists()
    assert AuditEntry.objects.filter(action="policy_draft.shadow_on", subject_id=second.pk,
                                     data__replaced=[first.pk]).exists()
    with pytest.raises(DraftError, match="dropped"):
        set_shadow(draft_id=second.pk, on=True, person=finance)


def test_no_shadow_no_record(world):
    assert Verdict.objects.get(pk=ask(world, 100).body["verdict"]["id"]).shadow == {}


def test_promoting_is_a_proposal_a_second_person_approves(world, finance, second):
    draft = create_draft(kind="limits", currency="USD", changes={"approval_threshold_minor": 1_000}, person=finance)
    set_shadow(draft_id=draft.pk, on=True, person=finance)
    proposal = promote_draft(draft_id=draft.pk, person=finance)
    draft.refresh_from_db()
    assert (draft.status, draft.proposal_id, proposal.status) == ("proposed", proposal.pk, "pending")
    assert proposal.changes == {"approval_threshold_minor": 1_000}  # only what differs from the active version
    assert active_limits("USD").approval_threshold_minor == 5_000  # binds only once approved
    assert shadow_of(ask(world, 3_000), draft)["outcome"] == "held"  # still watching while proposed
    with pytest.raises(ProposalError, match="second person"):
        approve_proposal(proposal_id=proposal.pk, approver=finance)

    approve_proposal(proposal_id=proposal.pk, approver=second)
    draft.refresh_from_db()
    assert (draft.status, draft.shadow) == ("promoted", False)
    assert active_limits("USD").approval_threshold_minor == 1_000
    assert RefundLimits.objects.filter(currency="USD").count() == 2
    assert ask(world, 3_000).status == 202  # now it binds
    assert AuditEntry.objects.filter(action="policy_draft.promoted", subject_id=draft.pk,
                                     data__proposal_id=proposal.pk).exists()
    assert AuditEntry.objects.filter(action="proposal.approved", subject_id=proposal.pk).exists()


def test_a_rejected_promotion_leaves_a_draft(world, finance, second):
    from proposals.services import reject_proposal

    draft = create_draft(kind="rules", changes={"hold_flagged": False}, person=finance)
    proposal = promote_draft(draft_id=draft.pk, person=finance)
    reject_proposal(proposal_id=proposal.pk, approver=second, note="not now")
    draft.refresh_from_db()
    assert (draft.status, draft.proposal_id) == ("draft", "")
    assert Proposal.objects.get(pk=proposal.pk).status == "rejected"


def test_the_disagreements_page(world, finance):
    draft = create_draft(kind="limits", currency="USD", changes={"approval_threshold_minor": 1_000}, person=finance)
    set_shadow(draft_id=draft.pk, on=True, person=finance)
    disagreeing = ask(world, 3_000)
    ask(world, 500)  # agrees: approved by both
    client = Client()
    client.force_login(finance)
    page = client.get(admin_url("admin:refundops_policydraft_disagreements", draft.pk)).content.decode()
    assert "Evaluated in shadow on <strong>2</strong> live requests" in page
    assert "disagreed with the active version on <strong>1</strong>" in page
    assert disagreeing.body["refund"]["id"] in page and "APPROVAL_REQUIRED" in page
    response = client.post(admin_url("admin:refundops_policydraft_drop", draft.pk), {"note": "seen enough"})
    assert response.status_code == 302
    assert PolicyDraft.objects.get(pk=draft.pk).status == "dropped"


@pytest.mark.parametrize("changes", [
    {"global_daily_amount_minor": 10.0**12},  # JSON's 1e12: a float, which format_minor cannot spell
    {"allowed_reasons": ["duplicate", 7]},  # not a reason: a refusal's message cannot join it
    {"hold_flagged": "0"},  # a string: truthy, so the draft would hold what it says it releases
    {"approval_threshold_minor": 1000.5},  # a fraction of a minor unit: a saved row truncates it
])
def test_a_draft_keeps_only_values_its_version_would_keep(world, finance, changes):
    """A draft is replayed as written (PolicyDraft.as_version), not as a saved row would read it back:
    a value its field only converts would reach the policy unconverted, and a shadow draft runs on
    every live request. Since fe7e9f5 a check's message is spelled only when kept, so such a draft
    broke live refunds only when it refused (before, on every request): refused when written."""
    with pytest.raises(DraftError) as refused:
        create_draft(kind="rules" if "hold_flagged" in changes else "limits",
                     currency="" if "hold_flagged" in changes else "USD", person=finance, changes=changes)
    assert refused.value.code == "DRAFT_INVALID" and next(iter(changes)) in refused.value.message


def test_a_shadow_draft_never_breaks_a_live_refund(world, finance):
    """What the test above prevents: a float limit in a shadow draft (written before it) made the live
    request fail when the draft's limit refused it (fe7e9f5; before it, always)."""
    draft = PolicyDraft.objects.create(kind="limits", currency="USD", values={
        **{k: v for k, v in vars(active_limits("USD")).items() if k in draft_fields("limits")},
        "global_daily_amount_minor": 1000.0})
    set_shadow(draft_id=draft.pk, on=True, person=finance)
    answer = ask(world, 3_000)
    assert answer.status == 201
    assert shadow_of(answer, draft)["code"] == "DAILY_LIMIT_REACHED"


@pytest.mark.parametrize("bad", [{"allowed_reasons": 5}, {"reason_thresholds": {"duplicate": "abc"}},
                                 {"reason_thresholds": []}])
def test_a_shadow_draft_stored_with_a_json_value_no_version_keeps_never_breaks_a_live_refund(world, finance, bad):
    """Drafts written before create_draft refused them: as_version converts the scalar fields, not the
    JSON ones, and the policy raised on them (TypeError, ValueError, AttributeError) inside the binding
    request. A shadow is never enforced: such a draft is left out of the verdict's shadow, with a log line."""
    draft = PolicyDraft.objects.create(kind="limits", currency="USD", values={
        **{k: v for k, v in vars(active_limits("USD")).items() if k in draft_fields("limits")}, **bad})
    set_shadow(draft_id=draft.pk, on=True, person=finance)
    answer = ask(world, 3_000)
    assert answer.status == 201
