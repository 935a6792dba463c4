"""Backtest: a draft replayed on a seeded history, checked against outcomes computed by hand.

The history (limits v1: approval threshold 50.00 USD, one refund per customer per day, 90-day
window; every hold rule on), each request by an agent, through the real service:

  #1 30.00 customer_request, customer 1              -> approved
  #2 80.00 duplicate, customer 2                     -> held APPROVAL_REQUIRED
  #3 20.00 product_issue, customer 3, flagged payment -> held PAYMENT_FLAGGED
  #4 10.00 customer_request, customer 1 again        -> denied DAILY_LIMIT_REACHED
  #5 10.00 customer_request, captured 100 days ago   -> denied REFUND_WINDOW_EXPIRED

plus what is never replayed: a malformed request, a dry run, an idempotent replay, and a request
older than the days asked for.
"""

from __future__ import annotations

import json
import uuid
from datetime import timedelta
from io import StringIO

import pytest
from django.contrib.admin.utils import quote
from django.contrib.auth.models import User
from django.core.management import CommandError, call_command
from django.urls import reverse
from django.utils import timezone

from audit.models import AuditEntry, Verdict
from refundops.callers import Caller
from refundops.models import PolicyDraft
from refundops.services.backtest import run_backtest
from refundops.services.drafts import DraftError, create_draft
from refundops.services.refunds import check_refund, request_refund
from tests.conftest import make_agent_key, make_limits, make_payment, make_rules

pytestmark = [pytest.mark.django_db, pytest.mark.usefixtures("quiet_breaker")]


@pytest.fixture
def history():
    make_limits(approval_threshold_minor=5_000, customer_daily_count=1)
    make_rules()
    caller = Caller.for_key(make_agent_key()[0])

    def ask(payment, amount, reason, key=None):
        return request_refund(caller=caller, idempotency_key=key or uuid.uuid4().hex,
                              data={"transaction_id": payment.pk, "amount": amount, "reason": reason})

    first = make_payment(amount=10_000)
    answers = [
        ask(first, 3_000, "customer_request", key="once"),
        ask(make_payment(amount=10_000), 8_000, "duplicate"),
        ask(make_payment(amount=10_000, fraud_flags=["velocity"]), 2_000, "product_issue"),
        ask(make_payment(amount=10_000, customer=first.customer), 1_000, "customer_request"),
        ask(make_payment(amount=10_000, captured_days_ago=100), 1_000, "customer_request"),
    ]
    assert [(a.status, a.code or a.body.get("hold_reasons")) for a in answers] == [
        (201, None), (202, ["APPROVAL_REQUIRED"]), (202, ["PAYMENT_FLAGGED"]), (422, "DAILY_LIMIT_REACHED"),
        (422, "REFUND_WINDOW_EXPIRED")]
    # Never replayed: a replay of #1's key, a malformed body, a dry run, a request 8 days old.
    assert ask(first, 3_000, "customer_request", key="once").body["deduplicated"]
    assert ask(first, "3000", "customer_request").code == "VALIDATION_ERROR"
    check_refund(caller=caller, idempotency_key="dry", data={"transaction_id": first.pk, "amount": 100,
                                                             "reason": "duplicate"})
    old = ask(make_payment(amount=10_000), 9_000, "duplicate")
    Verdict.objects.filter(pk=old.body["verdict"]["id"]).update(created_at=timezone.now() - timedelta(days=8))
    return [a.body.get("verdict", {}).get("id") or a.body["error"]["verdict_id"] for a in answers]


@pytest.fixture
def finance():
    return User.objects.create_superuser("finance", "f@example.com", "pw")


def backtest(*args: str) -> dict:
    out = StringIO()
    call_command("policy_backtest", *args, "--days", "7", "--json", stdout=out)
    return json.loads(out.getvalue())


def tally(count: int, usd: int | None = None) -> dict:
    return {"count": count, "value": {"USD": usd} if usd is not None else {}}


ACTIVE = {
    "outcomes": {"approved": tally(1, 3_000), "held": tally(2, 10_000), "denied": tally(2, 2_000)},
    "hold_reasons": {"APPROVAL_REQUIRED": tally(1, 8_000), "PAYMENT_FLAGGED": tally(1, 2_000)},
    "codes": {"DAILY_LIMIT_REACHED": tally(1, 1_000), "REFUND_WINDOW_EXPIRED": tally(1, 1_000)},
}


def test_a_draft_equal_to_the_active_limits_changes_nothing(history, finance):
    draft = create_draft(kind="limits", currency="USD", changes={}, person=finance)
    result = backtest("--limits", draft.pk)
    assert (result["requests"], result["changed"], result["changes"], result["skipped"]) == (5, 0, [], 0)
    assert result["active"] == result["draft"] == ACTIVE


def test_a_draft_that_changes_every_outcome(history, finance):
    draft = create_draft(kind="limits", currency="USD", person=finance, changes={
        "reason_thresholds": {"customer_request": 1_000, "duplicate": 10_000},
        "allowed_reasons": ["customer_request", "duplicate", "fraudulent"],
        "customer_daily_count": 5, "refund_window_days": 365})
    result = backtest("--limits", draft.pk)
    assert (result["requests"], result["changed"]) == (5, 5)
    assert result["active"] == ACTIVE
    assert result["draft"] == {
        # #2 under its new 100.00 threshold; #5 inside the year, at the 10.00 threshold exactly.
        "outcomes": {"approved": tally(2, 9_000), "held": tally(2, 4_000), "denied": tally(1, 2_000)},
        # #1 above 10.00; #4: 30.00 refunded to customer 1 by agents today plus 10.00 pass 10.00.
        "hold_reasons": {"APPROVAL_REQUIRED": tally(1, 3_000), "APPROVAL_REQUIRED_CUMULATIVE": tally(1, 1_000)},
        "codes": {"REASON_NOT_ALLOWED": tally(1, 2_000)},  # #3: product_issue no longer allowed
    }
    changes = {c["verdict_id"]: (c["active"]["outcome"], c["draft"]["outcome"], c["draft"]["code"]
                                 or c["draft"]["hold_reasons"]) for c in result["changes"]}
    assert [changes[v] for v in history] == [
        ("approved", "held", ["APPROVAL_REQUIRED"]), ("held", "approved", []),
        ("held", "denied", "REASON_NOT_ALLOWED"), ("denied", "held", ["APPROVAL_REQUIRED_CUMULATIVE"]),
        ("denied", "approved", [])]
    refund_ids = [c["refund_id"] for c in result["changes"]]
    assert refund_ids[:3] == [Verdict.objects.get(pk=v).refund_id for v in history[:3]] and all(refund_ids[:3])


def test_a_hold_rules_draft(history, finance):
    same = create_draft(kind="rules", changes={}, person=finance)
    assert backtest("--rules", same.pk)["changed"] == 0
    unflagged = create_draft(kind="rules", changes={"hold_flagged": False}, person=finance)
    result = backtest("--rules", unflagged.pk)
    assert result["changed"] == 1
    assert result["changes"][0]["verdict_id"] == history[2]
    assert result["draft"]["outcomes"] == {"approved": tally(2, 5_000), "held": tally(1, 8_000),
                                           "denied": tally(2, 2_000)}


def test_more_days_replay_more(history, finance):
    draft = create_draft(kind="limits", currency="USD", changes={}, person=finance)
    out = StringIO()
    call_command("policy_backtest", "--limits", draft.pk, "--days", "9", "--json", stdout=out)
    assert json.loads(out.getvalue())["requests"] == 6
    assert run_backtest(draft=draft, days=7).requests == 5


def test_the_command_explains_a_wrong_id_and_prints_a_readable_table(history, finance):
    draft = create_draft(kind="rules", changes={"hold_flagged": False}, person=finance)
    with pytest.raises(CommandError, match="use --rules"):
        call_command("policy_backtest", "--limits", draft.pk, "--days", "7")
    with pytest.raises(CommandError, match="No policy draft 'pd_nope'"):
        call_command("policy_backtest", "--rules", "pd_nope", "--days", "7")
    out = StringIO()
    call_command("policy_backtest", "--rules", draft.pk, "--days", "7", stdout=out)
    text = out.getvalue()
    assert "5 requests since" in text and "1 would change" in text
    assert "PAYMENT_FLAGGED" in text and "held PAYMENT_FLAGGED -> approved" in text


def test_drafts_are_checked_and_audited(finance, policy):
    with pytest.raises(DraftError, match="approval_threshold_minor"):
        create_draft(kind="limits", currency="USD", changes={"approval_threshold_minor": "lots"}, person=finance)
    with pytest.raises(DraftError, match="Not part of limits: hold_flagged"):
        create_draft(kind="limits", currency="USD", changes={"hold_flagged": False}, person=finance)
    clerk = User.objects.create_user("clerk", is_staff=True)
    with pytest.raises(DraftError) as refused:
        create_draft(kind="rules", changes={}, person=clerk)
    assert refused.value.code == "DRAFT_NOT_AUTHORIZED"
    draft = create_draft(kind="limits", currency="USD", changes={"approval_threshold_minor": 1}, person=finance)
    assert draft.values["approval_threshold_minor"] == 1 and draft.status == PolicyDraft.Status.DRAFT
    assert draft.values["customer_daily_count"] == 1_000  # the rest from the active version
    assert AuditEntry.objects.filter(action="policy_draft.created", subject_id=draft.pk).exists()


def test_the_admin_hands_the_backtest_to_the_worker_and_the_page_polls_its_progress(
        history, finance, client, django_capture_on_commit_callbacks, monkeypatch):
    """A year of requests took 170 s inside the admin's request (issue 31): now the request only
    queues a run; the worker replays, writing its progress, and the page shows the result when done."""
    from refundops.models import BacktestRun
    from refundops.services import backtest as service

    monkeypatch.setattr(service, "PROGRESS_EVERY", 2)
    heard = []
    replay = service.run_backtest

    def replay_heard(*, progress, **kw):
        heard.append("replayed")
        return replay(**kw, progress=lambda n: heard.append(n) or progress(n))

    monkeypatch.setattr(service, "run_backtest", replay_heard)
    draft = create_draft(kind="rules", changes={"hold_flagged": False}, person=finance)
    client.force_login(finance)
    page = reverse("admin:refundops_policydraft_change", args=[quote(draft.pk)])
    with django_capture_on_commit_callbacks(execute=False) as queued:
        answer = client.post(reverse("admin:refundops_policydraft_backtest", args=[quote(draft.pk)]), {"days": "7"})
    run = BacktestRun.objects.get()
    assert answer.status_code == 302 and answer["Location"] == f"{page}?backtest={run.pk}#backtest"
    assert (run.status, run.days, run.requested_by, heard) == ("queued", 7, "finance", [])  # nothing replayed inline
    progress = reverse("admin:refundops_policydraft_backtest_progress", args=[quote(draft.pk), run.pk])
    assert client.get(progress).json() == {"id": run.pk, "status": "queued", "replayed": 0, "total": None, "error": ""}
    waiting = client.get(f"{page}?backtest={run.pk}").content.decode()
    assert 'id="backtest-progress"' in waiting and progress in waiting and "backtest-summary" not in waiting

    for callback in queued:  # the commit: the outbox hands the task to the (eager) worker
        callback()
    assert heard == ["replayed", 2, 4]
    assert client.get(progress).json() == {"id": run.pk, "status": "done", "replayed": 5, "total": 5, "error": ""}
    done = client.get(f"{page}?backtest={run.pk}").content.decode()
    assert "<strong>5</strong> recorded requests since" in done and "<strong>1</strong> would change" in done
    assert 'id="backtest-progress"' not in done and "PAYMENT_FLAGGED" in done
    run.refresh_from_db()
    monkeypatch.setattr(service, "run_backtest", replay)
    command = backtest("--rules", draft.pk)
    assert run.result == {**command, "since": run.result["since"]}  # the command's answer (a moment later)


def test_a_backtest_run_that_fails_says_so_instead_of_polling_for_ever(history, finance, monkeypatch):
    from refundops.models import BacktestRun
    from refundops.services import backtest as service

    draft = create_draft(kind="rules", changes={}, person=finance)
    run = BacktestRun.objects.create(draft=draft, days=7)
    monkeypatch.setattr(service, "run_backtest", lambda **kw: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        service.complete_backtest_run(run_id=run.pk)
    run.refresh_from_db()
    assert (run.status, run.error) == ("failed", "ZeroDivisionError: division by zero") and run.finished_at
    assert service.complete_backtest_run(run_id=run.pk).status == "failed"  # a redelivered task does nothing


def test_a_backtest_run_whose_worker_died_is_marked_failed_not_polled_for_ever(history, finance, client,
                                                                             monkeypatch):
    """Review of issue 31: a worker killed mid-replay (OOM, a deploy's SIGKILL) leaves no
    exception to catch: its run stayed ``running`` and the page polled it for ever (the task is
    acknowledged on receipt, and a redelivered copy found the run claimed and did nothing). A run
    whose replay has not reported for ``BACKTEST_STALL_SECONDS`` is marked failed when polled."""
    from refundops.models import BacktestRun
    from refundops.services import backtest as service

    draft = create_draft(kind="rules", changes={}, person=finance)
    run = BacktestRun.objects.create(draft=draft, days=7)

    def killed(**kw):
        raise SystemExit(-9)  # what a dying worker leaves: no Exception, no finally of ours that writes

    monkeypatch.setattr(service, "run_backtest", killed)
    with pytest.raises(SystemExit):
        service.complete_backtest_run(run_id=run.pk)
    client.force_login(finance)
    progress = reverse("admin:refundops_policydraft_backtest_progress", args=[quote(draft.pk), run.pk])
    assert client.get(progress).json()["status"] == "running"  # within the window: it may be alive
    monkeypatch.setattr(service, "BACKTEST_STALL_SECONDS", 0, raising=False)
    polled = client.get(progress).json()
    assert polled["status"] == "failed" and "stopped" in polled["error"], polled
    page = reverse("admin:refundops_policydraft_change", args=[quote(draft.pk)])
    shown = client.get(f"{page}?backtest={run.pk}").content.decode()
    assert "The backtest failed: the worker stopped" in shown and "(function poll()" not in shown


def test_a_role_that_changes_nothing_cannot_start_a_backtest_and_another_drafts_run_is_not_shown(
        history, finance, client, django_capture_on_commit_callbacks):
    """Review of issue 31: starting a backtest now writes a row and queues minutes of the worker's
    time, yet it asked only for the view right, which the auditor ("reads everything, changes
    nothing") has: an auditor's forged POST queued as many year-long replays as it liked. Starting
    one takes the right to change drafts (finance, fraud); reading a run stays a view."""
    from refundops.models import BacktestRun

    draft = create_draft(kind="rules", changes={}, person=finance)
    other = create_draft(kind="rules", changes={"hold_flagged": False}, person=finance)
    auditor = User.objects.create_user("auditor", password="pw")
    call_command("grant_role", "auditor", "auditor", stdout=StringIO())
    client.force_login(auditor)
    start = reverse("admin:refundops_policydraft_backtest", args=[quote(draft.pk)])
    with django_capture_on_commit_callbacks(execute=True):
        refused = client.post(start, {"days": "366"})
    assert refused.status_code == 403 and not BacktestRun.objects.exists()

    run = BacktestRun.objects.create(draft=other, days=7)
    progress = reverse("admin:refundops_policydraft_backtest_progress", args=[quote(other.pk), run.pk])
    assert client.get(progress).json()["id"] == run.pk  # the auditor reads runs
    elsewhere = reverse("admin:refundops_policydraft_backtest_progress", args=[quote(draft.pk), run.pk])
    assert client.get(elsewhere).status_code == 403  # another draft's run, by its id
    page = reverse("admin:refundops_policydraft_change", args=[quote(draft.pk)])
    shown = client.get(f"{page}?backtest={run.pk}").content.decode()
    assert run.pk not in shown and "Run the backtest" not in shown  # no form the auditor cannot use
    client.force_login(finance)
    with django_capture_on_commit_callbacks(execute=False):
        assert client.post(start, {"days": "7"}).status_code == 302
    assert BacktestRun.objects.filter(draft=draft).count() == 1
