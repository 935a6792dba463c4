"""``manage.py revocation_drill``: it revokes for real and sees the next REST and MCP call refused;
a revocation that did not take is a failed drill (exit 1), and either way nothing usable is left."""

from __future__ import annotations

import io
import json
from datetime import timedelta

import pytest
from django.core.management import call_command
from django.utils import timezone

from audit.chain import seal
from audit.evidence import build_pack, load_signing_key, new_signing_key
from audit.models import AuditEntry
from refundops.models import Agent, AgentKey, GatewayAttempt, Refund
from refundops.services import agents

pytestmark = pytest.mark.django_db


def _drill(*options: str) -> tuple[int, dict]:
    out = io.StringIO()
    try:
        call_command("revocation_drill", "--json", *options, stdout=out)
        code = 0
    except SystemExit as exited:
        code = exited.code
    return code, json.loads(out.getvalue())


def test_the_drill_revokes_for_real_and_rest_and_mcp_are_refused(tmp_path):
    code, result = _drill()
    assert code == 0 and result["passed"] is True
    got = [(s["channel"], s["got"]) for s in result["steps"]]
    assert got == [("rest", "PAYMENT_NOT_FOUND"), ("mcp", "PAYMENT_NOT_FOUND"),
                   ("rest", "CAPABILITY_NOT_GRANTED"), ("mcp", "CAPABILITY_NOT_GRANTED"),
                   ("rest", "UNAUTHENTICATED"), ("mcp", "UNAUTHENTICATED")]
    assert all(s["ms_since_revocation"] >= 0 for s in result["steps"][2:])
    agent = Agent.objects.get(pk=result["agent_id"])
    assert agent.merchant.name == "Revocation drill" and not agent.is_active
    assert agent.capabilities == ["refunds.create"]
    assert AgentKey.objects.get(prefix=result["key_prefix"]).revoked_at is not None
    assert not Refund.objects.exists() and not GatewayAttempt.objects.exists()  # no money moved
    entry = AuditEntry.objects.get(action="revocation.drill")
    assert entry.data["passed"] is True and entry.subject_id == agent.pk
    # The evidence pack reads it: a passed drill is no exception.
    pem = tmp_path / "k.pem"
    new_signing_key(pem)
    seal()
    now = timezone.now()
    pack = build_pack(start=now - timedelta(hours=1), end=now + timedelta(hours=1), out=tmp_path / "p.zip",
                      signing_key=load_signing_key(pem))
    revocation = next(c for c in pack.controls if c.slug == "revocation")
    assert revocation.exceptions == [] and revocation.rows == 3  # capability revoked, key revoked, the drill


def test_a_revocation_that_does_not_take_fails_the_drill_and_still_leaves_the_key_revoked(monkeypatch):
    monkeypatch.setattr(agents, "revoke_capability", lambda **kwargs: None)  # a broken revocation
    code, result = _drill()
    assert code == 1 and result["passed"] is False
    failed = [(s["channel"], s["got"]) for s in result["steps"] if not s["ok"]]
    assert failed == [("rest", "PAYMENT_NOT_FOUND"), ("mcp", "PAYMENT_NOT_FOUND")]  # the calls got through
    assert AgentKey.objects.get(prefix=result["key_prefix"]).revoked_at is not None
    assert AuditEntry.objects.get(action="revocation.drill").data["passed"] is False


def test_the_scheduled_drill_is_off_by_default_and_the_task_runs_it():
    from django.conf import settings

    from audit.tasks import run_revocation_drill
    assert "revocation-drill" not in settings.CELERY_BEAT_SCHEDULE
    assert run_revocation_drill() is True
    assert AuditEntry.objects.filter(action="revocation.drill", data__passed=True).count() == 1


def test_after_a_passed_drill_a_clean_period_packs_with_exit_0(tmp_path):
    assert _drill()[0] == 0
    today = timezone.now().date().isoformat()
    out = io.StringIO()
    try:
        call_command("evidence_pack", "--from", today, "--to", today, "--out", str(tmp_path / "p.zip"),
                     "--new-key", str(tmp_path / "k.pem"), stdout=out)  # no SystemExit: exit 0
    except SystemExit:
        raise AssertionError(out.getvalue()) from None
    assert "0 exception(s)" in out.getvalue() and "Revocation: Held: all 3 rows" in out.getvalue()
    assert "Full log: the audit chain: Held: all 0 rows" not in out.getvalue()  # sealed before its heads are read
    call_command("verify_evidence_pack", str(tmp_path / "p.zip"), "--public-key", str(tmp_path / "k.pem.pub"),
                 stdout=io.StringIO())


def _drill_tile(client) -> str:
    import re

    from django.urls import reverse
    page = client.get(reverse("admin:refundops_dashboard")).content.decode()
    tile = re.search(r'<div class="tile[^"]*" id="last-drill-tile">(.*?)</div>', page, re.S)
    assert tile, "no last-drill tile on the dashboard"
    return " ".join(tile.group(1).split())


def test_the_dashboard_tile_shows_the_last_drill_when_it_ran_and_never_run_before(client):
    from django.contrib.auth.models import User

    from audit.services import record_audit
    User.objects.create_user("auditor-1", is_staff=True)
    call_command("grant_role", "auditor-1", "auditor", stdout=io.StringIO())
    client.force_login(User.objects.get(username="auditor-1"))
    assert "never run" in _drill_tile(client)
    code, result = _drill()
    slowest = max(s["ms_since_revocation"] for s in result["steps"] if s["ms_since_revocation"] is not None)
    tile = _drill_tile(client)
    assert "passed" in tile and f"refused {slowest:.1f} ms after revocation" in tile and "never run" not in tile
    record_audit(actor="system:revocation_drill", action="revocation.drill", subject_type="agent", subject_id="ag_x",
                 data={"passed": False, "steps": [{"ms_since_revocation": 2.5, "ok": False}]})
    tile = _drill_tile(client)
    assert "FAILED" in tile and "a call got through" in tile and "refused 2.5 ms" in tile
