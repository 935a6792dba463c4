"""Payment operations an agent may make besides refunds: look up, void, capture, send a link.

Each answers like ``request_refund``: an :class:`Answer`, one Verdict for every call (refusals and
replays too), the idempotency key claimed in the same transaction as the decision. A gateway is
never called under a row lock: the decision commits first (a ``PaymentOperation`` or a
``PaymentLink`` that a unique constraint or the owed amount keeps single), then the gateway is
called, then its answer is recorded in a second short transaction.
"""

from __future__ import annotations

import string
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, TypeVar

from django.conf import settings
from django.db import transaction
from django.db.models import Sum
from django.utils import timezone
from django.utils.module_loading import import_string

from audit.models import Verdict
from audit.services import record_audit
from processors.base import (
    CaptureResult,
    OutcomeUnknown,
    PaymentState,
    ProcessorDeclined,
    ProcessorError,
    ProcessorUnavailable,
    VoidResult,
)
from processors.money import Money, format_minor
from processors.registry import ADAPTERS, UnknownProcessor, get_processor
from refundops import idempotency
from refundops.answers import Answer, error_answer
from refundops.callers import Caller
from refundops.errors import ApiError
from refundops.inputs import (
    AgentContext,
    ValidationFailed,
    agent_context,
    amount,
    could_be_id,
    for_the_record,
    key_problem,
    recorded_key,
    reject_unknown,
    require_object,
    text,
    unstorable,
)
from refundops.locks import lock_payment
from refundops.models import Payment, PaymentLink, PaymentLinkTemplate, PaymentOperation
from refundops.selectors import payment_json
from refundops.services.payouts import payment_ref
from refundops.services.refunds import verdict_json

VOID = "payment.void"
CAPTURE = "payment.capture"
SEND_LINK = "payment_link.send"

T = TypeVar("T")
# Run after the decision commits (the gateway call); records its answer through ``store``.
FollowUp = Callable[[Callable[[Answer], None]], Answer]


# -- the frame every guarded operation shares (disputes use it too) ---------------------------------

def verdict_base(*, caller: Caller, operation: str, data: Any, idempotency_key: str,
                 path: Mapping[str, str]) -> dict[str, Any]:
    return {"operation": operation, "idempotency_key": recorded_key(idempotency_key),
            "request": for_the_record({"path": dict(path), "body": data}), **caller.verdict_fields()}


def refuse(base: dict[str, Any], code: str, message: str, **extra: Any) -> Answer:
    """Record the refusal as a denied verdict and answer with the contract's error shape."""
    fields = {k: v for k, v in extra.items() if k in ("payment_id", "amount_minor", "currency", "checks")}
    verdict = Verdict.objects.create(**{**base, **fields}, outcome=Verdict.Outcome.DENIED, code=code,
                                     message=message)
    return error_answer(code, message, verdict_id=verdict.id,
                        **{k: v for k, v in extra.items() if k not in fields})


def approve(base: dict[str, Any], *, checks: list[dict[str, Any]], **fields: Any) -> Verdict:
    return Verdict.objects.create(**base, **fields, outcome=Verdict.Outcome.APPROVED, checks=checks)


def passed(name: str, **inputs: Any) -> dict[str, Any]:
    return {"name": name, "result": "pass", "inputs": inputs}


def guarded_operation(*, caller: Caller, operation: str, data: Any, idempotency_key: str,
                      path: Mapping[str, str], parse: Callable[[Any], T],
                      decide: Callable[[T, dict[str, Any]], tuple[Answer, FollowUp | None]],
                      settle_replay: Callable[[Answer], Answer | None] | None = None) -> Answer:
    """Body, then idempotency (a replay answers here), then ``decide`` under the caller's locks,
    all in one transaction with the key's claim; then the follow-up, if any, outside it.
    ``settle_replay``: for a first answer that was not final (an outcome unknown), the answer now,
    once settled; it replaces the stored one, so the retry learns what happened."""
    problem = unstorable(data) or unstorable(dict(path)) or unstorable(idempotency_key)
    if problem:
        message = f"body: {problem}"
        base = verdict_base(caller=caller, operation=operation, data={}, idempotency_key="", path={})
        return refuse(base, "VALIDATION_ERROR", message, field="body")
    base = verdict_base(caller=caller, operation=operation, data=data, idempotency_key=idempotency_key,
                        path=path)
    try:
        ask = parse(data)
    except ValidationFailed as failed:
        return refuse(base, "VALIDATION_ERROR", failed.message, field=failed.field)
    key_message = key_problem(idempotency_key)
    if key_message:
        return refuse(base, "IDEMPOTENCY_KEY_REQUIRED", key_message)
    # The path is part of the request: one key for two payments is two different requests.
    scope, digest = caller.idempotency_scope, idempotency.request_hash(operation, [dict(path), data])
    replay = idempotency.find(scope, idempotency_key, digest)
    if replay is not None:
        if settle_replay is not None and not replay.reused and replay.record.response_status:
            settled = settle_replay(Answer(replay.record.response_status, replay.record.response_body))
            if settled is not None:
                idempotency.store(scope, idempotency_key, settled.status, settled.body)
                replay = idempotency.find(scope, idempotency_key, digest)
        return _replay(base, replay)
    with transaction.atomic():
        replay = idempotency.claim(scope, idempotency_key, operation, digest)
        if replay.record is not None:
            return _replay(base, replay)
        answer, follow_up = decide(ask, base)
        idempotency.store(scope, idempotency_key, answer.status, answer.body)
    if follow_up is None:
        return answer
    return follow_up(lambda final: idempotency.store(scope, idempotency_key, final.status, final.body))


def _replay(base: dict[str, Any], replay: idempotency.Replay) -> Answer:
    if replay.reused:
        return refuse(base, "IDEMPOTENCY_KEY_REUSED",
                      "This Idempotency-Key was already used with a different request. Use a new key "
                      "for a new request, or resend the original request to get its answer.")
    first = Answer(replay.record.response_status, replay.record.response_body)
    Verdict.objects.create(**base, deduplicated=True, code=first.code,
                           outcome=Verdict.Outcome.APPROVED if first.ok else Verdict.Outcome.DENIED,
                           message="Replay of the first answer to this key")
    return first.deduplicated()


def gateway_failure(exc: ProcessorError | UnknownProcessor) -> tuple[str, str, str]:
    """(contract code, message, gateway code) for a gateway that said no or did not answer."""
    if isinstance(exc, ProcessorDeclined):
        return "GATEWAY_DECLINED", f"The payment gateway declined: {exc.message}", exc.code
    if isinstance(exc, ProcessorUnavailable):  # never an OutcomeUnknown: that is looked up, not answered so
        return ("GATEWAY_UNAVAILABLE", "The payment gateway could not be reached; nothing changed. Try again "
                                       "later with a new Idempotency-Key.", exc.code)
    return "GATEWAY_UNAVAILABLE", f"No gateway is configured for this payment: {exc}", "not_configured"


# -- lookups -----------------------------------------------------------------------------------------

def lookup_payment(*, txn_id: str, caller: Caller) -> dict[str, Any]:
    """``GET payments/{txn_id}``: what ``payments.read`` may see, of the caller's merchant only.
    An agent's read is recorded (who looked at which payment)."""
    payments = Payment.objects.filter(pk=txn_id)
    if caller.merchant_id:
        payments = payments.filter(merchant_id=caller.merchant_id)
    payment = payments.first() if could_be_id(txn_id) else None
    caller.record_read("payment.lookup", payment_id=payment.pk if payment else "")
    if payment is None:
        raise ApiError("PAYMENT_NOT_FOUND", f"No payment {txn_id[:40]!r}; payment ids start with 'txn_'.")
    return payment_json(payment)


# -- void and capture --------------------------------------------------------------------------------

@dataclass(frozen=True)
class OperationInput:
    amount_minor: int | None
    note: str
    agent: AgentContext


def _parse_operation(data: Any, *, with_amount: bool) -> OperationInput:
    data = require_object({} if data in (None, "") else data)
    reject_unknown(data, ("amount", "note", "agent") if with_amount else ("note", "agent"))
    return OperationInput(amount_minor=amount(data, required=True) if with_amount else None,
                          note=text(data, "note"), agent=agent_context(data))


def void_authorization(*, caller: Caller, txn_id: str, data: Any, idempotency_key: str) -> Answer:
    """``POST payments/{txn_id}/void``: release an authorisation that was never captured."""
    return guarded_operation(
        caller=caller, operation=VOID, data=data, idempotency_key=idempotency_key, path={"txn_id": txn_id},
        parse=lambda d: _parse_operation(d, with_amount=False),
        decide=lambda ask, base: _decide_operation(caller=caller, txn_id=txn_id, ask=ask, base=base,
                                                   kind=PaymentOperation.Kind.VOID),
        settle_replay=lambda first: _settle_replayed_operation(first, caller=caller))


def capture_payment(*, caller: Caller, txn_id: str, data: Any, idempotency_key: str) -> Answer:
    """``POST payments/{txn_id}/capture``: capture ``amount``, at most the confirmed order amount."""
    return guarded_operation(
        caller=caller, operation=CAPTURE, data=data, idempotency_key=idempotency_key, path={"txn_id": txn_id},
        parse=lambda d: _parse_operation(d, with_amount=True),
        decide=lambda ask, base: _decide_operation(caller=caller, txn_id=txn_id, ask=ask, base=base,
                                                   kind=PaymentOperation.Kind.CAPTURE),
        settle_replay=lambda first: _settle_replayed_operation(first, caller=caller))


class Refused(Exception):
    """A check failed: the contract code, a message the agent can act on, and the checks so far."""

    def __init__(self, code: str, message: str, *, checks: list[dict[str, Any]], **fields: Any) -> None:
        super().__init__(message)
        self.code, self.message, self.checks, self.fields = code, message, checks, fields


def failed(check: dict[str, Any]) -> dict[str, Any]:
    return {**check, "result": "fail"}


def _check_void(payment: Payment, ask: OperationInput, *, why_not: str,
                state: dict[str, Any]) -> list[dict[str, Any]]:
    check = passed("payment_voidable", **state)
    if why_not:
        raise Refused("PAYMENT_NOT_VOIDABLE", f"Payment {payment.pk} cannot be voided: {why_not}. Only an "
                      f"uncaptured authorisation can be voided; a captured payment needs a refund.",
                      checks=[failed(check)])
    return [check]


def _check_capture(payment: Payment, ask: OperationInput, *, why_not: str,
                   state: dict[str, Any]) -> list[dict[str, Any]]:
    capturable = passed("payment_capturable", **state)
    if why_not:
        raise Refused("PAYMENT_NOT_CAPTURABLE", f"Payment {payment.pk} cannot be captured: {why_not}.",
                      checks=[failed(capturable)])
    order, authorized, cur = payment.order_amount_minor, payment.amount_authorized_minor, payment.currency
    ceiling = min(order, authorized) if order is not None else 0
    within = {"name": "amount_within_order", "result": "pass", "inputs": {"amount": ask.amount_minor},
              "limit": ceiling, "observed": ask.amount_minor}
    if ask.amount_minor > ceiling:
        asked = format_minor(ask.amount_minor, cur)
        if order is None:
            message = f"Payment {payment.pk} has no confirmed order amount; a person must capture it."
        elif ceiling == order:
            message = (f"{asked} is more than the confirmed order amount {format_minor(order, cur)}; "
                       f"capturing more stays with a person.")
        else:
            message = f"{asked} is more than the {format_minor(authorized, cur)} authorised."
        raise Refused("AMOUNT_EXCEEDS_ORDER", message, checks=[capturable, failed(within)],
                      amount_minor=ask.amount_minor)
    return [capturable, within]


def _decide_operation(*, caller: Caller, txn_id: str, ask: OperationInput, base: dict[str, Any],
                      kind: str) -> tuple[Answer, FollowUp | None]:
    payment = lock_payment(txn_id, merchant_id=caller.merchant_id)
    if payment is None:
        return refuse(base, "PAYMENT_NOT_FOUND", f"No payment {txn_id!r}; payment ids start with 'txn_'.",
                      payment_id=txn_id), None
    base = {**base, "payment_id": payment.pk, "currency": payment.currency}
    live = PaymentOperation.objects.filter(payment=payment, status__in=PaymentOperation.LIVE_STATUSES).first()
    state = {"status": payment.status, "captured": payment.amount_captured_minor,
             "authorized": payment.amount_authorized_minor}
    why_not = ("it was voided" if payment.status == Payment.Status.VOIDED else
               "it is already captured" if payment.status == Payment.Status.CAPTURED
               or payment.amount_captured_minor else
               f"a {live.kind} ({live.pk}) {LIVE_WORDS[live.status]}" if live else "")
    check = _check_void if kind == PaymentOperation.Kind.VOID else _check_capture
    try:
        checks = check(payment, ask, why_not=why_not, state=state)
    except Refused as refused:
        return refuse(base, refused.code, refused.message, checks=refused.checks, **refused.fields), None
    amount_minor = ask.amount_minor  # None for a void: it releases the whole authorisation
    verdict = approve(base, checks=checks, amount_minor=amount_minor if amount_minor is not None
                      else payment.amount_authorized_minor)
    operation = PaymentOperation.objects.create(
        payment=payment, kind=kind, amount_minor=amount_minor, currency=payment.currency, agent=caller.agent,
        verdict=verdict, lease_until=timezone.now() + timedelta(seconds=settings.GATEWAY_ATTEMPT_LEASE_SECONDS))
    record_audit(actor=caller.label, action=f"payment.{kind}_decided", subject_type="payment",
                 subject_id=payment.pk, data={"verdict_id": verdict.id, "operation_id": operation.pk,
                                              "amount_minor": amount_minor, "note": ask.note})
    pending = Answer(202, _operation_body(payment, operation, verdict))

    def follow_up(store: Callable[[Answer], None]) -> Answer:
        return _call_gateway(caller=caller, operation_id=operation.pk, store=store)

    return pending, follow_up


def _operation_body(payment: Payment, operation: PaymentOperation, verdict: Verdict) -> dict[str, Any]:
    return {"payment": payment_json(payment), "operation": operation_json(operation),
            "verdict": verdict_json(verdict), "deduplicated": False}


# Why the payment takes no other void or capture, for each status that blocks it.
LIVE_WORDS = {"pending": "is in progress", "succeeded": "is already done",
              "unknown": "was sent and its outcome is not known yet: retry that request with its own "
                         "Idempotency-Key to learn it"}


def operation_json(operation: PaymentOperation) -> dict[str, Any]:
    return {"id": operation.pk, "kind": operation.kind, "status": operation.status,
            "amount": operation.amount_minor, "currency": operation.currency,
            "gateway_reference": operation.gateway_reference or None,
            "finished_at": operation.finished_at.isoformat() if operation.finished_at else None}


def gateway_key(operation: PaymentOperation) -> str:
    """Derived from the operation, so every call for it is the same request at the gateway."""
    return f"refundops:{operation.pk}"


def _call_gateway(*, caller: Caller, operation_id: str, store: Callable[[Answer], None]) -> Answer:
    operation = PaymentOperation.objects.select_related("payment", "verdict").get(pk=operation_id)
    payment = operation.payment
    try:
        processor = get_processor(payment.processor, payment.processor_account)
        if operation.kind == PaymentOperation.Kind.VOID:
            result: VoidResult | CaptureResult = processor.void(
                payment_ref(payment), idempotency_key=gateway_key(operation), verdict_id=operation.verdict_id)
        else:
            result = processor.capture(payment_ref(payment), Money(operation.amount_minor, operation.currency),
                                       idempotency_key=gateway_key(operation), verdict_id=operation.verdict_id)
    except OutcomeUnknown as lost:
        # The gateway may have acted: only its books can say. Ask before answering anything.
        answer = resolve_operation(operation_id=operation_id, actor=caller.label, lost=lost)
        store(answer)
        return answer
    except (ProcessorError, UnknownProcessor) as exc:
        answer = _record_outcome(operation_id, actor=caller.label, failure=exc)
    else:
        answer = _record_outcome(operation_id, actor=caller.label, result=result)
    store(answer)
    return answer


def _record_outcome(operation_id: str, *, actor: str, result: VoidResult | CaptureResult | None = None,
                    failure: ProcessorError | UnknownProcessor | None = None, unknown: str = "",
                    found: PaymentState | None = None, only_from: tuple[str, ...] = ("pending",)) -> Answer:
    """Record what became of one operation, in one short transaction under the payment's lock:
    the gateway's answer (``result``/``failure``), what a look-up found (``found``), or that the
    answer is still unknown (``unknown``, why). Changes only an operation in ``only_from``; the
    answer for the operation as it then stands."""
    with transaction.atomic():
        payment = lock_payment(PaymentOperation.objects.values_list("payment_id", flat=True).get(pk=operation_id))
        operation = PaymentOperation.objects.select_for_update().select_related("verdict").get(pk=operation_id)
        if operation.status not in only_from or (unknown and operation.status == PaymentOperation.Status.UNKNOWN):
            return operation_answer(operation, payment=payment)  # settled meanwhile, or still unknown
        now = timezone.now()
        if found is not None:
            done = (found.status == "voided") if operation.kind == PaymentOperation.Kind.VOID \
                else found.status in ("captured", "capture_pending")
            gateway_response: dict[str, Any] = {"looked_up": asdict(found) | {
                "captured": asdict(found.captured) if found.captured else None}}
            if done:
                reference = found.capture_reference or found.reference
                amount = found.captured or Money(operation.amount_minor or 0, operation.currency)
                result = (VoidResult(reference=reference, status="voided") if operation.kind == PaymentOperation.Kind.VOID
                          else CaptureResult(reference=reference, amount=amount,
                                             status="captured" if found.status == "captured" else "pending"))
            else:
                failure = ProcessorUnavailable(
                    f"Looked up at the gateway: the payment is {found.status}; the {operation.kind} was not made.",
                    code="not_made")
        if unknown:
            operation.status = PaymentOperation.Status.UNKNOWN
            operation.failure_code, operation.failure_message = "outcome_unknown", unknown
            gateway_response = {"unknown": unknown}
        elif failure is None:
            assert result is not None
            operation.status, operation.finished_at = PaymentOperation.Status.SUCCEEDED, now
            operation.gateway_reference, operation.failure_code, operation.failure_message = result.reference, "", ""
            if operation.kind == PaymentOperation.Kind.VOID:
                payment.status = Payment.Status.VOIDED
                fields = ["status"]
            else:
                payment.status = Payment.Status.CAPTURED
                payment.amount_captured_minor = result.amount.amount_minor if found else operation.amount_minor
                payment.captured_at = now
                fields = ["status", "amount_captured_minor", "captured_at"]
            payment._change_reason = f"{operation.kind} {operation.pk} (verdict {operation.verdict_id})"
            payment.save(update_fields=fields)
            if found is None:
                gateway_response = asdict(result)
        else:
            _, _, gateway_code = gateway_failure(failure)
            operation.status, operation.finished_at = PaymentOperation.Status.FAILED, now
            operation.failure_code, operation.failure_message = gateway_code, str(failure)
            if found is None:
                gateway_response = {"error": gateway_code, "message": str(failure)}
        operation.save()
        Verdict.objects.filter(pk=operation.verdict_id).update(gateway_response=gateway_response)
        record_audit(actor=actor, action=f"payment.{operation.kind}_{operation.status}",
                     subject_type="payment", subject_id=payment.pk,
                     data={"verdict_id": operation.verdict_id, "operation_id": operation.pk,
                           "resolved_by_lookup": found is not None, "gateway": gateway_response})
        return operation_answer(operation, payment=payment, failure=failure if found is None else None)


def operation_answer(operation: PaymentOperation, *, payment: Payment,
                     failure: ProcessorError | UnknownProcessor | None = None) -> Answer:
    """What a void or capture answers as it stands: 200 done, 202 pending or unknown (the gateway
    may have acted; the same Idempotency-Key again learns the outcome), or the contract's error."""
    if operation.status == PaymentOperation.Status.SUCCEEDED:
        return Answer(200, _operation_body(payment, operation, operation.verdict))
    if operation.status in (PaymentOperation.Status.PENDING, PaymentOperation.Status.UNKNOWN):
        return Answer(202, _operation_body(payment, operation, operation.verdict))
    if operation.failure_code == "not_made":
        code, message = "GATEWAY_UNAVAILABLE", (
            f"The gateway did not answer, and looking the payment up there shows the {operation.kind} was not "
            f"made; nothing changed. Try again with a new Idempotency-Key.")
    else:  # the gateway's own answer (the call's exception when at hand)
        code, message, _ = gateway_failure(failure or ProcessorDeclined(operation.failure_message))
    return error_answer(code, message, verdict_id=operation.verdict_id, operation_id=operation.pk,
                        gateway_code=operation.failure_code)


def resolve_operation(*, operation_id: str, actor: str, lost: ProcessorError | None = None) -> Answer:
    """A void or capture whose answer is unknown, or pending past its lease (its process died
    mid-call): ask the gateway where the payment stands and record what it shows. The gateway is
    asked outside any lock. If it cannot be asked, the operation stays (or becomes) ``unknown``."""
    operation = PaymentOperation.objects.select_related("payment").get(pk=operation_id)
    resolvable = (PaymentOperation.Status.PENDING, PaymentOperation.Status.UNKNOWN)
    if operation.status not in resolvable:
        return operation_answer(operation, payment=operation.payment)
    if operation.status == PaymentOperation.Status.PENDING and lost is None and \
            operation.lease_until is not None and operation.lease_until > timezone.now():
        return operation_answer(operation, payment=operation.payment)  # its caller is still at it
    try:
        processor = get_processor(operation.payment.processor, operation.payment.processor_account)
        found = processor.fetch_payment_state(payment_ref(operation.payment))
    except (ProcessorError, UnknownProcessor) as exc:
        why = (f"{lost.message if lost else 'The process calling the gateway stopped before its answer'}; "
               f"the gateway could not be asked where the payment stands ({exc}). The same request with the "
               f"same Idempotency-Key asks again.")
        return _record_outcome(operation_id, actor=actor, unknown=why, only_from=resolvable)
    return _record_outcome(operation_id, actor=actor, found=found, only_from=resolvable)


def _settle_replayed_operation(first: Answer, *, caller: Caller) -> Answer | None:
    """A retry of a void or capture whose first answer was not final: settle it (looking the
    payment up when its outcome is unknown) and answer as it stands now."""
    body = first.body or {}
    operation_id = (body.get("operation") or {}).get("id") or (body.get("error") or {}).get("operation_id")
    if first.status != 202 or not operation_id:
        return None
    answer = resolve_operation(operation_id=operation_id, actor=caller.label)
    return answer if (answer.status, answer.body) != (first.status, first.body) else None


def resolve_stalled_operations(*, limit: int = 100) -> int:
    """The beat's sweep: every void or capture whose answer is unknown, or pending past its lease,
    is looked up at its gateway. How many were settled (succeeded or failed)."""
    now = timezone.now()
    stalled = (PaymentOperation.objects.filter(status=PaymentOperation.Status.UNKNOWN)
               | PaymentOperation.objects.filter(status=PaymentOperation.Status.PENDING, lease_until__lte=now))
    settled = 0
    for operation_id in stalled.order_by("created_at").values_list("pk", flat=True)[:limit]:
        answer = resolve_operation(operation_id=operation_id, actor="system:resolver")
        settled += answer.status != 202
    return settled


# -- payment links -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class LinkInput:
    transaction_id: str
    order_reference: str
    template_id: str
    amount_minor: int
    agent: AgentContext


LINK_FIELDS = ("transaction_id", "order_reference", "template", "amount", "agent")


def _parse_link(data: Any) -> LinkInput:
    data = require_object(data)
    reject_unknown(data, LINK_FIELDS)
    transaction_id = text(data, "transaction_id", max_length=40)
    order_reference = text(data, "order_reference", max_length=100)
    if bool(transaction_id) == bool(order_reference):
        raise ValidationFailed("transaction_id", "send either transaction_id or order_reference, not both")
    template_id = text(data, "template", required=True, max_length=40)
    amount_minor = amount(data, required=True)
    return LinkInput(transaction_id=transaction_id, order_reference=order_reference, template_id=template_id,
                     amount_minor=amount_minor, agent=agent_context(data))


def send_payment_link(*, caller: Caller, data: Any, idempotency_key: str) -> Answer:
    """``POST payment-links``: a link from an approved template for an amount already owed."""
    return guarded_operation(caller=caller, operation=SEND_LINK, data=data, idempotency_key=idempotency_key,
                             path={}, parse=_parse_link,
                             decide=lambda ask, base: _decide_link(caller=caller, ask=ask, base=base))


def _find_payment_for_link(ask: LinkInput, *, merchant_id: str | None) -> Payment | None:
    if ask.transaction_id:
        return lock_payment(ask.transaction_id, merchant_id=merchant_id)
    # An order may have several payments: the one that still has money owed on it. Another
    # merchant's order is as absent as one that does not exist.
    orders = Payment.objects.filter(order_reference=ask.order_reference)
    candidate = ((orders.filter(merchant_id=merchant_id) if merchant_id else orders)
                 .order_by("-amount_owed_minor", "-created_at").values_list("pk", flat=True).first())
    return lock_payment(candidate) if candidate else None


def outstanding_links_minor(payment: Payment) -> int:
    """Owed money already asked for by links not yet paid: a second link for it could be paid twice."""
    return PaymentLink.objects.filter(payment=payment, status=PaymentLink.Status.SENT).aggregate(
        s=Sum("amount_minor", default=0))["s"]


def _decide_link(*, caller: Caller, ask: LinkInput, base: dict[str, Any]) -> tuple[Answer, FollowUp | None]:
    payment = _find_payment_for_link(ask, merchant_id=caller.merchant_id)
    if payment is None:
        if ask.transaction_id:
            return refuse(base, "PAYMENT_NOT_FOUND", f"No payment {ask.transaction_id!r}.",
                          payment_id=ask.transaction_id), None
        return refuse(base, "ORDER_NOT_FOUND", f"No order {ask.order_reference!r}: check the order reference, "
                                               f"or name the payment (transaction_id).",), None
    base = {**base, "payment_id": payment.pk, "currency": payment.currency, "amount_minor": ask.amount_minor}
    template = PaymentLinkTemplate.objects.filter(pk=ask.template_id).first()
    template_check = passed("template_approved", template=ask.template_id)
    if template is None or not template.usable:
        why = ("does not exist" if template is None else "is not approved" if template.approved_at is None
               else "is no longer active")
        return refuse(base, "TEMPLATE_NOT_APPROVED",
                      f"Template {ask.template_id!r} {why}; only templates a person approved can be sent.",
                      checks=[failed(template_check)]), None
    owed, asked = payment.amount_owed_minor, outstanding_links_minor(payment)
    available = owed - asked
    owed_check = {"name": "amount_owed", "result": "pass", "inputs": {"amount": ask.amount_minor, "owed": owed,
                                                                      "in_open_links": asked},
                  "limit": available, "observed": ask.amount_minor}
    if ask.amount_minor > available:
        cur = payment.currency
        message = (f"{format_minor(ask.amount_minor, cur)} is not owed on {payment.pk}: "
                   f"{format_minor(max(available, 0), cur)} is owed and not yet asked for by a link "
                   f"(owed {format_minor(owed, cur)}). Any other amount stays with a person.")
        return refuse(base, "AMOUNT_NOT_OWED", message,
                      checks=[template_check, failed(owed_check)]), None
    local = payment.processor == Payment.Processor.SANDBOX
    if not local and not hasattr(import_string(ADAPTERS[payment.processor]), "create_payment_link"):
        return refuse(base, "PAYMENT_LINKS_UNSUPPORTED",
                      f"Payment links are not available for {payment.get_processor_display()} payments yet.",
                      checks=[template_check, owed_check]), None
    verdict = approve(base, checks=[template_check, owed_check])
    link = PaymentLink.objects.create(template=template, payment=payment, order_reference=payment.order_reference,
                                      amount_minor=ask.amount_minor, currency=payment.currency,
                                      agent=caller.agent, verdict=verdict)
    record_audit(actor=caller.label, action="payment_link.decided", subject_type="payment_link",
                 subject_id=link.pk, data={"verdict_id": verdict.id, "payment_id": payment.pk,
                                           "amount_minor": link.amount_minor, "template": template.pk})
    if local:
        _fill_link(link, url=f"{settings.PUBLIC_BASE_URL}/pay/{link.pk}", processor_link_id="", actor=caller.label)
        return Answer(201, _link_body(link, verdict)), None

    def follow_up(store: Callable[[Answer], None]) -> Answer:
        return _create_gateway_link(caller=caller, link_id=link.pk, store=store)

    return Answer(202, _link_body(link, verdict)), follow_up


def _fill_link(link: PaymentLink, *, url: str, processor_link_id: str, actor: str) -> None:
    link.url, link.processor_link_id = url, processor_link_id
    link.message = string.Template(link.template.message).safe_substitute(
        amount=format_minor(link.amount_minor, link.currency), url=url,
        order_reference=link.order_reference or link.payment_id, customer_name=link.payment.customer.name)
    link.save(update_fields=["url", "processor_link_id", "message"])
    record_audit(actor=actor, action="payment_link.sent", subject_type="payment_link", subject_id=link.pk,
                 data={"url": url, "processor_link_id": processor_link_id})


def _create_gateway_link(*, caller: Caller, link_id: str, store: Callable[[Answer], None]) -> Answer:
    link = PaymentLink.objects.select_related("payment", "template", "verdict").get(pk=link_id)
    payment = link.payment
    created, failure = None, None
    try:
        created = get_processor(payment.processor, payment.processor_account).create_payment_link(
            amount=Money(link.amount_minor, link.currency),
            description=f"Order {link.order_reference or payment.pk}",
            metadata={"payment_link_id": link.pk, "transaction_id": payment.pk, "verdict_id": link.verdict_id},
            idempotency_key=f"refundops:{link.pk}")
    except (ProcessorError, UnknownProcessor) as exc:
        failure = exc
    with transaction.atomic():
        link = PaymentLink.objects.select_for_update().select_related("payment__customer", "template").get(pk=link_id)
        if failure is None:
            _fill_link(link, url=created.url, processor_link_id=created.id, actor=caller.label)
            Verdict.objects.filter(pk=link.verdict_id).update(gateway_response={"id": created.id, "url": created.url})
            answer = Answer(201, _link_body(link, link.verdict))
        else:
            code, message, gateway_code = gateway_failure(failure)
            link.status = PaymentLink.Status.FAILED  # frees the owed amount for another link
            link._change_reason = f"gateway: {gateway_code}"
            link.save(update_fields=["status"])
            Verdict.objects.filter(pk=link.verdict_id).update(
                gateway_response={"error": gateway_code, "message": str(failure)})
            record_audit(actor=caller.label, action="payment_link.failed", subject_type="payment_link",
                         subject_id=link.pk, data={"gateway_code": gateway_code})
            answer = error_answer(code, message, verdict_id=link.verdict_id, payment_link_id=link.pk,
                                  gateway_code=gateway_code)
        store(answer)
    return answer


def payment_link_json(link: PaymentLink) -> dict[str, Any]:
    return {"id": link.pk, "status": link.status, "url": link.url or None, "amount": link.amount_minor,
            "currency": link.currency, "transaction_id": link.payment_id,
            "order_reference": link.order_reference or None, "template": link.template_id,
            "message": link.message or None, "sent_at": link.sent_at.isoformat(),
            "paid_at": link.paid_at.isoformat() if link.paid_at else None}


def _link_body(link: PaymentLink, verdict: Verdict) -> dict[str, Any]:
    return {"payment_link": payment_link_json(link), "verdict": verdict_json(verdict), "deduplicated": False}


@transaction.atomic
def mark_payment_link_paid(*, link_id: str, actor: str = "system") -> PaymentLink:
    """The customer paid through the link: the order owes that much less. Applying twice is a no-op."""
    payment_id = PaymentLink.objects.values_list("payment_id", flat=True).get(pk=link_id)
    payment = lock_payment(payment_id)  # payment first, as everywhere (refundops.locks)
    link = PaymentLink.objects.select_for_update().get(pk=link_id)
    if link.status == PaymentLink.Status.PAID:
        return link
    link.status, link.paid_at = PaymentLink.Status.PAID, timezone.now()
    link._change_reason = f"paid ({actor})"
    link.save(update_fields=["status", "paid_at"])
    payment.amount_owed_minor = max(payment.amount_owed_minor - link.amount_minor, 0)
    payment._change_reason = f"payment link {link.pk} paid"
    payment.save(update_fields=["amount_owed_minor"])
    record_audit(actor=actor, action="payment_link.paid", subject_type="payment_link", subject_id=link.pk,
                 data={"payment_id": payment.pk, "amount_minor": link.amount_minor,
                       "amount_owed_minor": payment.amount_owed_minor})
    return link
