"""The auditors' evidence pack: for a period, one section and one CSV per control of an agent on a
payment gateway (the controls are those an auditor asks evidence for: seed 004), the controls in
force with who proposed and approved each version, the audit chain's segment with its heads, and a
``manifest.json`` of every file's SHA-256 signed with an Ed25519 key whose public half the auditor
keeps, so the pack verifies without our database (``verify_pack``, examples/verify_evidence_pack.py).

The pack runs checks, it does not only report: a row that fails one is an exception, listed by id
in the summary and marked in its CSV; nothing is left out because it failed. Rows stream from
server-side cursors (``.iterator()``) straight into the ZIP, so memory stays flat for any period.
"""

from __future__ import annotations

import base64
import hashlib
import json
import threading
import zipfile
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, time, timedelta
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import psycopg
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from django.db import connection, connections
from django.db.models import Exists, F, Func, OuterRef, Q, TextField
from django.db.models.functions import Cast
from django.template.loader import render_to_string
from django.utils import timezone

from audit import parallel, verify_worker
from audit.chain import GENESIS, Head, check_snapshot_id, read_only_snapshot, seal, verify_chain
from audit.exports import csv_lines
from audit.models import AuditEntry, Verdict
from audit.parallel import default_processes

CHUNK = 2_000  # rows per round trip of a server-side cursor
LISTED_EXCEPTIONS = 200  # by id in the summary per control; every one is in the control's CSV
MANIFEST, SIGNATURE = "manifest.json", "manifest.sig"

# The capability each guarded operation needs (refundops.api.views, refundops.mcp_server).
OPERATION_CAPABILITY = {
    "refund.create": "refunds.create", "refund.check": "refunds.create",
    "payment.void": "authorizations.void", "payment.capture": "payments.capture",
    "payment_link.send": "payment_links.send", "dispute.draft": "disputes.draft",
}
PAID_STATES = ("submitted", "settled")
ELSEWHERE = "DESTINATION_NOT_ALLOWED"
DRILL_ACTION = "revocation.drill"
INSTALLED_BY = "migration"  # hold rules v1, seeded at install (refundops migration 0007): no person's change
REVOCATION_ACTIONS = ("key.revoked", "capability.revoked", DRILL_ACTION)


@dataclass
class Control:
    """One section of the summary and its CSV."""

    slug: str
    title: str
    evidence: str  # what seed 004 asks for
    rows: int = 0
    exceptions: list[tuple[str, str]] = field(default_factory=list)  # (id, why), the first LISTED_EXCEPTIONS
    exception_count: int = 0
    verdict: str = ""  # the plain sentence, filled in once the rows are counted
    notes: list[str] = field(default_factory=list)

    @property
    def csv_name(self) -> str:
        return f"controls/{self.slug}.csv"

    def note_exception(self, row_id: Any, why: str) -> str:
        self.exception_count += 1
        if len(self.exceptions) < LISTED_EXCEPTIONS:
            self.exceptions.append((str(row_id), why))
        return why


@dataclass
class Period:
    start: datetime
    end: datetime  # exclusive
    merchant_id: str | None = None


def period_of_days(first: date, last: date) -> Period:
    """Whole UTC days, ``last`` included: [first 00:00, the day after last 00:00)."""
    if last >= date.max:  # the end is the next midnight, which no date holds
        raise ValueError(f"{last} has no next day: end the period before {date.max}")
    return Period(datetime.combine(first, time.min, UTC), datetime.combine(last + timedelta(days=1), time.min, UTC))


@dataclass
class PackResult:
    path: Path
    controls: list[Control]
    manifest: dict[str, Any]
    manifest_sha256: str

    @property
    def exception_count(self) -> int:
        return sum(c.exception_count for c in self.controls)


# -- signing ------------------------------------------------------------------------------------

def new_signing_key(path: Path) -> bytes:
    """Write a new Ed25519 private key (PEM, mode 0600) to ``path``; return its public half (PEM)."""
    key = Ed25519PrivateKey.generate()
    path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                       serialization.NoEncryption()))
    path.chmod(0o600)
    return public_pem(key)


def public_pem(key: Ed25519PrivateKey) -> bytes:
    return key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def load_signing_key(path: str | Path) -> Ed25519PrivateKey:
    key = serialization.load_pem_private_key(Path(path).read_bytes(), password=None)
    if not isinstance(key, Ed25519PrivateKey):
        raise ValueError(f"{path} holds a {type(key).__name__}, not an Ed25519 private key")
    return key


# -- the checks ---------------------------------------------------------------------------------

# A timestamp only written to a CSV, spelled by PostgreSQL as csv_cell spells the datetime Django reads
# (``isoformat()`` in UTC: microseconds only when there are some): no datetime built and formatted in
# Python for each of a quarter's rows. tests/test_evidence_pack.py checks the spellings agree.
ISO_UTC_SQL = ("to_char({x} AT TIME ZONE 'UTC', 'YYYY-MM-DD\"T\"HH24:MI:SS') || CASE WHEN "
               "date_part('microseconds', {x} AT TIME ZONE 'UTC')::bigint %% 1000000 = 0 THEN '' "
               "ELSE to_char({x} AT TIME ZONE 'UTC', '.US') END || '+00:00'")


class IsoText(Func):
    """A timestamp as the text ``csv_cell`` writes for it (NULL stays NULL); PostgreSQL only."""

    output_field = TextField()

    def as_postgresql(self, compiler, connection, **extra):
        sql, params = compiler.compile(self.source_expressions[0])
        return ISO_UTC_SQL.format(x=f"({sql})"), [*params, *params, *params]


def _json_text(name: str) -> Cast | F:
    """A JSON column read as its text, decoded by ``_loads``: the value Django's JSONField gives."""
    return Cast(F(name), TextField()) if connection.vendor == "postgresql" else F(name)


def _loads(text: Any) -> Any:
    """The value of a column read by ``_json_text``: ``json.loads``'s, by orjson where it is the same
    (audit.verify_worker.json_loads, tested against json.loads in test_audit_walk.py); ~5x faster."""
    return verify_worker.json_loads(text) if type(text) is str else text


def _iso(name: str) -> IsoText | F:
    """``name`` for a CSV cell: spelled by PostgreSQL, or read as a datetime elsewhere (csv_cell spells it)."""
    return IsoText(F(name)) if connection.vendor == "postgresql" else F(name)


def _in_period(period: Period, name: str) -> Q:
    return Q(**{f"{name}__gte": period.start, f"{name}__lt": period.end})


def _verdicts(period: Period):
    verdicts = Verdict.objects.filter(_in_period(period, "created_at"))
    if period.merchant_id:
        from refundops.models import Agent, Payment
        verdicts = verdicts.filter(Q(payment_id__in=Payment.objects.filter(merchant_id=period.merchant_id).values("pk"))
                                   | Q(agent_id__in=Agent.objects.filter(merchant_id=period.merchant_id).values("pk")))
    return verdicts


def _agents(period: Period):
    from refundops.models import Agent
    agents = Agent.objects.all()
    return agents.filter(merchant_id=period.merchant_id) if period.merchant_id else agents


def _capabilities_over_time(period: Period) -> dict[str, list[tuple[datetime, set[str]]]]:
    """Each agent's capability sets, oldest first, from its history (one small row per change)."""
    from refundops.models import Agent
    held: dict[str, list[tuple[datetime, set[str]]]] = {}
    rows = Agent.history.filter(history_date__lt=period.end).order_by("history_date", "history_id")
    if period.merchant_id:
        rows = rows.filter(merchant_id=period.merchant_id)
    for agent_id, at, caps, kind in rows.values_list("id", "history_date", "capabilities", "history_type").iterator(
            chunk_size=CHUNK):
        held.setdefault(agent_id, []).append((at, set() if kind == "-" else set(caps or [])))
    return held


def _held_at(history: list[tuple[datetime, set[str]]], at: datetime) -> set[str] | None:
    held = None
    for changed_at, caps in history:
        if changed_at > at:
            break
        held = caps
    return held


def capability_list(period: Period, control: Control) -> tuple[list[str], Iterable[list[Any]]]:
    from refundops.models import Capability
    approved = set(Capability.values)

    def rows():
        for agent in _agents(period).order_by("pk").iterator(chunk_size=CHUNK):
            outside = sorted(set(agent.capabilities) - approved)
            why = control.note_exception(agent.pk, f"holds {', '.join(outside)}, outside the approved list") if outside else ""
            control.rows += 1
            yield [agent.pk, agent.name, agent.merchant_id, " ".join(sorted(agent.capabilities)), agent.is_active, why]
    return ["agent_id", "name", "merchant", "capabilities", "active", "exception"], rows()


def capability_use(period: Period, control: Control) -> tuple[list[str], Iterable[list[Any]]]:
    """No agent used a capability it was not granted at that moment, or one outside the approved list."""
    history = _capabilities_over_time(period)
    calls = (_verdicts(period).exclude(agent_id="").filter(outcome__in=("approved", "held"), deduplicated=False)
             .order_by("created_at", "pk"))

    def rows():
        for vid, at, op, agent_id, key, outcome in calls.values_list(
                "pk", "created_at", "operation", "agent_id", "key_prefix", "outcome").iterator(chunk_size=CHUNK):
            needed = OPERATION_CAPABILITY.get(op)
            held = _held_at(history.get(agent_id, []), at)
            why = ""
            if needed is None:
                why = control.note_exception(vid, f"operation {op} is not on the approved capability list")
            elif held is None or needed not in held:
                why = control.note_exception(vid, f"agent {agent_id} did not hold {needed} at {at.isoformat()}")
            control.rows += 1
            yield [vid, at, op, needed or "", agent_id, key, outcome, why]
    return ["verdict_id", "at", "operation", "capability", "agent_id", "key_prefix", "outcome", "exception"], rows()


def key_scope(period: Period, control: Control) -> tuple[list[str], Iterable[list[Any]]]:
    from refundops.models import AgentKey
    keys = AgentKey.objects.filter(created_at__lt=period.end).filter(Q(revoked_at__isnull=True)
                                                                       | Q(revoked_at__gte=period.start))
    if period.merchant_id:
        keys = keys.filter(agent__merchant_id=period.merchant_id)
    control.notes.append("Keys are stored as their SHA-256 only; the key itself is shown once, when issued, "
                         "and the gateway's own credentials stay in the platform's environment, never with an agent.")

    def rows():
        for key in keys.select_related("agent").order_by("pk").iterator(chunk_size=CHUNK):
            stored_as_digest = len(key.key_hash) == 64 and all(c in "0123456789abcdef" for c in key.key_hash)
            why = "" if stored_as_digest else control.note_exception(key.prefix, "the key is not stored as a SHA-256 digest")
            control.rows += 1
            yield [key.prefix, key.agent_id, " ".join(sorted(key.agent.capabilities)), key.created_at,
                   key.expires_at, key.revoked_at, "sha256 digest" if stored_as_digest else "other", why]
    return ["key_prefix", "agent_id", "scope", "created_at", "expires_at", "revoked_at", "stored_as", "exception"], rows()


def _approvals(kind: str) -> dict[str, tuple[str, str, Any]]:
    from proposals.models import Proposal
    found = {}
    for result_id, proposer, approver, at in (Proposal.objects.filter(kind=kind, status="approved")
                                              .values_list("result_id", "proposed_by__username",
                                                           "decided_by__username", "decided_at")):
        found[result_id] = (proposer, approver, at)
    return found


def _versions(period: Period, control: Control, model, kind: str, series: Callable[[Any], str]):
    """Every version in force at some moment of the period, with proposer and approver; a version
    that took effect in the period without a second person's approval is an exception."""
    approved = _approvals(kind)
    control.notes.append("These bounds bind every merchant: a pack for one merchant lists them all.")
    rows_in = model.objects.filter(created_at__lt=period.end).order_by("created_at", "pk")

    def rows():
        for row in rows_in.iterator(chunk_size=CHUNK):
            proposer, approver, decided_at = approved.get(str(row.pk), (row.created_by, "", None))
            why = ""
            if not approver and row.created_at >= period.start and row.created_by != INSTALLED_BY:
                why = control.note_exception(f"{series(row)} v{row.version}",
                                             "took effect without a proposal approved by a second person")
            control.rows += 1
            values = {f.attname: getattr(row, f.attname) for f in model._meta.concrete_fields}
            yield [series(row), row.version, row.created_at, proposer, approver, decided_at,
                   json.dumps(values, default=str, sort_keys=True), why]
    return ["series", "version", "in_force_from", "proposer", "approver", "approved_at", "values", "exception"], rows()


def limits(period: Period, control: Control):
    from refundops.models import RefundLimits
    return _versions(period, control, RefundLimits, "refund_limits", lambda r: f"{r.currency} limits")


def hold_rules(period: Period, control: Control):
    from refundops.models import HoldRules
    return _versions(period, control, HoldRules, "hold_rules", lambda r: "hold rules")


def capabilities_and_authorities(period: Period, control: Control):
    """Every version of an agent's capabilities and of a person's approval authority in force at some
    moment of the period, with who changed it and why (a proposal and its approver, or a revocation)."""
    from approvals.models import ApprovalAuthority
    from refundops.models import Agent
    agents = Agent.history.filter(history_date__lt=period.end)
    if period.merchant_id:
        agents = agents.filter(merchant_id=period.merchant_id)
    authorities = ApprovalAuthority.history.filter(history_date__lt=period.end)
    control.notes.append("A revocation takes effect in one step by an operator; a grant or a new authority "
                         "goes through a proposal a second person approves, named in the change reason.")

    def rows():
        for agent_id, at, kind, caps, active, user, reason in agents.order_by("history_date", "history_id").values_list(
                "id", "history_date", "history_type", "capabilities", "is_active", "history_user__username",
                "history_change_reason").iterator(chunk_size=CHUNK):
            control.rows += 1
            yield ["agent capabilities", agent_id, at, kind, " ".join(sorted(caps or [])), active, user, reason]
        for pk, at, kind, username, currency, limit, active, by, reason in authorities.order_by(
                "history_date", "history_id").values_list(
                "id", "history_date", "history_type", "user__username", "currency", "max_amount_minor", "is_active",
                "history_user__username", "history_change_reason").iterator(chunk_size=CHUNK):
            control.rows += 1
            yield ["approval authority", f"{username} {currency}", at, kind, limit, active, by, reason]
    return ["control", "subject", "from", "change", "value", "active", "changed_by", "why"], rows()


def verdict_per_call(period: Period, control: Control):
    """Every call's verdict; a refund decision (not refused before the checks) records the running
    totals it saw."""
    def rows():
        for v in _verdicts(period).order_by("created_at", "pk").values_list(
                "pk", _iso("created_at"), "operation", "outcome", "code", "agent_id", "key_prefix", "staff_username",
                "idempotency_key", "payment_id", "refund_id", "amount_minor", "currency", "policy_version",
                _json_text("totals"), "dry_run", "deduplicated").iterator(chunk_size=CHUNK):
            v = (*v[:14], _loads(v[14]), *v[15:])
            why = ""
            if (v[2] == "refund.create" and v[3] in ("approved", "held") and not v[15] and not v[16]
                    and not v[14]):
                why = control.note_exception(v[0], "a refund decision without the running totals it saw")
            control.rows += 1
            yield [*v[:16], why]
    return ["verdict_id", "at", "operation", "outcome", "code", "agent_id", "key_prefix", "staff", "idempotency_key",
            "payment_id", "refund_id", "amount_minor", "currency", "policy_version", "totals", "dry_run",
            "exception"], rows()


def gateway_writes(period: Period, control: Control):
    """Every call to a gateway that may move money carries a verdict reference and an idempotency key."""
    from refundops.models import GatewayAttempt, Payment, PaymentLink, PaymentOperation
    attempts = GatewayAttempt.objects.filter(_in_period(period, "started_at"))
    operations = PaymentOperation.objects.filter(_in_period(period, "created_at"))
    # A link on the sandbox is our own /pay page; on any other gateway, sending one creates it there.
    links = PaymentLink.objects.filter(_in_period(period, "sent_at")).exclude(
        payment__processor=Payment.Processor.SANDBOX)
    if period.merchant_id:
        attempts = attempts.filter(refund__payment__merchant_id=period.merchant_id)
        operations = operations.filter(payment__merchant_id=period.merchant_id)
        links = links.filter(payment__merchant_id=period.merchant_id)

    def rows():
        for aid, at, refund_id, verdict_id, key, outcome in attempts.order_by("started_at", "pk").values_list(
                "pk", _iso("started_at"), "refund_id", "refund__verdict_id", "idempotency_key", "outcome").iterator(
                chunk_size=CHUNK):
            yield _write(control, aid, at, "refund", refund_id, verdict_id, key, outcome)
        for oid, at, kind, payment_id, verdict_id, key, status in operations.order_by("created_at", "pk").values_list(
                "pk", _iso("created_at"), "kind", "payment_id", "verdict_id", "verdict__idempotency_key",
                "status").iterator(chunk_size=CHUNK):
            yield _write(control, oid, at, kind, payment_id, verdict_id, key, status)
        for lid, at, payment_id, verdict_id, key, status in links.order_by("sent_at", "pk").values_list(
                "pk", _iso("sent_at"), "payment_id", "verdict_id", "verdict__idempotency_key", "status").iterator(
                chunk_size=CHUNK):
            yield _write(control, lid, at, "payment_link", payment_id, verdict_id, key, status)
    return ["write_id", "at", "kind", "subject_id", "verdict_id", "idempotency_key", "outcome", "exception"], rows()


def _write(control: Control, wid, at, kind, subject, verdict_id, key, outcome) -> list[Any]:
    missing = [what for what, value in (("a verdict", verdict_id), ("an idempotency key", key)) if not value]
    why = control.note_exception(wid, f"sent without {' and '.join(missing)}") if missing else ""
    control.rows += 1
    return [wid, at, kind, subject, verdict_id or "", key, outcome, why]


def one_refund_per_key(period: Period, control: Control):
    """No duplicate refunds for one idempotency key: each caller's key made at most one refund."""
    from refundops.models import Refund
    refunds = Refund.objects.filter(_in_period(period, "created_at")).exclude(idempotency_key="")
    if period.merchant_id:
        refunds = refunds.filter(payment__merchant_id=period.merchant_id)

    def rows():
        previous = None
        for rid, at, agent_id, user_id, key in refunds.order_by(
                "agent_id", "requested_by_id", "idempotency_key", "created_at", "pk").values_list(
                "pk", _iso("created_at"), "agent_id", "requested_by_id", "idempotency_key").iterator(chunk_size=CHUNK):
            scope = (agent_id, user_id, key)
            why = ""
            if previous and previous[0] == scope:
                why = control.note_exception(rid, f"a second refund for the key {key!r} (the first: {previous[1]})")
            else:
                previous = (scope, rid)
            control.rows += 1
            yield [rid, at, agent_id or "", user_id or "", key, why]
    return ["refund_id", "created_at", "agent_id", "staff_user_id", "idempotency_key", "exception"], rows()


# The running-total bounds a refund decision is held to (refundops.policy._check_running_totals), as
# (limit field, total the verdict saw, whose bound: everyone, agents, or an agent's session). Restated
# here, not imported: the pack re-checks the recorded figures against the recorded limits by itself.
AMOUNT_BOUNDS = (
    ("customer_daily_amount_minor", "customer_day_minor", "all"),
    ("customer_30d_amount_minor", "customer_30d_minor", "all"),
    ("global_daily_amount_minor", "global_day_minor", "all"),
    ("agent_hourly_amount_minor", "agent_hour_minor", "agent"),
    ("agent_daily_amount_minor", "agent_day_minor", "agent"),
    ("session_amount_minor", "session_minor", "session"),
)
COUNT_BOUNDS = (("customer_daily_count", "customer_day_count"), ("customer_30d_count", "customer_30d_count"))


def _limits_over_time() -> dict[str, list[tuple[datetime, int, dict[str, int]]]]:
    """Each currency's limits versions, oldest first: (in force from, version, bounds)."""
    from refundops.models import RefundLimits
    fields = [f for f, _, _ in AMOUNT_BOUNDS] + [f for f, _ in COUNT_BOUNDS]
    versions: dict[str, list[tuple[datetime, int, dict[str, int]]]] = {}
    for row in RefundLimits.objects.order_by("currency", "created_at", "version").values(
            "currency", "created_at", "version", *fields):
        versions.setdefault(row["currency"], []).append((row["created_at"], row["version"],
                                                         {f: row[f] for f in fields}))
    return versions


def _in_force(versions: list[tuple[datetime, int, dict[str, int]]], at: datetime):
    found = None
    for since, version, bounds in versions:
        if since > at:
            break
        found = (version, bounds)
    return found


def over_limits_in_force(*, totals: dict, amount: int, bounds: dict[str, int], by_agent: bool,
                         session: bool) -> list[str]:
    """The bounds a decision's recorded totals plus its amount passed, for the limits then in force."""
    applies = {"all": True, "agent": by_agent, "session": by_agent and session}
    over = [f"{field} {totals.get(seen, 0) + amount} > {bounds[field]}" for field, seen, whose in AMOUNT_BOUNDS
            if applies[whose] and totals.get(seen, 0) + amount > bounds[field]]
    over += [f"{field} {totals.get(seen, 0) + 1} > {bounds[field]}" for field, seen in COUNT_BOUNDS
             if totals.get(seen, 0) + 1 > bounds[field]]
    return over


RESUBMIT = "refund.resubmit"  # refundops.services.refunds.RESUBMIT: a person sends a failed refund again


def paid_refunds(period: Period, control: Control):
    """Every refund paid in the period has an approving verdict (approved, or held and approved by a
    person with the authority), no check of that verdict failed, and the running totals it recorded
    plus its amount were within the limits version in force at the verdict's moment (not today's).
    The verdict is the one that last let the refund go: a resubmission's, when a person sent a failed
    refund again (the refund keeps pointing at its first), else the first. The agent and session
    bounds apply by the refund's own agent and session: a resubmission is asked by a person, yet the
    policy held it to the agent's bounds."""
    from django.db.models import Subquery
    from django.db.models.functions import JSONObject
    from django.utils.dateparse import parse_datetime

    from refundops.models import Refund
    limits = _limits_over_time()
    approved_by_person = AuditEntry.objects.filter(action="refund.approved", subject_type="refund",
                                                   subject_id=OuterRef("pk"))
    resubmitted = (Verdict.objects.filter(operation=RESUBMIT, refund_id=OuterRef("pk")).exclude(outcome="denied")
                   .order_by("-created_at", "-pk").values(last=JSONObject(
                       id="pk", outcome="outcome", checks="checks", totals="totals", at="created_at"))[:1])
    refunds = (Refund.objects.filter(status__in=PAID_STATES).filter(_in_period(period, "submitted_at"))
               .annotate(person_approved=Exists(approved_by_person), resubmission=Subquery(resubmitted))
               .order_by("submitted_at", "pk"))
    if period.merchant_id:
        refunds = refunds.filter(payment__merchant_id=period.merchant_id)

    def rows():
        for *r, decided_at, agent_id, session_id, again in refunds.values_list(
                "pk", _iso("submitted_at"), "status", "origin", "amount_minor", "currency", "verdict_id",
                "verdict__outcome", _json_text("verdict__checks"), _json_text("verdict__totals"), "person_approved",
                "verdict__created_at", "agent_id", "agent_session_id", "resubmission").iterator(chunk_size=CHUNK):
            r[8:10] = _loads(r[8]), _loads(r[9])
            if again:
                r[6:10] = again["id"], again["outcome"], again["checks"], again["totals"]
                decided_at = parse_datetime(again["at"])
            rid, _, _, origin, amount, currency, verdict_id, outcome, checks, totals, by_person = r
            in_force = _in_force(limits.get(currency, []), decided_at) if verdict_id else None
            failed = [c.get("name", "?") for c in (checks or []) if isinstance(c, dict) and c.get("result") == "fail"]
            why = ""
            if not verdict_id:
                why = "paid without a verdict"
            elif outcome == "held" and not by_person:
                why = f"paid on a held verdict ({verdict_id}) that no person approved"
            elif outcome not in ("approved", "held"):
                why = f"paid on a {outcome} verdict ({verdict_id})"
            elif failed:
                why = f"its verdict {verdict_id} records failed checks: {', '.join(failed)}"
            elif in_force is None:
                why = f"no {currency} limits were in force when its verdict {verdict_id} was decided"
            elif over := over_limits_in_force(totals=totals or {}, amount=amount, bounds=in_force[1],
                                              by_agent=bool(agent_id), session=bool(session_id)):
                why = (f"its verdict {verdict_id}'s totals passed {currency} limits v{in_force[0]}, in force then: "
                       f"{'; '.join(over)}")
            if why:
                control.note_exception(rid, why)
            control.rows += 1
            yield [*r[:8], "yes" if by_person else "no", totals, f"v{in_force[0]}" if in_force else "", why]
    return ["refund_id", "submitted_at", "status", "origin", "amount_minor", "currency", "verdict_id", "verdict_outcome",
            "approved_by_person", "totals", "limits_in_force", "exception"], rows()


def inbound_events(period: Period, control: Control):
    """The signature check's result for every gateway event; one that changed money passed it."""
    from processors.models import InboundEvent
    control.notes.append("Gateway events carry no merchant; a pack for one merchant lists every event.")

    def rows():
        for e in InboundEvent.objects.filter(_in_period(period, "received_at")).order_by("received_at", "pk").values_list(
                "pk", _iso("received_at"), "processor", "event_id", "type", "object_id", "verified",
                "verification_error", _iso("applied_at"), "outcome").iterator(chunk_size=CHUNK):
            why = ""
            if e[8] is not None and not e[6]:
                why = control.note_exception(e[0], "applied (it may have moved money) without a valid signature")
            control.rows += 1
            yield [*e, why]
    return ["inbound_event_id", "received_at", "processor", "event_id", "type", "object_id", "signature_verified",
            "verification_error", "applied_at", "outcome", "exception"], rows()


def refund_elsewhere(period: Period, control: Control):
    """Attempts to refund to another card or account were refused; none was let through."""
    asked = _verdicts(period).filter(operation__in=("refund.create", "refund.check")).filter(
        Q(code=ELSEWHERE) | (Q(request__has_key="destination") & ~Q(request__destination="original_method"))
        | (Q(request__body__has_key="destination") & ~Q(request__body__destination="original_method")))

    def rows():
        for vid, at, agent_id, outcome, code in asked.order_by("created_at", "pk").values_list(
                "pk", _iso("created_at"), "agent_id", "outcome", "code").iterator(chunk_size=CHUNK):
            why = "" if outcome == "denied" else control.note_exception(
                vid, f"a refund to another destination was {outcome}, not refused")
            control.rows += 1
            yield [vid, at, agent_id, outcome, code, why]
    return ["verdict_id", "at", "agent_id", "outcome", "code", "exception"], rows()


def refund_void_separate(period: Period, control: Control):
    """Refund and void (reversal) are separate capabilities on every agent's key."""
    from refundops.models import Capability
    approved = set(Capability.values)
    control.notes.append(f"Refunds need {Capability.REFUNDS_CREATE}; voids (reversals before capture) need "
                         f"{Capability.AUTHORIZATIONS_VOID}. One never grants the other.")

    def rows():
        for agent in _agents(period).order_by("pk").iterator(chunk_size=CHUNK):
            caps = set(agent.capabilities)
            broad = sorted(caps - approved)
            why = control.note_exception(agent.pk, f"holds {', '.join(broad)}, which is neither refund nor void "
                                                   f"alone") if broad else ""
            control.rows += 1
            yield [agent.pk, Capability.REFUNDS_CREATE in caps, Capability.AUTHORIZATIONS_VOID in caps, why]
    return ["agent_id", "may_refund", "may_void", "exception"], rows()


def revocation(period: Period, control: Control):
    """Revocations and drill results; a failed drill, or none at all in the period, is an exception."""
    entries = AuditEntry.objects.filter(_in_period(period, "created_at"), action__in=REVOCATION_ACTIONS)
    drills = {"count": 0}

    def rows():
        for seq, at, action, actor, subject, data in entries.order_by("created_at", "pk").values_list(
                "seq", _iso("created_at"), "action", "actor", "subject_id", "data").iterator(chunk_size=CHUNK):
            why = ""
            if action == DRILL_ACTION:
                drills["count"] += 1
                if not data.get("passed"):
                    why = control.note_exception(f"#{seq}", "the drill let a call through after revocation")
            control.rows += 1
            yield [seq if seq is not None else "unsealed", at, action, actor, subject, data, why]
        if not drills["count"]:
            control.note_exception("-", "no revocation drill was run in the period (manage.py revocation_drill)")
    return ["audit_seq", "at", "action", "actor", "subject_id", "data", "exception"], rows()


CONTROLS: list[tuple[str, str, str, Callable]] = [
    ("capability_list", "Approved capability list", "the approved list with depths, per agent", capability_list),
    ("key_scope", "Restricted keys", "each key's scope and where it is stored", key_scope),
    ("limits", "Refund limits", "limits as versioned bounds, with proposer and approver", limits),
    ("hold_rules", "Hold rules", "rules as versioned bounds, with proposer and approver", hold_rules),
    ("capabilities_and_authorities", "Capabilities and approval authorities in force",
     "each version of an agent's capabilities and of a person's refund authority, with who changed it",
     capabilities_and_authorities),
    ("verdicts", "A verdict per call, with running totals", "the verdict of every call and the totals it saw",
     verdict_per_call),
    ("capability_use", "Capabilities used", "no capability outside the approved list was used", capability_use),
    ("gateway_writes", "Gateway writes", "a verdict reference and an idempotency key on each write", gateway_writes),
    ("idempotency", "Idempotency", "no duplicate refunds for one key", one_refund_per_key),
    ("paid_refunds", "Refunds paid", "an approving verdict for every refund paid", paid_refunds),
    ("inbound_events", "Gateway events", "the signature check result per event", inbound_events),
    ("refund_elsewhere", "Refunds to the original method only", "refused verdicts on attempts to refund elsewhere",
     refund_elsewhere),
    ("refund_void_separate", "Refunds are not reversals", "separate capabilities for refund and void",
     refund_void_separate),
    ("revocation", "Revocation", "drill results and revocations", revocation),
]


def _sentence(control: Control) -> str:
    if control.exception_count > control.rows:  # an absence (no drill at all) counts without a row
        return f"Exceptions: {control.exception_count}, listed below."
    if control.exception_count:
        return (f"Exceptions: {control.exception_count} of {control.rows} rows fail this control; each is listed "
                f"below by id and marked in {control.csv_name}.")
    return f"Held: all {control.rows} rows pass this control; no exception."


# -- the audit chain's segment ------------------------------------------------------------------

def _head_before(moment: datetime) -> Head:
    last = (AuditEntry.objects.filter(seq__isnull=False, created_at__lt=moment).order_by("-seq")
            .values_list("seq", "hash").first())
    return Head(*last) if last else Head(0, GENESIS)


class _ChainWalk:
    """``verify_audit``'s walk of the whole chain (in as many processes as there are cores), what it
    says as the summary's sentence, and its exception if any. Beside the CSV stages in a thread of its
    own (its own connection and processes, each importing the pack's snapshot: the sentence is about
    the rows the pack lists, not the table a moment later) when the pack is built outside a transaction
    on PostgreSQL; else here, when the chain's stage asks for it (a test's transaction: only this
    connection sees its rows)."""

    def __init__(self, snapshot: str | None):
        self.verified, self.bad, self.thread, self.error = "not run", None, None, None
        self.snapshot = snapshot  # the pack's: the walk judges the rows the pack lists
        if snapshot is not None and parallel.usable(2):
            self.thread = threading.Thread(target=self._in_thread, name="evidence-pack-chain-walk", daemon=True)
            self.thread.start()

    def _in_thread(self) -> None:
        try:
            self._walk()
        except BaseException as exc:  # raised again by the pack's own thread, in result()
            self.error = exc
        finally:
            connections.close_all()  # this thread's connections only

    def _walk(self) -> None:
        for _, bad, why in verify_chain(processes=default_processes(), snapshot=self.snapshot):
            if why and why != "ok":
                self.verified = f"does not verify: {why}" + (f" (entry id {bad.pk})" if bad is not None else "")
                self.bad = f"#{bad.seq}" if bad is not None and bad.seq else "chain"
            elif why == "ok":
                self.verified = "ok"

    def result(self) -> tuple[str, str | None]:
        if self.thread is None:
            self._walk()
        else:
            self.thread.join()
            if self.error is not None:
                raise self.error
        return self.verified, self.bad


def chain_segment(period: Period, control: Control, walk: _ChainWalk):
    """The sealed entries of the period in chain order; the heads at both ends; what verify_audit says.
    The chain was sealed before the pack's snapshot was taken (build_pack): its heads are read in it."""
    start, end = _head_before(period.start), _head_before(period.end)
    # The segment is the seq range between the heads: an entry sealed in that range is in it even when
    # its clock reads otherwise (the sealer orders by id, not by time).
    segment = AuditEntry.objects.filter(seq__gt=start.seq, seq__lte=end.seq).order_by("seq")
    verified, bad = walk.result()
    if bad is not None:
        control.note_exception(bad, verified)
    if unsealed := AuditEntry.objects.filter(seq__isnull=True, created_at__lt=period.end).count():
        control.notes.append(f"{unsealed} entries of the period were not sealed yet when the pack was built.")
    control.notes.append(f"Head at the start: {start}; head at the end: {end}; verify_audit says: {verified}.")
    heads = {"start": str(start), "end": str(end), "verify_audit": verified}

    def rows():
        for row in segment.values_list("seq", _iso("created_at"), "actor", "action", "subject_type", "subject_id",
                                       _json_text("data"), _json_text("records"), "mac", "prev_hash", "hash").iterator(
                                           chunk_size=CHUNK):
            control.rows += 1
            yield (*row[:6], _loads(row[6]), _loads(row[7]), *row[8:])
    return heads, ["seq", "created_at", "actor", "action", "subject_type", "subject_id", "data", "records", "mac",
                   "prev_hash", "hash"], rows()


class _Snapshot:
    """One snapshot for the whole pack, and each stage read in a transaction of its own on it.

    A connection of its own holds a read-only REPEATABLE READ transaction open and exports its
    snapshot (``pg_export_snapshot``); each stage imports it in a read-only transaction on the
    default connection. So every control counts the same moment, and inside a transaction Django's
    ``.iterator()`` declares its server-side cursor without ``WITH HOLD``: rows stream as PostgreSQL
    finds them, instead of the whole result being computed and stored at the implicit commit before
    the first row. Between stages the default connection is free for the caller's progress writes
    (the admin's pack row). ``work_mem`` is 64 MB in each stage, and ``jit`` is off: PostgreSQL
    compiled each large query for seconds (5.0 s of a 10.7 s query at 200,000 refunds,
    docs/PERFORMANCE.md) that then ran once.
    Inside a transaction already (a test's), or not on PostgreSQL, stages run as they are."""

    def __init__(self):
        self.holder, self.id = None, None
        if connection.vendor == "postgresql" and not connection.in_atomic_block:
            self.holder = psycopg.connect(parallel.conninfo(), autocommit=True)
            self.holder.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            self.id = self.holder.execute("SELECT pg_export_snapshot()").fetchone()[0]
            check_snapshot_id(self.id)  # early: each stage spells it into SET TRANSACTION SNAPSHOT

    @contextmanager
    def stage(self):
        if self.id is None:
            yield
            return
        with read_only_snapshot(self.id), connection.cursor() as cursor:
            cursor.execute("SET LOCAL jit = off")
            # Refunds paid hashes a quarter's verdicts and sorts ~1M rows: in 64 batches and on disk at
            # the default 4 MB (39 s for the query at 1,000,000 refunds), in 4 batches at 64 MB (22 s).
            cursor.execute("SET LOCAL work_mem = '64MB'")
            yield

    def close(self) -> None:
        if self.holder is not None:
            self.holder.close()


# -- the pack -----------------------------------------------------------------------------------

def _product_version() -> str:
    try:
        return version("refundops")
    except PackageNotFoundError:
        return "unknown"


class _Hashed:
    """The ZIP member being written, with its SHA-256 kept as it goes."""

    def __init__(self, archive: zipfile.ZipFile, name: str, digests: dict[str, str]):
        self.name, self.digests = name, digests
        self.member = archive.open(name, "w", force_zip64=True)
        self.sha = hashlib.sha256()

    def write_all(self, chunks: Iterable[bytes]) -> None:
        for chunk in chunks:
            self.sha.update(chunk)
            self.member.write(chunk)
        self.member.close()
        self.digests[self.name] = self.sha.hexdigest()


def build_pack(*, start: datetime, end: datetime, out: str | Path, signing_key: Ed25519PrivateKey,
               merchant_id: str | None = None, progress: Callable[[str], None] = lambda step: None) -> PackResult:
    """Write the evidence pack for [start, end) to ``out``; return what each control found."""
    period, out = Period(start, end, merchant_id), Path(out)
    digests: dict[str, str] = {}
    controls: list[Control] = []
    seal()  # as audit_head does: what is committed (verdicts too) is in the chain before its heads are read
    snapshot = _Snapshot()
    walk = _ChainWalk(snapshot.id)  # reads the snapshot too, in its own transactions (the holder's is open)
    try:
        with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED) as archive:
            for slug, title, evidence, check in CONTROLS:
                progress(title)
                control = Control(slug, title, evidence)
                with snapshot.stage():
                    header, rows = check(period, control)
                    _Hashed(archive, control.csv_name, digests).write_all(csv_lines(header, rows))
                control.verdict = _sentence(control)
                controls.append(control)
            progress("Audit chain")
            chain = Control("audit_chain", "Full log: the audit chain", "the record of every call, key, amount, "
                            "verdict and gateway response")
            with snapshot.stage():
                heads, header, rows = chain_segment(period, chain, walk)
                _Hashed(archive, "audit_chain_segment.csv", digests).write_all(csv_lines(header, rows))
            snapshot.close()
            chain.verdict = _sentence(chain).replace(chain.csv_name, "audit_chain_segment.csv")
            controls.append(chain)
            manifest, body = _summary_and_manifest(archive, digests, controls, heads, period, signing_key, progress)
    finally:
        snapshot.close()
        if walk.thread is not None:
            walk.thread.join()  # a failure above: the walk's workers end before the pack's error is raised
    return PackResult(out, controls, manifest, hashlib.sha256(body).hexdigest())


def _summary_and_manifest(archive: zipfile.ZipFile, digests: dict[str, str], controls: list[Control],
                          heads: dict[str, str], period: Period, signing_key: Ed25519PrivateKey,
                          progress: Callable[[str], None]) -> tuple[dict[str, Any], bytes]:
    """summary.html and .pdf, then the manifest of every file, signed; the manifest and its bytes."""
    start, end, merchant_id = period.start, period.end, period.merchant_id
    summary = render_to_string("audit/evidence_summary.html", {
            "start": start, "end": end, "merchant": merchant_id or "every merchant", "controls": controls,
            "heads": heads, "version": _product_version(), "built_at": timezone.now(),
        "exceptions": sum(c.exception_count for c in controls)})
    _Hashed(archive, "summary.html", digests).write_all([summary.encode()])
    progress("summary.pdf")
    _Hashed(archive, "summary.pdf", digests).write_all([summary_pdf(summary)])
    manifest = {"format": "refundops-evidence-pack/1", "period": {"from": start.isoformat(), "to": end.isoformat()},
                "merchant": merchant_id, "product_version": _product_version(),
                "built_at": timezone.now().isoformat(), "audit_chain_heads": heads,
                "exceptions": {c.slug: c.exception_count for c in controls},
                "files": dict(sorted(digests.items()))}
    body = json.dumps(manifest, sort_keys=True, indent=2).encode()
    archive.writestr(MANIFEST, body)
    archive.writestr(SIGNATURE, base64.b64encode(signing_key.sign(body)) + b"\n")
    return manifest, body


def summary_pdf(summary_html: str) -> bytes:
    """The summary as a PDF, laid out by WeasyPrint (Pango underneath; no browser). The summary lists
    at most LISTED_EXCEPTIONS ids per control, so it stays a few pages for any period."""
    from weasyprint import HTML  # loads Pango: only when a pack is built

    return HTML(string=summary_html).write_pdf()


# -- verifying ------------------------------------------------------------------------------------

def verify_pack(path: str | Path, public_key_pem: bytes) -> list[str]:
    """What is wrong with the pack at ``path``: an empty list when its manifest's signature holds and
    no file was added, removed or changed. Mirrors examples/verify_evidence_pack.py."""
    public = serialization.load_pem_public_key(public_key_pem)
    if not isinstance(public, Ed25519PublicKey):
        return ["the public key is not an Ed25519 key"]
    problems: list[str] = []
    with zipfile.ZipFile(path) as archive:
        names = archive.namelist()
        if len(names) != len(set(names)):
            problems.append("a file name appears twice in the ZIP")
        if MANIFEST not in names or SIGNATURE not in names:
            return [*problems, f"{MANIFEST} or {SIGNATURE} is missing"]
        body = archive.read(MANIFEST)
        try:
            public.verify(base64.b64decode(archive.read(SIGNATURE)), body)
        except (InvalidSignature, ValueError):
            return [*problems, f"the signature of {MANIFEST} does not verify with this public key"]
        listed = json.loads(body)["files"]
        for name in sorted(set(names) - set(listed) - {MANIFEST, SIGNATURE}):
            problems.append(f"{name} was added")
        for name, digest in sorted(listed.items()):
            if name not in names:
                problems.append(f"{name} was removed")
            elif _sha256_of(archive, name) != digest:
                problems.append(f"{name} was changed")
    return problems


def _sha256_of(archive: zipfile.ZipFile, name: str) -> str:
    """A member's SHA-256, read in chunks: a quarter's CSV need not fit in memory."""
    digest = hashlib.sha256()
    with archive.open(name) as member:
        while chunk := member.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()
