"""The auditors' evidence pack (audit/evidence.py): over seeded data with known exceptions it finds
exactly them, and any change to the pack is caught by both verifiers (the command and the
standalone script in examples/)."""

from __future__ import annotations

import csv
import importlib.util
import io
import json
import subprocess
import sys
import zipfile
from datetime import UTC, datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import hypothesis
import pytest
from django.core.management import call_command
from django.utils import timezone

from audit.chain import seal
from audit.evidence import build_pack, load_signing_key, new_signing_key, verify_pack
from audit.exports import csv_cell
from audit.models import AuditEntry, Verdict
from processors import sandbox
from processors.models import InboundEvent
from refundops.models import Agent, AgentKey, GatewayAttempt, HoldRules, Merchant, Refund, RefundLimits
from refundops.models.merchants import DEFAULT_MERCHANT_ID
from refundops.services import payouts
from tests.conftest import make_agent_key, make_limits, make_payment, make_rules, make_staff, post

pytestmark = pytest.mark.django_db

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "verify_evidence_pack.py"


@pytest.fixture
def signing(tmp_path):
    public = new_signing_key(tmp_path / "evidence.pem")
    (tmp_path / "evidence.pem.pub").write_bytes(public)
    return load_signing_key(tmp_path / "evidence.pem"), tmp_path / "evidence.pem.pub"


def _paid(payment, *, verdict=None) -> Refund:
    refund = Refund.objects.create(payment=payment, amount_minor=100, currency="USD", reason="duplicate",
                                   verdict=verdict, idempotency_key=f"seeded-{payment.pk}-{verdict}")
    Refund.objects.filter(pk=refund.pk).update(status="settled", submitted_at=timezone.now(),
                                               settled_at=timezone.now())
    return refund


def seed_known_exceptions() -> dict[str, set[str]]:
    """A period with one honest refund paid through the sandbox, and one planted exception per check."""
    earlier = timezone.now() - timedelta(days=3)
    make_limits(), make_rules(), make_staff("approver")
    RefundLimits.objects.update(created_at=earlier)  # in force from before the period: not its change
    HoldRules.objects.update(created_at=earlier)
    key, raw = make_agent_key()
    from rest_framework.test import APIClient
    api = APIClient()
    api.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    sandbox.set_mode("up", settle_delay_seconds=0)
    honest = post(api, "/api/v1/refunds", {"transaction_id": make_payment(amount=5_000).pk, "amount": 900,
                                           "reason": "duplicate"}).json()["refund"]["id"]
    payouts.submit_refund(refund_id=honest)
    assert Refund.objects.get(pk=honest).status == "settled"
    assert GatewayAttempt.objects.filter(refund_id=honest).exclude(idempotency_key="").exists()
    refused = post(api, "/api/v1/refunds", {"transaction_id": make_payment().pk, "amount": 100,
                                            "reason": "duplicate", "destination": "another_card"}).json()
    assert refused["error"]["code"] == "DESTINATION_NOT_ALLOWED"

    # Planted exceptions, one or two per control.
    v2 = make_limits(approval_threshold_minor=99_999)  # in the period, with no second person's approval
    broad = Agent.objects.create(name="broad-agent", capabilities=["refunds.create", "payments.write"])
    loose = AgentKey.objects.create(agent=broad, prefix="rk_loose001", key_hash="plain-text-key")
    void_without_capability = Verdict.objects.create(operation="payment.void", outcome="approved",
                                                     agent_id=broad.pk, key_prefix=loose.prefix,
                                                     idempotency_key="k1")
    no_totals = Verdict.objects.create(operation="refund.create", outcome="approved", agent_id=key.agent_id,
                                       key_prefix=key.prefix, idempotency_key="k2", totals={})
    elsewhere = Verdict.objects.create(operation="refund.create", outcome="held", agent_id=key.agent_id,
                                       idempotency_key="k3", totals={"today": 1},
                                       request={"destination": "iban:DE00"})
    payment = make_payment(amount=9_000)
    unverdicted = _paid(payment)
    held = Verdict.objects.create(operation="refund.create", outcome="held", totals={"today": 1},
                                  idempotency_key="k4")
    never_approved = _paid(payment, verdict=held)
    twice = Refund.objects.create(payment=payment, amount_minor=50, currency="USD", reason="duplicate",
                                  idempotency_key=unverdicted.idempotency_key, verdict=held)  # the key again
    keyless = GatewayAttempt.objects.create(refund=never_approved, idempotency_key="",
                                            lease_until=timezone.now(), outcome="succeeded")
    InboundEvent.objects.create(processor="stripe", event_id="evt_ok", verified=True, applied_at=timezone.now())
    InboundEvent.objects.create(processor="stripe", event_id="evt_forged_unapplied", verified=False)
    forged = InboundEvent.objects.create(processor="stripe", event_id="evt_forged", verified=False,
                                         applied_at=timezone.now())
    seal()
    return {
        "capability_list": {broad.pk}, "key_scope": {loose.prefix}, "limits": {f"USD limits v{v2.version}"},
        "hold_rules": set(), "capabilities_and_authorities": set(), "verdicts": {no_totals.pk}, "capability_use": {void_without_capability.pk},
        "gateway_writes": {keyless.pk}, "idempotency": {twice.pk}, "paid_refunds": {unverdicted.pk, never_approved.pk},
        "inbound_events": {str(forged.pk)}, "refund_elsewhere": {elsewhere.pk},
        "refund_void_separate": {broad.pk}, "revocation": {"-"}, "audit_chain": set(),
    }


def _period():
    now = timezone.now()
    return now - timedelta(hours=1), now + timedelta(hours=1)


def test_the_pack_finds_exactly_the_planted_exceptions(tmp_path, signing):
    expected = seed_known_exceptions()
    start, end = _period()
    result = build_pack(start=start, end=end, out=tmp_path / "pack.zip", signing_key=signing[0])
    found = {c.slug: {row_id for row_id, _ in c.exceptions} for c in result.controls}
    assert found == expected
    assert result.exception_count == sum(len(ids) for ids in expected.values())
    with zipfile.ZipFile(tmp_path / "pack.zip") as pack:
        summary = pack.read("summary.html").decode()
        pdf = pack.read("summary.pdf")
        manifest = json.loads(pack.read("manifest.json"))
        paid = pack.read("controls/paid_refunds.csv").decode()
        chain = pack.read("audit_chain_segment.csv").decode().splitlines()
        in_force = pack.read("controls/capabilities_and_authorities.csv").decode()
    assert "approval authority,approver USD" in in_force and "broad-agent" not in in_force  # ids, not names
    assert f"agent capabilities,{Agent.objects.get(name='broad-agent').pk}" in in_force
    for ids in expected.values():
        for row_id in ids:
            assert row_id in summary  # listed by id, never left out
    assert pdf.startswith(b"%PDF-") and pdf.rstrip().endswith(b"%%EOF") and len(pdf) > 10_000
    assert "Held: all" in summary and "Exceptions: 2 of 3 rows" in summary
    assert "Exceptions: 1, listed below." in summary  # no drill: an absence, never an omission
    assert "paid without a verdict" in paid and "no person approved" in paid
    assert set(manifest["files"]) == {f"controls/{slug}.csv" for slug in expected if slug != "audit_chain"} | {
        "audit_chain_segment.csv", "summary.html", "summary.pdf"}
    heads = manifest["audit_chain_heads"]
    assert heads["verify_audit"] == "ok" and heads["start"].startswith("0:")
    assert heads["end"].split(":")[0] == str(AuditEntry.objects.order_by("-seq").values_list("seq", flat=True)[0])
    assert len(chain) - 1 == AuditEntry.objects.filter(seq__isnull=False).count()


def test_formula_cells_are_defused_and_html_escaped(tmp_path, signing):
    make_limits(), make_rules()
    Agent.objects.create(name="=HYPERLINK(\"http://x\")<script>", capabilities=["everything"])
    start, end = _period()
    build_pack(start=start, end=end, out=tmp_path / "pack.zip", signing_key=signing[0])
    with zipfile.ZipFile(tmp_path / "pack.zip") as pack:
        agents = pack.read("controls/capability_list.csv").decode()
        summary = pack.read("summary.html").decode()
    assert "'=HYPERLINK" in agents and ",=HYPERLINK" not in agents
    assert "<script>" not in summary


def _standalone_verifier():
    spec = importlib.util.spec_from_file_location("verify_evidence_pack", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _rewrite(src: Path, dst: Path, change) -> None:
    with zipfile.ZipFile(src) as old, zipfile.ZipFile(dst, "w") as new:
        members = {name: old.read(name) for name in old.namelist()}
        for name, body in change(members).items():
            new.writestr(name, body)


TAMPERINGS = {
    "changed CSV": lambda m: {**m, "controls/paid_refunds.csv": m["controls/paid_refunds.csv"].replace(b"rf_", b"rX_", 1)},
    "changed chain segment": lambda m: {**m, "audit_chain_segment.csv": m["audit_chain_segment.csv"][:-40]},
    "changed summary": lambda m: {**m, "summary.html": m["summary.html"].replace(b"Exceptions", b"Held", 1)},
    "changed PDF": lambda m: {**m, "summary.pdf": m["summary.pdf"][:-200] + b"%%EOF\n"},
    "removed file": lambda m: {k: v for k, v in m.items() if k != "controls/inbound_events.csv"},
    "added file": lambda m: {**m, "controls/extra.csv": b"id\n1\n"},
    "changed manifest": lambda m: {**m, "manifest.json": m["manifest.json"].replace(b'"exceptions"', b'"exceptionz"')},
    "forged signature": lambda m: {**m, "manifest.sig": b"AAAA" + m["manifest.sig"][4:]},
}


def test_any_tampering_is_detected_by_both_verifiers(tmp_path, signing, capsys):
    seed_known_exceptions()
    key, public = signing
    start, end = _period()
    build_pack(start=start, end=end, out=tmp_path / "pack.zip", signing_key=key)
    assert verify_pack(tmp_path / "pack.zip", public.read_bytes()) == []
    call_command("verify_evidence_pack", str(tmp_path / "pack.zip"), "--public-key", str(public))
    clean = subprocess.run([sys.executable, str(EXAMPLE), str(tmp_path / "pack.zip"), "--public-key", str(public)],
                           capture_output=True, text=True)
    assert clean.returncode == 0 and "verifies" in clean.stdout, clean.stderr
    standalone = _standalone_verifier()
    for what, change in TAMPERINGS.items():
        bad = tmp_path / f"{what.replace(' ', '_')}.zip"
        _rewrite(tmp_path / "pack.zip", bad, change)
        assert verify_pack(bad, public.read_bytes()), what
        with pytest.raises(Exception, match="does not verify"):
            call_command("verify_evidence_pack", str(bad), "--public-key", str(public))
        assert standalone.problems_in(bad, public.read_bytes()), what
    script = subprocess.run([sys.executable, str(EXAMPLE), str(bad), "--public-key", str(public)],
                            capture_output=True, text=True)  # the script as an auditor runs it, on the last one
    assert script.returncode == 1 and "does not verify" in script.stdout, (script.stdout, script.stderr)
    other = tmp_path / "other.pem"
    other_public = tmp_path / "other.pem.pub"
    other_public.write_bytes(new_signing_key(other))
    assert verify_pack(tmp_path / "pack.zip", other_public.read_bytes()) == [
        "the signature of manifest.json does not verify with this public key"]


def test_the_command_signs_with_a_new_key_and_exits_1_on_exceptions(tmp_path):
    seed_known_exceptions()
    today = timezone.now().date().isoformat()
    with pytest.raises(SystemExit) as exited:
        call_command("evidence_pack", "--from", today, "--to", today, "--out", str(tmp_path / "p.zip"),
                     "--new-key", str(tmp_path / "k.pem"))
    assert exited.value.code == 1
    assert verify_pack(tmp_path / "p.zip", (tmp_path / "k.pem.pub").read_bytes()) == []
    assert AuditEntry.objects.filter(action="evidence_pack.built").exists()


def test_no_signing_key_is_refused_before_anything_is_written(tmp_path, settings):
    from django.core.management.base import CommandError
    settings.EVIDENCE_SIGNING_KEY = ""
    with pytest.raises(CommandError, match="no signing key"):
        call_command("evidence_pack", "--from", "2026-10-01", "--to", "2026-12-31", "--out", str(tmp_path / "p.zip"))
    assert not (tmp_path / "p.zip").exists()


def test_a_limits_version_approved_by_a_second_person_names_both_and_is_no_exception(tmp_path, signing):
    from django.contrib.auth.models import User

    from proposals.models import Proposal
    from proposals.services import approve_proposal, propose_change
    make_limits(), make_rules()
    RefundLimits.objects.update(created_at=timezone.now() - timedelta(days=3))
    maker, checker = (User.objects.create_user(name) for name in ("fin-maker", "fin-checker"))
    for user in (maker, checker):
        call_command("grant_role", user.username, "finance approver", stdout=io.StringIO())
    proposal = propose_change(kind=Proposal.Kind.REFUND_LIMITS, subject_id="USD",
                              changes={"approval_threshold_minor": 12_345}, proposer=User.objects.get(pk=maker.pk))
    approve_proposal(proposal_id=proposal.pk, approver=User.objects.get(pk=checker.pk))
    start, end = _period()
    result = build_pack(start=start, end=end, out=tmp_path / "pack.zip", signing_key=signing[0])
    limits = next(c for c in result.controls if c.slug == "limits")
    assert limits.rows == 2 and limits.exceptions == []
    with zipfile.ZipFile(tmp_path / "pack.zip") as pack:
        rows = list(csv.DictReader(io.StringIO(pack.read("controls/limits.csv").decode())))
    assert [(r["version"], r["proposer"], r["approver"]) for r in rows][-1] == ("2", "fin-maker", "fin-checker")


def test_a_pack_for_one_merchant_leaves_out_the_others_rows(tmp_path, signing):
    seed_known_exceptions()
    other = Merchant.objects.create(name="Shop two")
    start, end = _period()
    result = build_pack(start=start, end=end, out=tmp_path / "pack.zip", signing_key=signing[0], merchant_id=other.pk)
    found = {c.slug: c.exception_count for c in result.controls if c.exception_count}
    # Limits bind every merchant and gateway events carry none: both are in every merchant's pack. No
    # drill ran. Nothing else planted is Shop two's.
    assert found == {"limits": 1, "inbound_events": 1, "revocation": 1}


def _paid_on_a_verdict_of(moment, *, currency: str, totals: dict, amount: int) -> Refund:
    verdict = Verdict.objects.create(operation="refund.create", outcome="approved", totals=totals,
                                     amount_minor=amount, currency=currency, idempotency_key=f"k-{currency}")
    Verdict.objects.filter(pk=verdict.pk).update(created_at=moment)
    refund = Refund.objects.create(payment=make_payment(amount=9_000, currency=currency), amount_minor=amount,
                                   currency=currency, reason="duplicate", verdict=verdict,
                                   idempotency_key=f"limits-then-{currency}")
    Refund.objects.filter(pk=refund.pk).update(status="settled", submitted_at=timezone.now(), settled_at=timezone.now())
    return refund


def test_paid_refunds_are_rechecked_against_the_limits_in_force_at_their_verdicts_moment(tmp_path, signing):
    """USD's limits were tight when the verdict was decided and are loose today: an exception. EUR's
    were loose then and are tight today: none. Judged by today's limits, it was the other way round."""
    now = timezone.now()
    for currency, then, today in (("USD", 1_000, 10**9), ("EUR", 10**9, 1_000)):
        for version_limit, days_ago in ((then, 3), (today, 1)):
            RefundLimits.objects.filter(pk=make_limits(currency, global_daily_amount_minor=version_limit).pk).update(
                created_at=now - timedelta(days=days_ago))
    make_rules()
    totals = {"global_day_minor": 900, "customer_day_count": 0}
    over_then = _paid_on_a_verdict_of(now - timedelta(days=2), currency="USD", totals=totals, amount=500)
    within_then = _paid_on_a_verdict_of(now - timedelta(days=2), currency="EUR", totals=totals, amount=500)
    start, end = _period()
    result = build_pack(start=start, end=end, out=tmp_path / "pack.zip", signing_key=signing[0])
    paid = next(c for c in result.controls if c.slug == "paid_refunds")
    assert [row_id for row_id, _ in paid.exceptions] == [over_then.pk]
    assert "USD limits v1, in force then: global_daily_amount_minor 1400 > 1000" in paid.exceptions[0][1]
    with zipfile.ZipFile(tmp_path / "pack.zip") as pack:
        rows = {r["refund_id"]: r for r in csv.DictReader(io.StringIO(pack.read("controls/paid_refunds.csv").decode()))}
    assert (rows[over_then.pk]["limits_in_force"], rows[within_then.pk]["limits_in_force"]) == ("v1", "v1")
    assert rows[within_then.pk]["exception"] == ""


def test_payment_links_sent_on_a_gateway_are_gateway_writes_that_need_a_verdict_and_a_key(tmp_path, signing):
    from refundops.models import PaymentLink, PaymentLinkTemplate
    make_limits(), make_rules()
    template = PaymentLinkTemplate.objects.create(name="owed", message="Pay $amount: $url")
    keyed = Verdict.objects.create(operation="payment_link.send", outcome="approved", idempotency_key="link-1")
    keyless = Verdict.objects.create(operation="payment_link.send", outcome="approved", idempotency_key="")
    on_stripe = make_payment(amount_owed_minor=1_000, processor="stripe", processor_reference="ch_links")
    sent = PaymentLink.objects.create(template=template, payment=on_stripe, amount_minor=400, currency="USD",
                                      verdict=keyed)
    without_key = PaymentLink.objects.create(template=template, payment=on_stripe, amount_minor=500, currency="USD",
                                             verdict=keyless)
    PaymentLink.objects.create(template=template, payment=make_payment(amount_owed_minor=700), amount_minor=700,
                               currency="USD", verdict=keyless)  # the sandbox's /pay page: no gateway write
    start, end = _period()
    result = build_pack(start=start, end=end, out=tmp_path / "pack.zip", signing_key=signing[0])
    writes = next(c for c in result.controls if c.slug == "gateway_writes")
    assert writes.rows == 2 and writes.exceptions == [(without_key.pk, "sent without an idempotency key")]
    with zipfile.ZipFile(tmp_path / "pack.zip") as pack:
        listed = pack.read("controls/gateway_writes.csv").decode()
    assert f"{sent.pk}," in listed and ",payment_link," in listed


def test_no_secret_of_the_platform_is_in_the_pack(tmp_path, signing):
    """Agent keys (raw and digest), a person's password hash, a TOTP key, a merchant endpoint's
    webhook secret and the signing key itself: none of them in any file of the pack."""
    from django.contrib.auth.models import User
    from django_otp.plugins.otp_totp.models import TOTPDevice
    from refundops.models import MerchantEndpoint
    from refundops.services.agents import create_agent
    make_limits(), make_rules()
    person = User.objects.create_user("finance-1", password="a-long-password-1", is_staff=True)
    device = TOTPDevice.objects.create(user=person, name="phone", confirmed=True)
    endpoint = MerchantEndpoint.objects.create(merchant=Merchant.objects.get(pk=DEFAULT_MERCHANT_ID),
                                               url="https://shop.example/hooks")
    agent, raw = create_agent(name="support bot", capabilities=["refunds.create"], actor=person)
    digest = AgentKey.objects.get(agent=agent).key_hash
    private = (tmp_path / "evidence.pem").read_bytes()
    secrets = {"raw key": raw, "key digest": digest, "password hash": person.password.split("$")[-1],
               "TOTP key": device.key, "webhook secret": endpoint.secret,
               "signing key": private.splitlines()[1].decode()}
    start, end = _period()
    build_pack(start=start, end=end, out=tmp_path / "pack.zip", signing_key=signing[0])
    with zipfile.ZipFile(tmp_path / "pack.zip") as pack:
        files = {name: pack.read(name) for name in pack.namelist()}
    assert "key.issued" in files["audit_chain_segment.csv"].decode()  # the audited paths are in it
    leaked = [(what, name) for what, value in secrets.items() for name, body in files.items()
              if value.encode() in body]
    assert leaked == []


def test_every_pack_csv_defuses_cells_a_spreadsheet_would_run(tmp_path, signing):
    """An agent's name, a caller's idempotency key: text from outside, in the pack's CSVs."""
    make_limits(), make_rules()
    agent = Agent.objects.create(name="=HYPERLINK(\"http://x.example\",\"click\")", capabilities=["refunds.create"],
                                 merchant_id=DEFAULT_MERCHANT_ID)
    Refund.objects.create(payment=make_payment(), amount_minor=100, currency="USD", reason="duplicate",
                          idempotency_key="+cmd|' /C calc'!A0", agent=agent)
    start, end = _period()
    build_pack(start=start, end=end, out=tmp_path / "pack.zip", signing_key=signing[0])
    with zipfile.ZipFile(tmp_path / "pack.zip") as pack:
        cells = [cell for name in pack.namelist() if name.endswith(".csv")
                 for row in csv.reader(io.StringIO(pack.read(name).decode())) for cell in row]
    assert "'=HYPERLINK(\"http://x.example\",\"click\")" in cells and "'+cmd|' /C calc'!A0" in cells
    assert not [cell for cell in cells if cell[:1] in ("=", "+", "@", "\t", "\r")
                or (cell[:1] == "-" and not cell.lstrip("-").replace(".", "").isdigit())]


def test_a_resubmitted_refund_is_rechecked_on_the_verdict_that_sent_it_again(tmp_path, signing):
    """A failed agent refund a person resubmits is paid on the resubmission's verdict (the refund keeps
    pointing at its first). That verdict names no agent (a person asked) and no session, though the
    policy held it to the agent's bounds: on main the pack re-checked only the first verdict and its
    over-the-limit resubmission was no exception."""
    make_limits(agent_daily_amount_minor=1_000), make_rules()
    agent, _ = make_agent_key("refunds.create")
    refund = _paid_on_a_verdict_of(timezone.now(), currency="USD",
                                   totals={"agent_day_minor": 0}, amount=500)
    Refund.objects.filter(pk=refund.pk).update(agent=agent.agent, agent_session_id="chat-9")
    Verdict.objects.filter(pk=refund.verdict_id).update(agent_id=agent.agent_id)
    Verdict.objects.create(operation="refund.resubmit", outcome="denied", refund_id=refund.pk, currency="USD",
                           totals={"agent_day_minor": 0}, staff_username="finance-1")  # refused: not the payer
    again = Verdict.objects.create(operation="refund.resubmit", outcome="approved", refund_id=refund.pk,
                                   currency="USD", totals={"agent_day_minor": 800}, staff_username="finance-1",
                                   request={"refund_id": refund.pk, "note": "card reissued"})
    start, end = _period()
    result = build_pack(start=start, end=end, out=tmp_path / "pack.zip", signing_key=signing[0])
    paid = next(c for c in result.controls if c.slug == "paid_refunds")
    assert [row_id for row_id, _ in paid.exceptions] == [refund.pk]
    assert f"its verdict {again.pk}'s totals passed USD limits v1" in paid.exceptions[0][1]
    assert "agent_daily_amount_minor 1300 > 1000" in paid.exceptions[0][1]


def test_a_verdict_at_the_very_moment_limits_changed_is_judged_by_the_new_version_and_one_before_any_by_none(
        tmp_path, signing):
    """A version is in force from its created_at, that instant included: a change of the limits takes
    the currency's lock before its row is written, so a decision made on the old version was written
    before it (refundops.locks.lock_currency). A verdict from before any limits: an exception, named."""
    moment = timezone.now() - timedelta(minutes=10)
    for bound, at in ((10**9, moment - timedelta(minutes=5)), (1_000, moment)):
        RefundLimits.objects.filter(pk=make_limits(global_daily_amount_minor=bound).pk).update(created_at=at)
    make_rules()
    at_the_change = _paid_on_a_verdict_of(moment, currency="USD", totals={"global_day_minor": 900}, amount=500)
    before_any = _paid_on_a_verdict_of(moment - timedelta(minutes=6), currency="USD", totals={}, amount=500)
    start, end = _period()
    result = build_pack(start=start, end=end, out=tmp_path / "pack.zip", signing_key=signing[0])
    paid = dict(next(c for c in result.controls if c.slug == "paid_refunds").exceptions)
    assert "limits v2, in force then: global_daily_amount_minor 1400 > 1000" in paid[at_the_change.pk]
    assert paid[before_any.pk].startswith("no USD limits were in force")


def test_person_approvals_of_paid_refunds_are_found_whatever_the_chunk_the_refunds_stream_in(
        tmp_path, signing, monkeypatch):
    """Held refunds a person approved pass, those nobody approved fail, in any chunk of the server-side
    cursor, and the CSV is the same whatever the chunk (kept while trying the approvals a chunk at a
    time: docs/PERFORMANCE.md says why that was not kept)."""
    from audit import evidence
    from audit.services import record_audit

    make_limits()
    RefundLimits.objects.update(created_at=timezone.now() - timedelta(days=3))
    payment = make_payment(amount=90_000)
    approved, unapproved = set(), set()
    for i in range(7):
        held = Verdict.objects.create(operation="refund.create", outcome="held", totals={"today": 1},
                                      idempotency_key=f"h{i}")
        refund = _paid(payment, verdict=held)
        if i % 3:
            record_audit(actor="user:approver", action="refund.approved", subject_type="refund", subject_id=refund.pk)
            approved.add(refund.pk)
        else:
            unapproved.add(refund.pk)
    start, end = _period()

    def paid_control(chunk: int):
        monkeypatch.setattr(evidence, "CHUNK", chunk)
        out = tmp_path / f"pack-{chunk}.zip"
        result = build_pack(start=start, end=end, out=out, signing_key=signing[0])
        with zipfile.ZipFile(out) as pack:
            paid_csv = pack.read("controls/paid_refunds.csv")
        return next(c for c in result.controls if c.slug == "paid_refunds"), paid_csv

    small, small_csv = paid_control(2)
    large, large_csv = paid_control(2_000)
    assert {row_id for row_id, _ in small.exceptions} == unapproved and small.rows == 7
    assert all("no person approved" in why for _, why in small.exceptions)
    assert small_csv == large_csv
    rows = {r["refund_id"]: r for r in csv.DictReader(io.StringIO(small_csv.decode()))}
    assert {rid for rid, r in rows.items() if r["approved_by_person"] == "yes"} == approved


@pytest.mark.django_db(transaction=True)
def test_the_packs_verify_audit_runs_in_processes_and_says_what_one_process_says(tmp_path, signing, monkeypatch):
    from audit import evidence, parallel
    from tests.test_audit_chain import as_table_owner, sql, write_sealed

    monkeypatch.setattr(parallel, "MIN_ENTRIES", 0)
    runs: list[dict] = []
    monkeypatch.setattr(parallel, "observe", runs.append)
    write_sealed(12)
    start, end = _period()

    def says(processes: int) -> str:
        monkeypatch.setattr(evidence, "default_processes", lambda: processes)
        result = build_pack(start=start, end=end, out=tmp_path / "pack.zip", signing_key=signing[0])
        return result.manifest["audit_chain_heads"]["verify_audit"]

    assert says(2) == "ok" and runs[-1]["ranges"] == 2
    with as_table_owner():
        sql("UPDATE audit_auditentry SET actor = 'user:mallory' WHERE seq = 10")
    one = says(1)
    assert one.startswith("does not verify: entry #10 was altered after it was written (entry id ")
    assert says(2) == one and runs[-1] == {"ranges": 2, "taken": 2, "checked_here_from": None}


# Timestamps only written to a CSV are spelled by PostgreSQL (audit.evidence.IsoText): the same text
# csv_cell writes for the datetime Django reads, or the pack's bytes would change with the speed-up.
@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(moment=hypothesis.strategies.datetimes(
    min_value=datetime(1000, 1, 1), max_value=datetime(9998, 12, 31), timezones=hypothesis.strategies.sampled_from(
        [UTC, ZoneInfo("America/New_York"), ZoneInfo("Asia/Kolkata"), ZoneInfo("Pacific/Chatham")])))
def test_postgresqls_spelling_of_a_timestamp_is_csv_cells_of_the_datetime_django_reads(moment):
    from django.db import connection

    from audit.evidence import ISO_UTC_SQL

    with connection.cursor() as cursor:
        cursor.execute(f"SELECT %s::timestamptz, {ISO_UTC_SQL.format(x='%s::timestamptz')}", [moment] * 4)
        read, spelled = cursor.fetchone()
    assert spelled == csv_cell(read)


def test_the_packs_timestamp_cells_are_spelled_as_before_through_the_orm():
    from django.db.models import DateTimeField, Value

    from audit.evidence import IsoText, _iso

    moments = [datetime(2026, 10, 1, tzinfo=UTC), datetime(2026, 12, 31, 23, 59, 59, 999_999, tzinfo=UTC),
               datetime(2026, 11, 1, 6, 30, 0, 1, tzinfo=UTC)]
    for index, moment in enumerate(moments):
        verdict = Verdict.objects.create(operation="refund.check", outcome="approved",
                                         idempotency_key=f"iso-{index}")
        Verdict.objects.filter(pk=verdict.pk).update(created_at=moment)
    rows = Verdict.objects.filter(idempotency_key__startswith="iso-").values_list("created_at", _iso("created_at"))
    assert sorted(spelled for _, spelled in rows) == sorted(csv_cell(read) for read, _ in rows)
    assert all(type(spelled) is str for _, spelled in rows)
    nothing = Verdict.objects.annotate(t=IsoText(Value(None, output_field=DateTimeField()))).values_list("t")[:1]
    assert [t for (t,) in nothing] == [None]  # a NULL stays NULL: csv_cell writes ""


@pytest.mark.django_db(transaction=True)
def test_the_whole_pack_reads_one_snapshot_and_progress_is_written_between_its_stages(tmp_path, signing):
    """Every control counts the moment the pack began: a verdict committed while it is being built (here by
    the progress callback, on the connection the admin's progress uses) is in no control's CSV. The
    progress writes themselves go through: the stages' read-only transactions are not around them."""
    from audit.models import EvidencePack

    start, end = _period()
    before = Verdict.objects.create(operation="refund.check", outcome="approved", idempotency_key="snap-before")
    pack = EvidencePack.objects.create(requested_by="auditor", first_day=start.date(), last_day=end.date())
    steps: list[str] = []

    def progress(step: str) -> None:
        EvidencePack.objects.filter(pk=pack.pk).update(step=step, steps_done=len(steps))  # a write, committed
        if step == "Capabilities used":  # after the verdicts' CSV, before capability_use reads the verdicts
            Verdict.objects.create(operation="refund.check", outcome="approved", agent_id="ag_late",
                                   idempotency_key="snap-late")
        steps.append(step)

    build_pack(start=start, end=end, out=tmp_path / "pack.zip", signing_key=signing[0], progress=progress)
    with zipfile.ZipFile(tmp_path / "pack.zip") as archive:
        verdicts = archive.read("controls/verdicts.csv").decode()
        used = archive.read("controls/capability_use.csv").decode()
    assert before.pk in verdicts
    late = Verdict.objects.get(idempotency_key="snap-late")
    assert late.pk not in used and late.pk not in verdicts
    pack.refresh_from_db()
    assert pack.step == "summary.pdf" and pack.steps_done == len(steps) - 1


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("processes", [1, 2])
def test_the_packs_verify_audit_judges_the_entries_the_pack_lists(tmp_path, signing, monkeypatch, processes):
    """verify_audit's sentence is about the chain in the pack's snapshot, not about the table a moment
    later: an entry altered when the snapshot is taken and put back before the walk reads it is listed
    altered in audit_chain_segment.csv, so the pack must not say "ok" (it did: the walk read what was
    committed, beside the snapshot). In one process and in two."""
    import threading

    from audit import evidence, parallel
    from tests.test_audit_chain import as_table_owner, sql, write_sealed

    monkeypatch.setattr(parallel, "MIN_ENTRIES", 0)
    monkeypatch.setattr(evidence, "default_processes", lambda: processes)
    runs: list[dict] = []
    monkeypatch.setattr(parallel, "observe", runs.append)
    write_sealed(12)
    start, end = _period()
    taken = threading.Event()
    real_snapshot, real_verify = evidence._Snapshot.__init__, evidence.verify_chain

    def snapshot_of_an_altered_entry(self):
        with as_table_owner():
            sql("UPDATE audit_auditentry SET actor = 'user:mallory' WHERE seq = 5")
        real_snapshot(self)
        with as_table_owner():
            sql("UPDATE audit_auditentry SET actor = 'user:alice' WHERE seq = 5")  # put back
        taken.set()

    def verify_after_the_snapshot(*args, **kwargs):
        assert taken.wait(30)
        return (yield from real_verify(*args, **kwargs))

    original_actor = AuditEntry.objects.get(seq=5).actor
    monkeypatch.setattr(evidence._Snapshot, "__init__", snapshot_of_an_altered_entry)
    monkeypatch.setattr(evidence, "verify_chain", verify_after_the_snapshot)
    result = build_pack(start=start, end=end, out=tmp_path / "pack.zip", signing_key=signing[0])
    with zipfile.ZipFile(tmp_path / "pack.zip") as archive:
        segment = list(csv.DictReader(io.StringIO(archive.read("audit_chain_segment.csv").decode())))
    assert original_actor == "user:alice"
    assert [r["actor"] for r in segment if r["seq"] == "5"] == ["user:mallory"]  # what the pack lists
    says = result.manifest["audit_chain_heads"]["verify_audit"]
    assert says.startswith("does not verify: entry #5 was altered after it was written"), says
    # in two processes, the range holding #5 read the snapshot itself (no walk here in its place)
    assert runs == ([] if processes == 1 else [{"ranges": 2, "taken": 1, "checked_here_from": None}])
