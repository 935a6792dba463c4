"""Maker-checker for every control: a change to refund limits, hold rules, approval authorities,
payment-link templates, agent capabilities, merchant endpoints or a merchant's settings is proposed by one person and
takes effect only when a different person with the same right approves it. Both names, the
diff and the times are in the audit chain.

The right to propose or approve a kind of change is the ``change`` permission of the control's
model (``roles.definitions``). Taking access away (kill switch, revoking a key or a capability)
stays one step for one person; see ``refundops.services.agents``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from django.core.exceptions import ValidationError
from django.db import IntegrityError, connection, transaction
from django.utils import timezone

from approvals.models import ApprovalAuthority
from audit.services import record_audit
from proposals.models import Proposal
from refundops.locks import advisory_key, lock_currency
from refundops.models import Agent, HoldRules, Merchant, MerchantEndpoint, PaymentLinkTemplate, RefundLimits
from refundops.services import agents

K = Proposal.Kind


class ProposalError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


@dataclass(frozen=True)
class Control:
    """How one kind of control is read, checked and changed."""

    permission: str
    fields: tuple[str, ...]
    current: Callable[[str], dict[str, Any]]  # subject id -> its values now ({} when it is new)
    apply: Callable[[Proposal, Any], str]  # (proposal, approver) -> id of the row written
    summary: Callable[[str, dict[str, Any]], str]
    validate: Callable[[str, dict[str, Any]], None] = lambda subject_id, values: None
    # Beyond the right itself: who may not approve this one (e.g. their own authority).
    conflict: Callable[[Proposal, Any], str] = lambda proposal, approver: ""
    # Where a control is also written outside proposals (one person revokes a capability at once):
    # lock what those writers lock before reading the control, so the stale check sees their change.
    lock: Callable[[str], Any] = lambda subject_id: None


def _values(instance, fields) -> dict[str, Any]:
    return {f: getattr(instance, f) for f in fields}


def _full_clean(model, values: dict[str, Any], exclude: tuple[str, ...] = ()) -> None:
    try:
        model(**values).full_clean(exclude=list(exclude), validate_unique=False, validate_constraints=False)
    except ValidationError as invalid:
        raise ProposalError("PROPOSAL_INVALID", "; ".join(
            f"{field}: {' '.join(errors)}" for field, errors in invalid.message_dict.items())) from None


def proposed_values(proposal: Proposal) -> dict[str, Any]:
    """What the proposal changes: the "after" of each field in its diff, nothing else. A proposal
    stored before this rule may carry every field of the control in ``changes``; its diff still
    names only what its proposer changed, so it is read the same way."""
    return {field: after for field, (_, after) in proposal.diff.items()}


def _by(proposal: Proposal, approver) -> str:
    return f"{proposal.proposed_by.get_username()}, approved by {approver.get_username()}"[:150]


# -- versioned controls: limits (one series per currency) and hold rules -------------------------

LIMIT_FIELDS = tuple(f.name for f in RefundLimits._meta.fields
                     if f.name not in ("id", "currency", "version", "created_by", "created_at"))
RULE_FIELDS = tuple(f.name for f in HoldRules._meta.fields if f.name not in ("id", "version", "created_by", "created_at"))


def _latest(model, **series):
    return model.objects.filter(**series).order_by("-version").first()


def _apply_version(model, fields, series: dict[str, Any]):
    def apply(proposal: Proposal, approver) -> str:
        if model is RefundLimits:  # waits for the refund decisions in flight on the limits they read
            lock_currency(series(proposal)["currency"])
        latest = model.objects.select_for_update().filter(**series(proposal)).order_by("-version").first()
        values = {**(_values(latest, fields) if latest else {}), **proposed_values(proposal)}
        row = model.objects.create(**series(proposal), **values, version=(latest.version if latest else 0) + 1,
                                   created_by=_by(proposal, approver))
        return str(row.pk)
    return apply


LIMITS = Control(
    permission="refundops.change_refundlimits", fields=LIMIT_FIELDS,
    current=lambda currency: _values(latest, LIMIT_FIELDS) if (latest := _latest(RefundLimits, currency=currency)) else {},
    apply=_apply_version(RefundLimits, LIMIT_FIELDS, lambda p: {"currency": p.subject_id}),
    summary=lambda currency, values: f"{currency} refund limits",
    validate=lambda currency, values: _full_clean(RefundLimits, {"currency": currency, "version": 1, **values}))

RULES = Control(
    permission="refundops.change_holdrules", fields=RULE_FIELDS,
    current=lambda _: _values(latest, RULE_FIELDS) if (latest := _latest(HoldRules)) else {},
    apply=_apply_version(HoldRules, RULE_FIELDS, lambda p: {}),
    summary=lambda _, values: "hold rules",
    validate=lambda _, values: _full_clean(HoldRules, {"version": 1, **values}))


# -- approval authorities: subject "user_id:currency" ---------------------------------------------

def _authority(subject_id: str) -> ApprovalAuthority | None:
    user_id, _, currency = subject_id.partition(":")
    return ApprovalAuthority.objects.filter(user_id=user_id, currency=currency).first()


def _apply_authority(proposal: Proposal, approver) -> str:
    user_id, _, currency = proposal.subject_id.partition(":")
    authority, _ = ApprovalAuthority.objects.update_or_create(user_id=user_id, currency=currency,
                                                              defaults=proposed_values(proposal))
    return str(authority.pk)


def _authority_summary(subject_id: str, values: dict[str, Any]) -> str:
    from django.contrib.auth import get_user_model

    user_id, _, currency = subject_id.partition(":")
    user = get_user_model().objects.filter(pk=user_id).first()
    return f"{user.get_username() if user else user_id}'s refund authority in {currency}"


AUTHORITY = Control(
    permission="approvals.change_approvalauthority", fields=("max_amount_minor", "is_active"),
    current=lambda subject_id: _values(a, ("max_amount_minor", "is_active")) if (a := _authority(subject_id)) else {},
    apply=_apply_authority, summary=_authority_summary,
    conflict=lambda proposal, approver: ("nobody approves their own authority"
                                         if proposal.subject_id.partition(":")[0] == str(approver.pk) else ""))


# -- rows that are created or edited: link templates, merchant endpoints ---------------------------

def _row_values(model, fields):
    return lambda pk: _values(row, fields) if pk and (row := model.objects.filter(pk=pk).first()) else {}


def _refuse_taken_names(row) -> None:
    """Two proposals may each create (or rename to) the same unique name; the second to be approved
    is refused with what is taken, and changes nothing."""
    try:
        row.validate_unique()
    except ValidationError as taken:
        raise ProposalError("PROPOSAL_INVALID", "; ".join(
            f"{field} {getattr(row, field, '')!r}: {' '.join(errors)}" for field, errors in taken.message_dict.items())
            + " Reject this proposal, or propose another.") from None


def _apply_row(model, **stamp: Callable[[Proposal, Any], Any]):
    def apply(proposal: Proposal, approver) -> str:
        row = model.objects.select_for_update().get(pk=proposal.subject_id) if proposal.subject_id else model()
        for name, value in {**proposed_values(proposal), **{k: f(proposal, approver) for k, f in stamp.items()}}.items():
            setattr(row, name, value)
        row._history_user, row._change_reason = approver, f"proposal {proposal.pk} ({_by(proposal, approver)})"
        _refuse_taken_names(row)
        try:
            with transaction.atomic():  # a name taken by a commit racing this one: the constraint says so
                row.save()
        except IntegrityError:
            raise ProposalError("PROPOSAL_INVALID", f"Another {model._meta.verbose_name} took a name this proposal "
                                                    f"sets while it was being approved. Reject this proposal, or "
                                                    f"propose another name.") from None
        return str(row.pk)
    return apply


TEMPLATE_FIELDS = ("name", "message", "active")
TEMPLATE = Control(
    permission="refundops.change_paymentlinktemplate", fields=TEMPLATE_FIELDS,
    current=_row_values(PaymentLinkTemplate, TEMPLATE_FIELDS),
    # What a second person approved is what customers receive: the approver is the template's.
    apply=_apply_row(PaymentLinkTemplate, approved_by=lambda p, approver: approver,
                     approved_at=lambda p, approver: timezone.now()),
    summary=lambda pk, values: f"link template {values.get('name') or pk}",
    validate=lambda pk, values: _full_clean(PaymentLinkTemplate, values))

ENDPOINT_FIELDS = ("url", "active", "event_types", "description")
ENDPOINT = Control(
    permission="refundops.change_merchantendpoint", fields=ENDPOINT_FIELDS,
    current=_row_values(MerchantEndpoint, ENDPOINT_FIELDS), apply=_apply_row(MerchantEndpoint),
    summary=lambda pk, values: f"merchant endpoint {values.get('url') or pk}",
    validate=lambda pk, values: _full_clean(MerchantEndpoint, values, exclude=("secret",)))


MERCHANT_FIELDS = ("name", "require_session_id")
MERCHANT = Control(
    permission="refundops.change_merchant", fields=MERCHANT_FIELDS,
    current=_row_values(Merchant, MERCHANT_FIELDS), apply=_apply_row(Merchant),
    summary=lambda pk, values: f"merchant {values.get('name') or pk}",
    validate=lambda pk, values: _full_clean(Merchant, values))


# -- agent capabilities: granting needs two people, revoking one (refundops.services.agents) -------

def _apply_capabilities(proposal: Proposal, approver) -> str:
    held = set(Agent.objects.values_list("capabilities", flat=True).get(pk=proposal.subject_id))
    wanted = set(proposed_values(proposal)["capabilities"])
    # The approver acts (the history row's user); the audit entries name the proposal and its proposer.
    by = {"actor": approver, "proposal": (proposal.pk, proposal.proposed_by.get_username())}
    for capability in sorted(wanted - held):
        agents.grant_capability(agent_id=proposal.subject_id, capability=capability, **by)
    for capability in sorted(held - wanted):
        agents.revoke_capability(agent_id=proposal.subject_id, capability=capability, **by)
    return proposal.subject_id


def _validate_capabilities(agent_id: str, values: dict[str, Any]) -> None:
    try:
        agents.validate_capabilities(values.get("capabilities", []))
        agents.get_agent(agent_id)
    except agents.AgentAccessError as refused:
        raise ProposalError("PROPOSAL_INVALID", str(refused)) from None


CAPABILITIES = Control(
    permission="refundops.change_agent", fields=("capabilities",),
    current=lambda pk: {"capabilities": a.capabilities} if (a := Agent.objects.filter(pk=pk).first()) else {},
    apply=_apply_capabilities, validate=_validate_capabilities,
    lock=lambda pk: Agent.objects.select_for_update().filter(pk=pk).first(),
    summary=lambda pk, values: f"capabilities of agent {Agent.objects.filter(pk=pk).values_list('name', flat=True).first() or pk}")


CONTROLS: dict[str, Control] = {K.REFUND_LIMITS: LIMITS, K.HOLD_RULES: RULES, K.APPROVAL_AUTHORITY: AUTHORITY,
                                K.LINK_TEMPLATE: TEMPLATE, K.MERCHANT_ENDPOINT: ENDPOINT,
                                K.AGENT_CAPABILITIES: CAPABILITIES, K.MERCHANT: MERCHANT}


# -- the three operations ----------------------------------------------------------------------------

def _json(value: Any) -> Any:
    return value if value is None or isinstance(value, (str, int, float, bool, list, dict)) else str(value)


def _same(a: Any, b: Any) -> bool:
    """Equal as the control reads them: every list in a control is a set (capabilities, reasons,
    event types), so the same members in another order are no change, and no move."""
    if isinstance(a, list) and isinstance(b, list):
        return sorted(map(repr, a)) == sorted(map(repr, b))
    return a == b


def _require_right(control: Control, user, verb: str) -> None:
    if not user.has_perm(control.permission):
        raise ProposalError("PROPOSAL_NOT_AUTHORIZED", f"{user.get_username()} may not {verb} this kind of change.")


@transaction.atomic
def propose_change(*, kind: str, subject_id: str = "", changes: dict[str, Any], proposer, note: str = "") -> Proposal:
    control = CONTROLS[kind]
    _require_right(control, proposer, "propose")
    unknown = set(changes) - set(control.fields)
    if unknown:
        raise ProposalError("PROPOSAL_INVALID", f"Not part of this control: {', '.join(sorted(unknown))}.")
    before = control.current(subject_id)
    asked = {k: _json(v) for k, v in changes.items()}
    # Only what differs from the control now: a form posts every field, and carrying the others
    # would write them back over a change approved in between (issue 28).
    diff = {k: [_json(before.get(k)), v] for k, v in asked.items() if not _same(_json(before.get(k)), v)}
    if not diff:
        raise ProposalError("NOTHING_TO_CHANGE", "That is how it is already.")
    changes = {k: after for k, (_, after) in diff.items()}
    control.validate(subject_id, {**before, **asked})
    proposal = Proposal.objects.create(kind=kind, subject_id=subject_id, changes=changes, diff=diff, note=note[:500],
                                       summary=control.summary(subject_id, {**before, **changes})[:200],
                                       proposed_by=proposer)
    record_audit(actor=f"user:{proposer.get_username()}", action="proposal.created", subject_type="proposal",
                 subject_id=proposal.pk, data={"kind": kind, "subject_id": subject_id, "summary": proposal.summary,
                                               "diff": diff, "note": proposal.note,
                                               "proposed_by": proposer.get_username(),
                                               "proposed_at": proposal.proposed_at.isoformat()})
    return proposal


def _decidable(proposal_id: str, person, verb: str) -> tuple[Proposal, Control]:
    proposal = Proposal.objects.select_for_update().select_related("proposed_by").filter(pk=proposal_id).first()
    if proposal is None:
        raise ProposalError("PROPOSAL_NOT_FOUND", f"No proposal {proposal_id!r}.")
    if proposal.status != Proposal.Status.PENDING:
        raise ProposalError("PROPOSAL_DECIDED", f"Proposal {proposal.pk} is already {proposal.status}.")
    if proposal.proposed_by_id == person.pk:
        raise ProposalError("PROPOSAL_OWN", "Nobody decides their own proposal: a second person must.")
    control = CONTROLS[proposal.kind]
    _require_right(control, person, verb)
    return proposal, control


def _decided(proposal: Proposal, *, person, status: str, note: str) -> dict[str, Any]:
    proposal.status, proposal.decided_by, proposal.decided_at = status, person, timezone.now()
    proposal.decision_note = note[:500]
    proposal.save()
    return {"kind": proposal.kind, "subject_id": proposal.subject_id, "summary": proposal.summary,
            "diff": proposal.diff, "note": proposal.note, "decision_note": proposal.decision_note,
            "proposed_by": proposal.proposed_by.get_username(), "proposed_at": proposal.proposed_at.isoformat(),
            "decided_by": person.get_username(), "decided_at": proposal.decided_at.isoformat()}


def _lock_subject(proposal: Proposal) -> None:
    """Approvals of one control wait for each other, so each reads the control, to check it is not
    stale, after the one before it committed: else two approved at once both pass the check and the
    second writes over the first's change unseen (or takes the same version: a 500). A key per
    control and subject, as the row may not exist yet. SQLite lets one writer in at a time."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)",
                           [advisory_key("proposal", proposal.kind, proposal.subject_id)])


def approve_proposal(*, proposal_id: str, approver, note: str = "") -> Proposal:
    """Put a pending proposal in effect: only the fields in its diff, and only while each still has
    the value its proposer saw. One whose fields moved since is refused as stale (PROPOSAL_STALE):
    nothing is applied, it stays pending for a person to reject, and the refusal is audited."""
    with transaction.atomic():
        proposal, control = _decidable(proposal_id, approver, "approve")
        conflict = control.conflict(proposal, approver)
        if conflict:
            raise ProposalError("PROPOSAL_OWN", f"{approver.get_username()} may not approve this: {conflict}.")
        _lock_subject(proposal)
        control.lock(proposal.subject_id)
        now = control.current(proposal.subject_id)
        moved = {k: [before, _json(now.get(k))] for k, (before, _) in proposal.diff.items()
                 if not _same(_json(now.get(k)), before)}
        if not moved:
            proposal.result_id = control.apply(proposal, approver)
            data = _decided(proposal, person=approver, status=Proposal.Status.APPROVED, note=note)
            record_audit(actor=f"user:{approver.get_username()}", action="proposal.approved",
                         subject_type="proposal", subject_id=proposal.pk,
                         data={**data, "result_id": proposal.result_id})
            return proposal
    # Recorded after the proposal's row lock is let go, in a transaction of its own (the caller's
    # when there is one), so the refusal stays on record though nothing was applied.
    with transaction.atomic():
        record_audit(actor=f"user:{approver.get_username()}", action="proposal.refused_stale",
                     subject_type="proposal", subject_id=proposal.pk,
                     data={"kind": proposal.kind, "subject_id": proposal.subject_id, "summary": proposal.summary,
                           "diff": proposal.diff, "moved": moved, "proposed_by": proposal.proposed_by.get_username(),
                           "refused_by": approver.get_username()})
    raise ProposalError("PROPOSAL_STALE", f"{', '.join(moved)} changed since this was proposed; "
                                          f"reject it and propose again from what is there now.")


@transaction.atomic
def reject_proposal(*, proposal_id: str, approver, note: str = "") -> Proposal:
    proposal, _ = _decidable(proposal_id, approver, "decide")
    data = _decided(proposal, person=approver, status=Proposal.Status.REJECTED, note=note)
    record_audit(actor=f"user:{approver.get_username()}", action="proposal.rejected", subject_type="proposal",
                 subject_id=proposal.pk, data=data)
    return proposal
