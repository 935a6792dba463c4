"""Draft policy versions: written, backtested, run in shadow, then promoted or dropped.

A draft never binds. Promoting one is a proposal (``proposals``): it takes effect when a second
person with the same right approves it, as any change to the limits or hold rules does. Each step
is one call and one audit entry.
"""

from __future__ import annotations

from typing import Any

from django.db import transaction
from django.db.models.signals import post_save
from django.dispatch import receiver

from audit.services import record_audit
from proposals.models import Proposal
from proposals.services import CONTROLS, ProposalError, propose_change
from refundops.models import HoldRules, PolicyDraft, RefundLimits

K = PolicyDraft.Kind
PROPOSAL_KIND = {K.LIMITS: Proposal.Kind.REFUND_LIMITS, K.RULES: Proposal.Kind.HOLD_RULES}
MODEL = {K.LIMITS: RefundLimits, K.RULES: HoldRules}


class DraftError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def _control(kind: str):
    return CONTROLS[PROPOSAL_KIND[kind]]


def draft_fields(kind: str) -> tuple[str, ...]:
    return tuple(f for f in _control(kind).fields if f != "note")  # the draft has a note of its own


def _require(person, kind: str) -> None:
    if not person.has_perm(_control(kind).permission):
        raise DraftError("DRAFT_NOT_AUTHORIZED", f"{person.get_username()} may not change "
                                                 f"{'refund limits' if kind == K.LIMITS else 'hold rules'}.")


def _validate(kind: str, currency: str, values: dict[str, Any]) -> None:
    unknown = set(values) - set(draft_fields(kind))
    if unknown:
        raise DraftError("DRAFT_INVALID", f"Not part of {kind}: {', '.join(sorted(unknown))}.")
    try:
        _control(kind).validate(currency, values)
    except ProposalError as invalid:
        raise DraftError("DRAFT_INVALID", invalid.message) from None
    # full_clean checks what each field converts the value to; a draft is replayed and shadowed with the
    # value as written (a float limit, a "0" that is truthy): it must already be what a saved row reads.
    model = MODEL[kind]
    for name, value in values.items():
        if name == "allowed_reasons":
            exact = isinstance(value, list) and all(type(r) is str for r in value)
        elif name == "reason_thresholds":
            exact = isinstance(value, dict) and all(type(v) is int for v in value.values())
        else:
            kept = model._meta.get_field(name).to_python(value)
            exact = type(kept) is type(value) and kept == value
        if not exact:
            raise DraftError("DRAFT_INVALID", f"{name}: {value!r} is not a value of this field as saved "
                                              f"(whole minor units, true or false, reasons as text).")


def _get(draft_id: str, *, lock: bool = True) -> PolicyDraft:
    drafts = PolicyDraft.objects.select_for_update() if lock else PolicyDraft.objects
    draft = drafts.filter(pk=draft_id).first()
    if draft is None:
        raise DraftError("DRAFT_NOT_FOUND", f"No policy draft {draft_id!r}; draft ids start with 'pd_'.")
    return draft


def _audit(person, action: str, draft: PolicyDraft, **data: Any) -> None:
    record_audit(actor=f"user:{person.get_username()}", action=f"policy_draft.{action}", subject_type="policy_draft",
                 subject_id=draft.pk, data={"kind": draft.kind, "currency": draft.currency, **data})


@transaction.atomic
def create_draft(*, kind: str, currency: str = "", changes: dict[str, Any], person, note: str = "") -> PolicyDraft:
    """A draft of the series' next version: the active version's values with ``changes``."""
    if kind not in K.values:
        raise DraftError("DRAFT_INVALID", f"kind is 'limits' or 'rules', not {kind!r}.")
    currency = currency.upper() if kind == K.LIMITS else ""
    _require(person, kind)
    if kind == K.LIMITS and not currency:
        raise DraftError("DRAFT_INVALID", "A limits draft names its currency.")
    active = _control(kind).current(currency)
    values = {f: active[f] for f in draft_fields(kind) if f in active}
    values.update(changes)
    _validate(kind, currency, values)
    draft = PolicyDraft.objects.create(kind=kind, currency=currency, values=values, note=note[:300],
                                       created_by=person.get_username())
    _audit(person, "created", draft, values=values, note=draft.note)
    return draft


@transaction.atomic
def change_draft(*, draft_id: str, changes: dict[str, Any], person) -> PolicyDraft:
    draft = _open(draft_id, person)
    values = {**draft.values, **changes}
    _validate(draft.kind, draft.currency, values)
    before, draft.values = draft.values, values
    draft.save(update_fields=["values"])
    _audit(person, "changed", draft, diff={k: [before.get(k), v] for k, v in values.items() if before.get(k) != v})
    return draft


def _open(draft_id: str, person) -> PolicyDraft:
    draft = _get(draft_id)
    _require(person, draft.kind)
    if draft.status != PolicyDraft.Status.DRAFT:
        raise DraftError("DRAFT_CLOSED", f"Draft {draft.pk} is {draft.status}; write a new draft instead.")
    return draft


@transaction.atomic
def set_shadow(*, draft_id: str, on: bool, person) -> PolicyDraft:
    """Run the draft in shadow (or stop): one shadow per series, so switching one on switches off
    any other of the same series."""
    draft = _open(draft_id, person)
    replaced = []
    if on:
        others = PolicyDraft.objects.select_for_update().filter(kind=draft.kind, currency=draft.currency,
                                                               shadow=True).exclude(pk=draft.pk)
        replaced = list(others.values_list("pk", flat=True))
        others.update(shadow=False)
    draft.shadow = on
    draft.save(update_fields=["shadow"])
    _audit(person, "shadow_on" if on else "shadow_off", draft, replaced=replaced)
    return draft


@transaction.atomic
def drop_draft(*, draft_id: str, person, note: str = "") -> PolicyDraft:
    draft = _open(draft_id, person)
    draft.status, draft.shadow = PolicyDraft.Status.DROPPED, False
    draft.save(update_fields=["status", "shadow"])
    _audit(person, "dropped", draft, note=note[:300])
    return draft


@transaction.atomic
def promote_draft(*, draft_id: str, person, note: str = "") -> Proposal:
    """Propose the draft as the series' next version; a second person's approval makes it bind.
    The proposal carries only what differs from the active version, so an approval never rewinds
    a field changed meanwhile that the draft did not touch."""
    draft = _open(draft_id, person)
    active = _control(draft.kind).current(draft.currency)
    changes = {k: v for k, v in draft.values.items() if active.get(k) != v}
    try:
        proposal = propose_change(kind=PROPOSAL_KIND[draft.kind], subject_id=draft.currency, changes=changes,
                                  proposer=person, note=(note or f"promotes draft {draft.pk}")[:500])
    except ProposalError as refused:
        raise DraftError(refused.code, refused.message) from None
    draft.status, draft.proposal_id = PolicyDraft.Status.PROPOSED, proposal.pk
    draft.save(update_fields=["status", "proposal_id"])
    _audit(person, "promoted", draft, proposal_id=proposal.pk, changes=changes)
    return proposal


@receiver(post_save, sender=Proposal, dispatch_uid="policy_draft_follows_its_proposal")
def _follow_proposal(sender, instance: Proposal, **kwargs) -> None:
    """Approved: the draft is now a version, and its shadow stops (it binds). Rejected: a draft again."""
    if instance.status == Proposal.Status.PENDING:
        return
    status = PolicyDraft.Status.PROMOTED if instance.status == Proposal.Status.APPROVED else PolicyDraft.Status.DRAFT
    changed = PolicyDraft.objects.filter(proposal_id=instance.pk, status=PolicyDraft.Status.PROPOSED)
    if status == PolicyDraft.Status.PROMOTED:
        changed.update(status=status, shadow=False)
    else:
        changed.update(status=status, proposal_id="")
