"""Requesting a refund: validate, decide under lock, record the verdict and the refund, answer."""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import re
from datetime import date, datetime, timedelta
from typing import Any

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import DEFAULT_DB_ALIAS, connection, transaction
from django.utils import timezone

from audit.history import fitted_reason
from audit.models import Verdict
from audit.services import new_audit_entry
from refundops import batching, breaker, idempotency, outbound, outbox
from refundops.answers import Answer, error_answer, refund_json, suggested_message
from refundops.callers import Caller
from refundops.errors import ApiError
from refundops.inputs import (
    RefundInput,
    ValidationFailed,
    could_be_id,
    for_the_record,
    key_problem,
    parse_refund,
    recorded_key,
    unstorable,
)
from refundops.locks import lock_scopes, slots_for
from refundops.models import (RESERVING_STATES, Customer, LedgerDiscrepancy, Payment, PolicyDraft, Refund,
                              RefundState)
from refundops.policy import (Decision, RefundAsk, Totals, evaluate_refund, evaluate_resubmission, policy_input,
                              policy_version)
from refundops.rows import Columns, Prepared, cache_related, db, insert, save_new
from refundops.selectors import active_limits, active_rules, policy_in_force, running_totals, totals_and_pause
from refundops.services.reconciliation import open_discrepancy_on

log = logging.getLogger(__name__)

CREATE = "refund.create"
CHECK = "refund.check"
RESUBMIT = "refund.resubmit"


def request_refund(*, caller: Caller, data: Any, idempotency_key: str) -> Answer:
    """``POST refunds``: the one way an agent (or a person, through the admin) asks for money back."""
    return _decide(caller=caller, data=data, idempotency_key=idempotency_key, dry_run=False)


def check_refund(*, caller: Caller, data: Any, idempotency_key: str) -> Answer:
    """``POST refunds/check``: the verdict ``request_refund`` would give now; writes only that verdict."""
    return _decide(caller=caller, data=data, idempotency_key=idempotency_key, dry_run=True)


def _decide(*, caller: Caller, data: Any, idempotency_key: str, dry_run: bool) -> Answer:
    operation = CHECK if dry_run else CREATE
    base = {"operation": operation, "dry_run": dry_run, "idempotency_key": recorded_key(idempotency_key),
            "request": for_the_record(data if isinstance(data, dict) else {"body": data}),
            **caller.verdict_fields()}
    problem = unstorable(data) or unstorable(idempotency_key)
    if problem:
        message = f"body: {problem}"
        verdict = Verdict.objects.create(**{**base, "request": {}, "idempotency_key": ""},
                                         outcome=Verdict.Outcome.DENIED, code="VALIDATION_ERROR", message=message)
        return error_answer("VALIDATION_ERROR", message, verdict_id=verdict.id, field="body")
    try:
        ask = parse_refund(data)
        ask = _with_session(caller, ask, timezone.now())
    except ValidationFailed as failed:
        verdict = Verdict.objects.create(**base, outcome=Verdict.Outcome.DENIED, code="VALIDATION_ERROR",
                                         message=failed.message)
        return error_answer("VALIDATION_ERROR", failed.message, verdict_id=verdict.id, field=failed.field)

    message = key_problem(idempotency_key)
    if message:
        verdict = Verdict.objects.create(**base, outcome=Verdict.Outcome.DENIED, code="IDEMPOTENCY_KEY_REQUIRED",
                                         message=message)
        return error_answer("IDEMPOTENCY_KEY_REQUIRED", message, verdict_id=verdict.id)
    scope, digest = caller.idempotency_scope, idempotency.request_hash(operation, data)
    now = timezone.now()
    # A batch (refundops.batching): BEGIN, the savepoint and its release ride with the statements
    # after them, and the writes after the decision, which nothing reads before the commit, leave
    # together at the end of the block; any error in them rolls the whole transaction back.
    with transaction.atomic(), batching.batch():
        if not dry_run:  # a replay, too, learns its first answer here
            replay = idempotency.claim(scope, idempotency_key, operation, digest)
            if replay.record is not None:
                return _replay(base, replay)
        payment = _payment_to_decide_on(ask.transaction_id, lock=not dry_run, merchant_id=caller.merchant_id)
        if payment is None:
            message = (f"No payment {ask.transaction_id!r}. Check the transaction id (it starts with "
                       f"'txn_') with the customer's order.")
            verdict = Verdict.objects.create(**base, outcome=Verdict.Outcome.DENIED, code="PAYMENT_NOT_FOUND",
                                             message=message, payment_id=ask.transaction_id)
            answer = error_answer("PAYMENT_NOT_FOUND", message, verdict_id=verdict.id)
        else:
            answer = _decide_for_payment(caller=caller, payment=payment, ask=ask, base=base, now=now,
                                         dry_run=dry_run, idempotency_key=idempotency_key)
        if not dry_run:  # the stored text is the response's body too: encoded once
            answer = answer.with_encoded(idempotency.store(scope, idempotency_key, answer.status, answer.body))
    return answer


def _with_session(caller: Caller, ask: RefundInput, now: datetime) -> RefundInput:
    """The session the limits count: required by the agent's merchant, or the key's hour's."""
    if caller.agent is None or ask.agent.session_id:
        return ask
    if caller.agent.merchant.require_session_id:
        raise ValidationFailed("agent.session_id", "is required: this merchant's finance team asks every "
                                                   "refund to name the agent's session (your conversation id)")
    session = caller.session_id_for("", now)
    return dataclasses.replace(ask, agent=dataclasses.replace(ask.agent, session_id=session))


def _payment_to_decide_on(payment_id: str, *, lock: bool, merchant_id: str | None) -> Payment | None:
    """The payment (locked, unless only checking; None when it is not ``merchant_id``'s, as
    refundops.locks.lock_payment), and in the same statement whether one of its reconciliation
    discrepancies is open (``ledger_mismatch``): the policy holds agent refunds then. Its customer
    comes with it, as ``select_related`` would bring it."""
    wrapper = db()
    if wrapper.vendor != "postgresql":
        payments = Payment.objects.select_related("customer").annotate(ledger_mismatch=open_discrepancy_on())
        if lock:
            payments = payments.select_for_update(of=("self",))
        payments = payments.filter(pk=payment_id)
        return (payments.filter(merchant_id=merchant_id) if merchant_id else payments).first()
    # The statement the ORM would write for the query above, without compiling it on every request.
    sql = _payment_sql(bool(merchant_id), lock)
    with wrapper.cursor() as cursor:
        cursor.execute(sql, [str(LedgerDiscrepancy.Status.OPEN), payment_id, *([merchant_id] if merchant_id else [])])
        row = cursor.fetchone()
    if row is None:
        return None
    n = len(_PAYMENT_COLUMNS)
    payment = _PAYMENT_COLUMNS.make(row[:n])
    payment.ledger_mismatch = row[n]
    cache_related(payment, "customer", _CUSTOMER_COLUMNS.make(row[n + 1:]))
    return payment


_PAYMENT_COLUMNS, _CUSTOMER_COLUMNS = Columns(Payment, "p"), Columns(Customer, "c")


@functools.cache
def _payment_sql(by_merchant: bool, lock: bool) -> str:
    """The payment read's statement (merchant named or not, locked or not), made on first use."""
    return (
        f"SELECT {_PAYMENT_COLUMNS.sql}, EXISTS(SELECT 1 FROM {LedgerDiscrepancy._meta.db_table} d"
        f" WHERE d.payment_id = p.id AND d.status = %s), {_CUSTOMER_COLUMNS.sql}"
        f" FROM {Payment._meta.db_table} p JOIN {Customer._meta.db_table} c ON c.id = p.customer_id"
        f" WHERE p.id = %s" + (" AND p.merchant_id = %s" if by_merchant else "")
        + (" FOR UPDATE OF p" if lock else ""))


def _replay(base: dict[str, Any], replay: idempotency.Replay) -> Answer:
    record = replay.record
    if replay.reused:
        message = ("This Idempotency-Key was already used with a different request body. Use a new "
                   "key for a new request, or resend the original body to get its answer.")
        verdict = Verdict.objects.create(**base, outcome=Verdict.Outcome.DENIED, code="IDEMPOTENCY_KEY_REUSED",
                                         message=message)
        return error_answer("IDEMPOTENCY_KEY_REUSED", message, verdict_id=verdict.id)
    first = Answer(record.response_status, record.response_body)
    Verdict.objects.create(**base, deduplicated=True, code=first.code,
                           outcome=_outcome_of(first), message="Replay of the first answer to this key")
    return first.deduplicated()


def _outcome_of(answer: Answer) -> str:
    if not answer.ok:
        return Verdict.Outcome.DENIED
    return Verdict.Outcome.HELD if answer.status == 202 else Verdict.Outcome.APPROVED


def _decide_for_payment(*, caller: Caller, payment: Payment, ask: RefundInput, base: dict[str, Any],
                        now: datetime, dry_run: bool, idempotency_key: str) -> Answer:
    # The limits, hold rules and (for a real request) the drafts that only watch, in one statement
    # before the locks; a change of the limits since is found under them (decide_under_locks).
    limits, rules, shadows = policy_in_force(payment.currency, shadows=not dry_run)
    agent_id = caller.agent.id if caller.agent else None
    refund_ask = RefundAsk(amount_minor=ask.amount_minor, reason=ask.reason, destination=ask.destination,
                           agent_id=agent_id, session_id=ask.agent.session_id,
                           requester_authority_minor=caller.refund_authority(payment.currency))
    breaker_open = bool(agent_id) and breaker.is_open(now=now)
    locked = copy.copy(payment)  # the payment as locked, before this request reserves anything

    def decide() -> tuple[Decision, Totals, int]:
        totals, paused, limits_version = totals_and_pause(
            payment=locked, agent_id=agent_id, session_id=ask.agent.session_id, now=now,
            velocity_hours=rules.velocity_window_hours if rules else 24,
            cumulative_hours=limits.cumulative_window_hours if limits else 24)
        # What the policy read, kept on the verdict so a draft policy can be replayed on it.
        verdict.policy_input = policy_input(payment=locked, ask=refund_ask, limits=limits, rules=rules, now=now,
                                            paused=paused, breaker_open=breaker_open,
                                            ledger_mismatch=locked.ledger_mismatch)
        return evaluate_refund(payment=locked, limits=limits, rules=rules, totals=totals, now=now, ask=refund_ask,
                               paused=paused, breaker_open=breaker_open,
                               ledger_mismatch=locked.ledger_mismatch), totals, limits_version

    verdict = Verdict(**base, payment_id=payment.pk, currency=payment.currency,
                      policy_version=policy_version(limits, rules))
    if dry_run:
        decision, totals, _ = decide()
        save_new(_fill_verdict(verdict, decision, totals))
        return _check_answer(payment, decision, verdict, totals, limits)

    def decide_under_locks(*, exclusive: bool) -> tuple[Decision, Totals]:
        # The payment's row is locked; these lock its customer, its agent, the switches and the
        # currency's global total (refundops.locks says how and why), then the totals are read.
        nonlocal limits
        amount = ask.amount_minor if ask.amount_minor is not None else locked.refundable_minor  # as the policy
        scopes = lock_scopes(customer_id=payment.customer_id, agent_id=agent_id, currency=payment.currency,
                             exclusive=exclusive,
                             slots=slots_for(amount, limits.global_daily_amount_minor if limits else None))
        if exclusive:  # no change of the limits commits while this is held (refundops.locks.lock_currency)
            limits = active_limits(payment.currency)
            verdict.policy_version = policy_version(limits, rules)
        decision, totals, limits_version = decide()
        if not exclusive and limits_version != (limits.version if limits else 0):
            raise _NeedsEveryRefundInFlight  # the limits changed since they were read: the slots mean another size
        if (decision.outcome != "denied" and limits is not None
                and not scopes.global_fast_path(limit_minor=limits.global_daily_amount_minor,
                                                committed_minor=totals.global_day_minor,
                                                amount_minor=decision.amount_minor)):
            raise _NeedsEveryRefundInFlight
        return decision, totals

    try:
        with transaction.atomic():  # a savepoint: undoing it lets go of the locks taken inside it
            decision, totals = decide_under_locks(exclusive=False)
    except _NeedsEveryRefundInFlight:
        decision, totals = decide_under_locks(exclusive=True)
    refund = _write_refund(caller=caller, payment=payment, ask=ask, decision=decision, verdict=verdict,
                           now=now, idempotency_key=idempotency_key)
    verdict.refund_id = refund.pk if refund else ""
    verdict.shadow = _shadow(shadows, decision, payment=locked, ask=refund_ask, limits=limits, rules=rules,
                             totals=totals, now=now, paused=verdict.policy_input["paused"], breaker_open=breaker_open,
                             ledger_mismatch=locked.ledger_mismatch)
    save_new(_fill_verdict(verdict, decision, totals))  # the refund points at it; the FK is checked at commit
    if refund is not None:
        if refund.status == RefundState.APPROVED and caller.is_agent:
            # Counted once committed, outside the lock; is_open above already fails closed without Redis.
            outbox.send_after_commit("refundops.tasks.count_agent_refund",
                                     {"amount_minor": refund.amount_minor, "currency": refund.currency,
                                      "at": now.isoformat(), "refund_id": refund.pk})
        save_new(new_audit_entry(actor=caller.label, action=f"refund.{refund.status}", subject_type="refund",
                                 subject_id=refund.pk, data={"verdict_id": verdict.id, "payment_id": payment.pk,
                                                             "amount_minor": refund.amount_minor,
                                                             "currency": refund.currency, "code": decision.code},
                                 records=[verdict]))
        if refund.status == RefundState.APPROVED:
            from refundops.tasks import enqueue_submission
            enqueue_submission(refund.pk, processor=payment.processor)
    if decision.outcome == "denied":
        extra = {"refund_id": refund.pk} if refund else {}
        return error_answer(decision.code, decision.message, verdict_id=verdict.id, **extra)
    return _created_answer(refund, decision, verdict, payment, totals, limits)


def decide_resubmission(*, refund: Refund, caller: Caller, note: str, now: datetime) -> tuple[Decision, Verdict]:
    """The policy again for a failed refund a person sends again, on today's totals, under the
    locks a new refund takes (the caller holds the payment's), the currency's exclusively (it is
    rare; it then sees every refund in flight): resubmissions and new refunds racing for the last of
    a limit are serialised like any two refunds. Records the verdict."""
    payment = refund.payment
    lock_scopes(customer_id=payment.customer_id, agent_id=refund.agent_id, currency=payment.currency, exclusive=True)
    limits, rules = active_limits(payment.currency), active_rules()  # under the lock a change of limits takes
    ask = RefundAsk(amount_minor=refund.amount_minor, reason=refund.reason, destination="original_method",
                    agent_id=refund.agent_id, session_id=refund.agent_session_id,
                    requester_authority_minor=caller.refund_authority(payment.currency))
    totals = running_totals(payment=payment, agent_id=refund.agent_id, session_id=refund.agent_session_id,
                            now=now, velocity_hours=rules.velocity_window_hours if rules else 24,
                            cumulative_hours=limits.cumulative_window_hours if limits else 24,
                            exclude_refund_id=refund.pk)
    decision = evaluate_resubmission(payment=payment, ask=ask, limits=limits, rules=rules, totals=totals, now=now,
                                     approver=caller.user.get_username(),
                                     ledger_mismatch=LedgerDiscrepancy.objects.filter(
                                         payment_id=payment.pk, status=LedgerDiscrepancy.Status.OPEN).exists())
    verdict = Verdict(operation=RESUBMIT, payment_id=payment.pk, refund_id=refund.pk, currency=payment.currency,
                      policy_version=policy_version(limits, rules), request={"refund_id": refund.pk, "note": note},
                      **caller.verdict_fields())
    _fill_verdict(verdict, decision, totals).save()
    return decision, verdict


def _shadow(drafts: list[PolicyDraft], decision: Decision, *, payment, ask: RefundAsk, limits, rules,
            totals: Totals, now: datetime, paused: bool, breaker_open: bool, ledger_mismatch: bool) -> dict[str, Any]:
    """What each draft running in shadow would decide on this very input, beside the decision that
    binds; recorded on the verdict, never enforced. The totals are the active version's: a draft
    that changes a window's length is judged on the active window here (its backtest too)."""
    seen = {}
    for draft in drafts:
        try:
            mine = evaluate_refund(payment=payment, ask=ask, totals=totals, now=now, paused=paused,
                                   breaker_open=breaker_open, ledger_mismatch=ledger_mismatch,
                                   limits=draft.as_version() if draft.kind == PolicyDraft.Kind.LIMITS else limits,
                                   rules=draft.as_version() if draft.kind == PolicyDraft.Kind.RULES else rules)
        except (TypeError, ValueError, AttributeError, ValidationError) as broken:
            # A draft stored before create_draft refused values no version keeps (a JSON field as written):
            # it is never enforced, so it never fails the binding decision; it is left out, and said.
            log.warning("shadow draft %s left out of this decision: %s", draft.pk, broken)
            continue
        seen[draft.pk] = {"kind": draft.kind, "outcome": mine.outcome, "code": mine.code,
                          "hold_reasons": mine.hold_reasons, "amount_minor": mine.amount_minor,
                          "agrees": _outcome_key(mine) == _outcome_key(decision)}
    return seen


class _NeedsEveryRefundInFlight(Exception):
    """The refund would count against the global daily limit beyond what a decision may pass
    without seeing the refunds in flight: decide it again with the currency's lock held exclusively."""


def _outcome_key(decision: Decision) -> tuple[Any, ...]:
    return decision.outcome, decision.code, tuple(decision.hold_reasons), decision.amount_minor


def _fill_verdict(verdict: Verdict, decision: Decision, totals: Totals) -> Verdict:
    verdict.outcome, verdict.code, verdict.message = decision.outcome, decision.code, decision.message
    verdict.amount_minor, verdict.checks = decision.amount_minor, decision.checks_json()
    verdict.totals, verdict.hold_reasons = vars(totals), decision.hold_reasons
    return verdict


def _write_refund(*, caller: Caller, payment: Payment, ask: RefundInput, decision: Decision, verdict: Verdict,
                  now: datetime, idempotency_key: str) -> Refund | None:
    if decision.amount_minor <= 0:  # a refund row needs an amount; "nothing refundable" has none
        return None
    refund = Refund(
        payment=payment, amount_minor=decision.amount_minor, currency=payment.currency,
        reason=ask.reason, note=ask.note,
        origin=Refund.Origin.AGENT if caller.is_agent else Refund.Origin.STAFF,
        agent=caller.agent, agent_key=caller.key, requested_by=caller.user,
        agent_session_id=ask.agent.session_id, agent_model=ask.agent.model,
        agent_reasoning=ask.agent.reasoning, conversation_context=ask.agent.conversation_context,
        idempotency_key=idempotency_key, verdict_id=verdict.id, counted_at=now,
        estimated_arrival=estimate_arrival(payment, now.date()))
    # The refund is written once, in the state the verdict moves it into (the transition below
    # still checks it may leave "requested"), with both history rows in one insert: requested,
    # then the verdict's state. History names who asked and which verdict moved it (agents are
    # not Django users); each state moved into is announced, as if saved in turn.
    requested_at = timezone.now()
    requested = copy.copy(refund)  # the refund as asked for, before the verdict moved it
    if decision.outcome == "approved":
        refund.approve_automatically()
    elif decision.outcome == "held":
        refund.hold(reasons=decision.hold_reasons)
    else:
        refund.deny(code=decision.code, message=decision.message)
    history = [(requested, "+", f"requested by {caller.label}", requested_at),
               (refund, "~", f"verdict {verdict.id}: {decision.outcome}" + (
                   f" ({decision.code})" if decision.code else ""), timezone.now())]
    if connection.vendor == "postgresql":
        _insert_with_history(refund, history)
    else:
        refund.skip_history_when_saving = True  # written just below, both rows at once
        try:
            refund.save(force_insert=True)
        finally:
            del refund.skip_history_when_saving
        requested.created_at, requested.updated_at = refund.created_at, refund.updated_at
        write_history(refund, history)
    # Read once for both events, in this transaction; in a batch the refund's INSERT and this read
    # ride with the payment's sums, and the list is filled when that round trip is back.
    endpoints = outbound.active_endpoints(refund, deferred=True)
    sync_payment_amounts(payment)
    outbound.announce_refund(requested, previous=None, endpoints=endpoints)
    outbound.announce_refund(refund, previous=RefundState.REQUESTED, endpoints=endpoints)
    return refund


@functools.cache
def _historical_refund() -> Any:
    """simple_history's model for refunds. ``Refund.history`` builds a new manager class on every
    access (from_queryset, inspect.getmembers), about 3 % of a refund's CPU: once."""
    return Refund.history.model


def write_history(refund: Refund, rows: list[tuple[Refund, str, str, datetime]]) -> list[Any]:
    """The history rows simple_history would write on each save of these states of ``refund`` (its
    type, change reason, date, and user as its middleware sees it), in one insert; returned (their
    ids are set once the insert has run: at once outside a batch)."""
    history = _historical_refund()
    user = history.get_default_history_user(refund)
    written = [history(history_date=at, history_type=kind, history_user=user,
                       history_change_reason=fitted_reason(history, reason),
                       **{field.attname: getattr(state, field.attname) for field in history.tracked_fields})
               for state, kind, reason, at in rows]
    insert(history, written)
    return written


def _insert_with_history(refund: Refund, rows: list[tuple[Refund, str, str, datetime]]) -> None:
    """``refund.save()`` (a new refund) and ``write_history(refund, rows)`` in one statement: the
    refund's INSERT, and its history rows made from the row it returns, each with the fields where
    its state differs (``rows``: the states in order, the last one ``refund`` itself)."""
    history = _historical_refund()
    params = _refund_values()(refund)  # sets the auto dates
    for state, *_ in rows:
        state.created_at, state.updated_at = refund.created_at, refund.updated_at
    tracked = _tracked_names()
    changed = {name for state, *_ in rows if state is not refund for name in tracked
               if getattr(state, name) != getattr(refund, name)}
    differ = tuple(name for name in tracked if name in changed)
    sql = _history_sql(differ, len(rows))
    prepare = _history_values(differ)
    user = history.get_default_history_user(refund)
    user_id = user.pk if user is not None else None
    for state, kind, reason, at in rows:
        params += prepare(state)
        params += [at, kind, user_id, fitted_reason(history, reason)]
    batching.defer(sql, params)  # in a batch, with the next statement
    refund._state.adding, refund._state.db = False, DEFAULT_DB_ALIAS  # as Model.save leaves it
    refund._update_initial_state()  # as ConcurrentTransitionMixin.save: the state it was saved in


@functools.cache
def _refund_values() -> Prepared:
    return Prepared(Refund._meta.concrete_fields)


@functools.cache
def _tracked_names() -> tuple[str, ...]:
    return tuple(f.attname for f in _historical_refund().tracked_fields)


@functools.cache
def _history_values(differ: tuple[str, ...]) -> Prepared:
    """The values of a history row's fields named in ``differ``, each prepared as its history field."""
    return Prepared([_historical_refund()._meta.get_field(name) for name in differ])


@functools.cache
def _history_sql(differ: tuple[str, ...], n: int) -> str:
    """The statement for ``_insert_with_history``: ``differ`` names the fields each history row gives."""
    history = _historical_refund()
    quote = connection.ops.quote_name

    def cast(field) -> str:  # the column's type, without a length: too long a value fails, as inserted
        return re.sub(r"\(\d+\)$", "", field.db_type(connection))

    columns = [quote(f.column) for f in Refund._meta.concrete_fields]
    tracked = {f.attname: f for f in history.tracked_fields}
    same = [f for f in history.tracked_fields if f.attname not in differ]
    given = [tracked[name] for name in differ] + [history._meta.get_field(name) for name in (
        "history_date", "history_type", "history_user", "history_change_reason")]
    row = "(%s, " + ", ".join(f"%s::{cast(f)}" for f in given) + ")"
    sql = (f"WITH r AS (INSERT INTO {quote(Refund._meta.db_table)} ({', '.join(columns)})"
           f" VALUES ({', '.join(['%s'] * len(columns))}) RETURNING {', '.join(columns)})"
           f" INSERT INTO {quote(history._meta.db_table)} ({', '.join(quote(f.column) for f in same + given)})"
           f" SELECT {', '.join('r.' + quote(f.column) for f in same)}, {', '.join(f'h.c{i}' for i in range(len(given)))}"
           f" FROM r, (VALUES {', '.join(row.replace('(%s, ', f'({i}, ', 1) for i in range(n))})"
           f" AS h(n, {', '.join(f'c{i}' for i in range(len(given)))}) ORDER BY h.n")
    return sql


# Sums and stores in one statement (PostgreSQL and SQLite): the aggregate, then the update, each
# cost a round trip while the payment row is locked.
_SYNC_SQL = ("""
UPDATE {payment} SET (amount_refunded_minor, amount_reserved_minor) = (
  SELECT COALESCE(SUM(CASE WHEN status = %s THEN amount_minor END), 0),
         COALESCE(SUM(CASE WHEN status IN ({reserving}) THEN amount_minor END), 0)
    FROM {refund} WHERE payment_id = %s)
 WHERE id = %s
RETURNING amount_refunded_minor, amount_reserved_minor""".format(
    payment=Payment._meta.db_table, refund=Refund._meta.db_table, reserving=", ".join(["%s"] * len(RESERVING_STATES))))


def sync_payment_amounts(payment: Payment) -> None:
    """Recompute what is refunded and reserved from the refunds themselves (under the row lock)."""
    with db().cursor() as cursor:
        cursor.execute(_SYNC_SQL, [*(str(s) for s in (RefundState.SETTLED, *RESERVING_STATES)), payment.pk, payment.pk])
        payment.amount_refunded_minor, payment.amount_reserved_minor = cursor.fetchone()


def estimate_arrival(payment: Payment, today: date) -> date:
    """Business days by method type (settings.REFUND_ARRIVAL_DAYS), skipping weekends."""
    days = settings.REFUND_ARRIVAL_DAYS.get(payment.method_type, 7)
    day = today
    while days:
        day += timedelta(days=1)
        if day.weekday() < 5:
            days -= 1
    return day


def refund_context(payment: Payment, totals, limits, *, amount_minor: int, status: str,
                   arrival: date | None) -> dict[str, Any]:
    return {
        "transaction_remaining_amount": payment.refundable_minor,
        "currency": payment.currency,
        "customer_refunds_today": totals.customer_day_count + (1 if status in ("approved", "held") else 0),
        "customer_refund_limit_today": limits.customer_daily_count if limits else 0,
        "suggested_message": suggested_message(status=status, amount_minor=amount_minor,
                                               currency=payment.currency, method=payment.method_display,
                                               estimated_arrival=arrival),
    }


def verdict_json(verdict: Verdict) -> dict[str, Any]:
    return {"id": verdict.id, "outcome": verdict.outcome, "code": verdict.code or None,
            "policy_version": verdict.policy_version, "checks": verdict.checks,
            "hold_reasons": verdict.hold_reasons}


def _created_answer(refund: Refund, decision: Decision, verdict: Verdict, payment: Payment, totals,
                    limits) -> Answer:
    body = {"refund": refund_json(refund), "verdict": verdict_json(verdict),
            "context": refund_context(payment, totals, limits, amount_minor=refund.amount_minor,
                                      status=refund.status, arrival=refund.estimated_arrival),
            "deduplicated": False}
    if refund.status == RefundState.HELD:
        body["status"] = "held"
        body["hold_reasons"] = refund.hold_reasons
        return Answer(202, body)
    return Answer(201, body)


def _check_answer(payment: Payment, decision: Decision, verdict: Verdict, totals, limits) -> Answer:
    status = {"approved": "approved", "held": "held", "denied": "denied"}[decision.outcome]
    context = refund_context(payment, totals, limits, amount_minor=decision.amount_minor, status=status,
                             arrival=estimate_arrival(payment, timezone.localdate()))
    context["customer_refunds_today"] = totals.customer_day_count
    return Answer(200, {"verdict": verdict_json(verdict), "would_be": status, "amount": decision.amount_minor,
                        "currency": payment.currency, "message": decision.message or None,
                        "context": context})


def refund_detail(*, refund_id: str, caller: Caller) -> dict[str, Any]:
    """``GET refunds/{id}``: state, amounts, verdict, estimated arrival, a message the agent can say.
    Only refunds of the caller's merchant's payments (staff ones too); an agent's read is recorded."""
    refunds = Refund.objects.select_related("payment", "verdict").filter(pk=refund_id)
    if caller.merchant_id:
        refunds = refunds.filter(payment__merchant_id=caller.merchant_id)
    refund = refunds.first() if could_be_id(refund_id) else None
    caller.record_read("refund.get", refund_id=refund.pk if refund else "",
                payment_id=refund.payment_id if refund else "")
    if refund is None:
        raise ApiError("REFUND_NOT_FOUND", f"No refund {refund_id[:40]!r}; refund ids start with 'rf_'.")
    body = refund_json(refund)
    body.update({
        "processor_refund_id": refund.processor_refund_id or None,
        "failure_code": refund.failure_code or None, "failure_message": refund.failure_message or None,
        "submitted_at": refund.submitted_at.isoformat() if refund.submitted_at else None,
        "settled_at": refund.settled_at.isoformat() if refund.settled_at else None,
        "pending_at_gateway": refund.status == RefundState.APPROVED,
        "suggested_message": suggested_message(
            status=refund.status, amount_minor=refund.amount_minor, currency=refund.currency,
            method=refund.payment.method_display, estimated_arrival=refund.estimated_arrival),
        "transaction_remaining_amount": max(refund.payment.refundable_minor, 0),
    })
    return {"refund": body, "verdict": verdict_json(refund.verdict) if refund.verdict else None}
