"""Dispute evidence: an agent drafts it, only a person submits it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from django.core.exceptions import PermissionDenied
from django.db import transaction
from django.utils import timezone

from audit.services import record_audit
from refundops.answers import Answer
from refundops.callers import Caller
from refundops.errors import ApiError
from refundops.inputs import AgentContext, ValidationFailed, agent_context, reject_unknown, require_object, text
from processors.base import DisputeSubmission, ProcessorDeclined, ProcessorError, ProcessorUnavailable
from processors.registry import UnknownProcessor, get_processor
from refundops.models import Dispute, DisputeEvidenceDraft, Payment
from refundops.services.payments import approve, failed, guarded_operation, passed, refuse
from refundops.services.refunds import verdict_json

DRAFT = "dispute.draft"
EVIDENCE_LIMIT = 20_000  # characters per field; Stripe's own evidence text fields allow 20,000


@dataclass(frozen=True)
class EvidenceInput:
    texts: dict[str, str]
    agent: AgentContext


def _parse_evidence(data: Any) -> EvidenceInput:
    data = require_object(data)
    reject_unknown(data, (*DisputeEvidenceDraft.TEXT_FIELDS, "agent"))
    texts = {name: text(data, name, max_length=EVIDENCE_LIMIT) for name in DisputeEvidenceDraft.TEXT_FIELDS}
    if not any(value.strip() for value in texts.values()):
        raise ValidationFailed("summary", "draft at least one of " + ", ".join(DisputeEvidenceDraft.TEXT_FIELDS))
    return EvidenceInput(texts=texts, agent=agent_context(data))


def draft_dispute_evidence(*, caller: Caller, dp_id: str, data: Any, idempotency_key: str) -> Answer:
    """``POST disputes/{dp_id}/evidence-drafts``: a draft for a person to review and submit."""
    return guarded_operation(caller=caller, operation=DRAFT, data=data, idempotency_key=idempotency_key,
                             path={"dp_id": dp_id}, parse=_parse_evidence,
                             decide=lambda ask, base: (_decide(caller=caller, dp_id=dp_id, ask=ask, base=base), None))


def _decide(*, caller: Caller, dp_id: str, ask: EvidenceInput, base: dict[str, Any]) -> Answer:
    disputes = Dispute.objects.select_for_update(of=("self",)).select_related("payment").filter(pk=dp_id)
    if caller.merchant_id:  # another merchant's dispute is as absent as one that does not exist
        disputes = disputes.filter(payment__merchant_id=caller.merchant_id)
    dispute = disputes.first()
    if dispute is None:
        return refuse(base, "DISPUTE_NOT_FOUND", f"No dispute {dp_id!r}; dispute ids start with 'dp_'.")
    base = {**base, "payment_id": dispute.payment_id, "amount_minor": dispute.amount_minor,
            "currency": dispute.currency}
    now = timezone.now()
    check = passed("dispute_open", status=dispute.status,
                   evidence_due_by=dispute.evidence_due_by.isoformat() if dispute.evidence_due_by else None)
    why_not = (f"it is {dispute.status}" if dispute.status != Dispute.Status.OPEN else
               f"evidence was due by {dispute.evidence_due_by:%Y-%m-%d %H:%M %Z}"
               if dispute.evidence_due_by and dispute.evidence_due_by <= now else "")
    if why_not:
        return refuse(base, "DISPUTE_NOT_OPEN", f"Dispute {dispute.pk} takes no more evidence: {why_not}.",
                      checks=[failed(check)])
    verdict = approve(base, checks=[check])
    draft = DisputeEvidenceDraft.objects.create(dispute=dispute, drafted_by=caller.agent, verdict=verdict,
                                                **ask.texts)
    record_audit(actor=caller.label, action="dispute.evidence_drafted", subject_type="dispute",
                 subject_id=dispute.pk, data={"verdict_id": verdict.id, "draft_id": draft.pk})
    return Answer(201, {"draft": draft_json(draft), "dispute": dispute_json(dispute),
                        "verdict": verdict_json(verdict), "deduplicated": False})


def dispute_json(dispute: Dispute) -> dict[str, Any]:
    return {"id": dispute.pk, "transaction_id": dispute.payment_id, "status": dispute.status,
            "reason": dispute.reason, "amount": dispute.amount_minor, "currency": dispute.currency,
            "evidence_due_by": dispute.evidence_due_by.isoformat() if dispute.evidence_due_by else None}


def draft_json(draft: DisputeEvidenceDraft) -> dict[str, Any]:
    return {"id": draft.pk, "dispute_id": draft.dispute_id, "status": draft.status,
            **{name: getattr(draft, name) for name in DisputeEvidenceDraft.TEXT_FIELDS},
            "created_at": draft.created_at.isoformat()}


def submit_dispute_evidence(*, draft_id: str, user: Any) -> DisputeEvidenceDraft:
    """A staff member submits a draft (after reading it) to the dispute's gateway; agents cannot
    reach this. Decided and committed first, the gateway called outside any lock, its answer then
    recorded: submitted, refused (the gateway's code and words; a person may try again), or not
    answered (the draft waits, and the next submission is the same request at the gateway)."""
    draft = _start_submission(draft_id=draft_id, user=user)
    answer: DisputeSubmission | None = None
    failure: ProcessorError | None = None
    try:
        answer = _send_evidence(draft)
    except ProcessorError as exc:
        failure = exc
    except UnknownProcessor as exc:
        failure = ProcessorUnavailable(str(exc), code="not_configured")
    return _finish_submission(draft_id=draft.pk, user=user, answer=answer, failure=failure)


@transaction.atomic
def _start_submission(*, draft_id: str, user: Any) -> DisputeEvidenceDraft:
    if not (user.is_active and user.is_staff):
        raise PermissionDenied("Only staff submit dispute evidence.")
    draft = (DisputeEvidenceDraft.objects.select_for_update(of=("self",)).select_related("dispute__payment")
             .filter(pk=draft_id).first())
    if draft is None:
        raise ApiError("DISPUTE_NOT_FOUND", f"No evidence draft {draft_id!r}.")
    if draft.status == DisputeEvidenceDraft.Status.SUBMITTED:
        raise ApiError("DISPUTE_NOT_OPEN", f"Draft {draft.pk} was already submitted.")
    if draft.status == DisputeEvidenceDraft.Status.SUBMITTING:
        raise ApiError("DISPUTE_NOT_OPEN", f"Draft {draft.pk} is being submitted right now.")
    if draft.dispute.status != Dispute.Status.OPEN:
        raise ApiError("DISPUTE_NOT_OPEN", f"Dispute {draft.dispute_id} is {draft.dispute.status}.")
    draft.status, draft.submitted_by, draft.submitted_at = (DisputeEvidenceDraft.Status.SUBMITTING, user,
                                                            timezone.now())
    draft._history_user, draft._change_reason = user, "submitting"
    draft.save()
    return draft


def _send_evidence(draft: DisputeEvidenceDraft) -> DisputeSubmission:
    dispute, payment = draft.dispute, draft.dispute.payment
    if payment.processor == Payment.Processor.SANDBOX:  # the sandbox keeps no disputes to answer
        return DisputeSubmission(dispute_id=dispute.processor_dispute_id or dispute.pk, status="submitted")
    processor = get_processor(payment.processor, payment.processor_account)
    if not hasattr(processor, "submit_dispute_evidence") or not dispute.processor_dispute_id:
        raise ProcessorDeclined(f"{payment.processor} dispute {dispute.pk} cannot take evidence through RefundOps",
                                code="evidence_unsupported")
    return processor.submit_dispute_evidence(
        dispute.processor_dispute_id, {name: getattr(draft, name) for name in DisputeEvidenceDraft.TEXT_FIELDS},
        idempotency_key=f"refundops:{draft.pk}:{draft.submit_attempts}")


@transaction.atomic
def _finish_submission(*, draft_id: str, user: Any, answer: DisputeSubmission | None,
                       failure: ProcessorError | None) -> DisputeEvidenceDraft:
    draft = DisputeEvidenceDraft.objects.select_for_update(of=("self",)).select_related("dispute__payment").get(
        pk=draft_id)
    gateway = draft.dispute.payment.processor
    if answer is not None:
        draft.status, action = DisputeEvidenceDraft.Status.SUBMITTED, "dispute.evidence_submitted"
        draft.gateway_response = {"gateway": gateway, "dispute_id": answer.dispute_id, "status": answer.status}
    else:
        assert failure is not None
        final = isinstance(failure, ProcessorDeclined)
        draft.gateway_response = {"gateway": gateway, "error": failure.code, "message": failure.message}
        if final:
            draft.status, action = DisputeEvidenceDraft.Status.FAILED, "dispute.evidence_refused"
            draft.submit_attempts += 1  # a new submission is a new request
        else:
            draft.status, action = DisputeEvidenceDraft.Status.DRAFT, "dispute.evidence_unanswered"
            draft.submitted_by, draft.submitted_at = None, None
    draft._history_user, draft._change_reason = user, action.split(".")[-1]
    draft.save()
    record_audit(actor=f"user:{user.get_username()}", action=action, subject_type="dispute",
                 subject_id=draft.dispute_id, data={"draft_id": draft.pk, "verdict_id": draft.verdict_id,
                                                    "gateway": draft.gateway_response})
    return draft
