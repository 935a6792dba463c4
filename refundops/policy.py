"""The policy: given a locked payment, the request and the running totals, decide.

Pure: it reads nothing from the database and writes nothing. The service gathers the inputs under
the right locks and records what this returns. Checks run in the contract's order; the first that
fails answers; every hold rule that fires is reported.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Callable, Literal

from processors.money import format_minor
from refundops.models import HoldRules, Payment, RefundLimits

Result = Literal["pass", "fail", "hold"]


@dataclass
class Check:
    name: str
    result: Result
    code: str = ""
    message: str = ""
    inputs: dict[str, Any] = field(default_factory=dict)
    limit: Any = None
    observed: Any = None


@dataclass(frozen=True)
class RefundAsk:
    """What is being asked, already validated (see refundops.inputs)."""

    amount_minor: int | None  # None: the whole refundable amount
    reason: str
    destination: str
    agent_id: str | None
    session_id: str
    # A person asking (staff refund): the most they may approve in this currency. Above it, the
    # refund is held for someone else. None for an agent.
    requester_authority_minor: int | None = None


@dataclass(frozen=True)
class Totals:
    """Running totals in the payment's currency, counting every refund that is not denied,
    rejected, expired, canceled or failed, whoever made it (agents, staff, the gateway)."""

    payment_refund_count: int
    customer_day_count: int
    customer_day_minor: int
    customer_30d_count: int
    customer_30d_minor: int
    customer_velocity_count: int  # refunds to this customer within the velocity window
    agent_hour_minor: int
    agent_day_minor: int
    session_minor: int
    global_day_minor: int
    # What the asker's kind refunded (agents, for an agent; people in the admin, for a person): on this
    # payment ever, and to this customer within the limits' cumulative window. The approval threshold,
    # and a person's own authority, apply to these plus the new amount. The names are from when only
    # agents were counted (issue 28 added people): recorded verdicts carry them. Defaults: verdicts
    # recorded before these were counted replay as zero.
    agents_payment_minor: int = 0
    agents_customer_window_minor: int = 0


@dataclass
class Decision:
    outcome: Literal["approved", "held", "denied"]
    amount_minor: int
    code: str = ""
    message: str = ""
    checks: list[Check] = field(default_factory=list)
    hold_reasons: list[str] = field(default_factory=list)

    def checks_json(self) -> list[dict[str, Any]]:
        # vars, not asdict: no deep copy; this runs while the scopes' locks are held.
        return [{k: v for k, v in vars(c).items() if v not in (None, "", {})} for c in self.checks]


# A check's message, or a function that spells it: most checks pass, and a passing require() keeps no
# message, a rule only one of its two; so each is spelled (amounts through format_minor) only when kept.
_Text = str | Callable[[], str]


class _Refused(Exception):
    def __init__(self, check: Check) -> None:
        self.check = check


def policy_version(limits: RefundLimits | None, rules: HoldRules | None) -> str:
    return (f"limits {limits.currency} v{limits.version}" if limits else "no limits") + \
        (f" / rules v{rules.version}" if rules else " / default rules")  # none saved: every hold on


def evaluate_refund(*, payment: Payment, ask: RefundAsk, limits: RefundLimits | None,
                    rules: HoldRules | None, totals: Totals, now: datetime, paused: bool,
                    breaker_open: bool, ledger_mismatch: bool) -> Decision:
    """``ledger_mismatch``: a reconciliation discrepancy of the payment is open (the service reads
    it in the statement that locks the payment)."""
    checks: list[Check] = []
    amount = ask.amount_minor if ask.amount_minor is not None else payment.refundable_minor
    cur = payment.currency

    def money(minor: int) -> str:
        return format_minor(minor, cur)

    def require(ok: bool, check: Check) -> None:
        if not ok:
            check.result = "fail"
            if callable(check.message):  # spelled only for the check that refuses (see _Text)
                check.message = check.message()
            checks.append(check)
            raise _Refused(check)
        check.code = check.message = ""  # a passing check has no refusal to explain
        checks.append(check)

    try:
        refundable = payment.refundable_minor
        not_refundable_why = (
            "it was voided" if payment.status == Payment.Status.VOIDED else
            "it was authorised but never captured" if payment.amount_captured_minor == 0 else
            "it is already fully refunded" if refundable <= 0 else "")
        require(not not_refundable_why, Check(
            "payment_refundable", "pass", code="PAYMENT_NOT_REFUNDABLE",
            message=lambda: f"Payment {payment.id} cannot be refunded: {not_refundable_why}.",
            inputs={"status": payment.status, "captured": payment.amount_captured_minor,
                    "refunded": payment.amount_refunded_minor, "reserved": payment.amount_reserved_minor},
            observed=refundable))
        require(ask.destination == "original_method", Check(
            "destination", "pass", code="DESTINATION_NOT_ALLOWED",
            message="Refunds go only to the payment's original method; a refund to another card "
                    "or account is a payee change and needs finance.",
            inputs={"destination": ask.destination}, limit="original_method"))
        allowed = limits.allowed_reasons if limits else []
        require(limits is None or ask.reason in allowed, Check(
            "reason", "pass", code="REASON_NOT_ALLOWED",
            message=lambda: f"Reason {ask.reason!r} is not allowed by the current policy; allowed: "
                            f"{', '.join(allowed) or 'none'}.",
            inputs={"reason": ask.reason}, limit=allowed))
        if limits is not None and payment.captured_at is not None:
            age_days = (now - payment.captured_at) / timedelta(days=1)
            require(age_days <= limits.refund_window_days, Check(
                "refund_window", "pass", code="REFUND_WINDOW_EXPIRED",
                message=lambda: f"The payment was captured {int(age_days)} days ago; refunds are allowed "
                                f"within {limits.refund_window_days} days.",
                inputs={"captured_at": payment.captured_at.isoformat()},
                limit=limits.refund_window_days, observed=round(age_days, 2)))
        require(0 < amount <= refundable, Check(
            "amount_within_refundable", "pass", code="AMOUNT_EXCEEDS_REFUNDABLE",
            message=lambda: f"{money(amount)} is more than the {money(refundable)} still refundable on "
                            f"{payment.id} (captured {money(payment.amount_captured_minor)}).",
            inputs={"amount": amount}, limit=refundable, observed=amount))
        if limits is not None:
            require(totals.payment_refund_count < limits.max_refunds_per_payment, Check(
                "refunds_per_payment", "pass", code="MAX_REFUNDS_REACHED",
                message=lambda: f"Payment {payment.id} already has {totals.payment_refund_count} refunds; "
                                f"the limit is {limits.max_refunds_per_payment}.",
                limit=limits.max_refunds_per_payment, observed=totals.payment_refund_count))
        if ask.agent_id is not None:
            require(not paused, Check(
                "kill_switch", "pass", code="CIRCUIT_OPEN",
                message="Agent refunds are paused by an operator (kill switch). Tell the customer "
                        "the request is noted and a person will follow up.", observed=paused))
            require(not breaker_open, Check(
                "circuit_breaker", "pass", code="CIRCUIT_OPEN",
                message="Agent refunds are paused: refund volume is far above normal and the "
                        "breaker opened. Operators have been alerted.", observed=breaker_open))
        if limits is not None:
            _check_running_totals(require, limits, totals, amount, ask, money)
    except _Refused as refused:
        c = refused.check
        return Decision("denied", amount, code=c.code, message=c.message, checks=checks)

    hold_reasons = _hold_rules(checks, payment=payment, limits=limits, rules=rules, totals=totals,
                               amount=amount, reason=ask.reason, now=now, money=money,
                               requester_authority=ask.requester_authority_minor, by_agent=ask.agent_id is not None)
    if ask.agent_id is not None:
        # Not a hold rule fraud may switch off: the books disagree, so what is refundable is unknown.
        checks.append(_ledger_check(payment, ledger_mismatch))
        if ledger_mismatch:
            hold_reasons.append("LEDGER_MISMATCH")
    if hold_reasons:
        return Decision("held", amount, checks=checks, hold_reasons=hold_reasons,
                        message="Held for a person: " + ", ".join(hold_reasons) + ".")
    return Decision("approved", amount, checks=checks)


def _check_running_totals(require, limits: RefundLimits, totals: Totals, amount: int,
                          ask: RefundAsk, money) -> None:
    scopes: list[tuple[str, int, int, str]] = [
        ("customer_daily_amount", totals.customer_day_minor + amount, limits.customer_daily_amount_minor,
         "this customer's refunds today"),
        ("customer_30d_amount", totals.customer_30d_minor + amount, limits.customer_30d_amount_minor,
         "this customer's refunds in the last 30 days"),
        ("global_daily_amount", totals.global_day_minor + amount, limits.global_daily_amount_minor,
         "all refunds today"),
    ]
    if ask.agent_id is not None:
        scopes += [
            ("agent_hourly_amount", totals.agent_hour_minor + amount, limits.agent_hourly_amount_minor,
             "this agent's refunds in the last hour"),
            ("agent_daily_amount", totals.agent_day_minor + amount, limits.agent_daily_amount_minor,
             "this agent's refunds today"),
        ]
        if ask.session_id:
            scopes.append(("session_amount", totals.session_minor + amount, limits.session_amount_minor,
                           "this agent session's refunds"))
    counts = [
        ("customer_daily_count", totals.customer_day_count + 1, limits.customer_daily_count,
         "this customer's number of refunds today"),
        ("customer_30d_count", totals.customer_30d_count + 1, limits.customer_30d_count,
         "this customer's number of refunds in the last 30 days"),
    ]
    # Each message is spelled, if at all, inside require(), before the loop moves on: this round's names.
    for name, would_be, limit, what in counts:
        require(would_be <= limit, Check(
            name, "pass", code="DAILY_LIMIT_REACHED",
            message=lambda: f"Refused: {what} would be {would_be}, over the limit of {limit}.",
            limit=limit, observed=would_be - 1, inputs={"would_be": would_be}))
    for name, would_be, limit, what in scopes:
        require(would_be <= limit, Check(
            name, "pass", code="DAILY_LIMIT_REACHED",
            message=lambda: f"Refused: {what} would reach {money(would_be)}, over the limit of {money(limit)}.",
            limit=limit, observed=would_be - amount, inputs={"amount": amount, "would_be": would_be}))


def _hold_rules(checks: list[Check], *, payment: Payment, limits: RefundLimits | None,
                rules: HoldRules | None, totals: Totals, amount: int, reason: str, now: datetime,
                money, requester_authority: int | None, by_agent: bool) -> list[str]:
    fired: list[str] = []

    def rule(name: str, code: str, fires: bool, *, message: _Text = "", passed: _Text = "", **detail: Any) -> None:
        # ``message`` says why it holds, ``passed`` what was within bounds: each only when it is true,
        # and only that one is spelled.
        said = message if fires else passed
        checks.append(Check(name, "hold" if fires else "pass", code=code if fires else "",
                            message=said() if callable(said) else said, **detail))
        if fires:
            fired.append(code)

    # Splitting one refund into several does not beat a bound, agent or person (issue 28): what the
    # asker's kind refunded on the payment, or to the customer within the window, plus this amount.
    # A person's refunds do not use up what agents may move alone, nor agents' a person's.
    window_hours = limits.cumulative_window_hours if limits else 24
    before, scope = max((totals.agents_payment_minor, "on this payment"),
                        (totals.agents_customer_window_minor, f"to this customer in the last {window_hours} h"))
    kind = "agents" if by_agent else "people"
    so_far = {"amount": amount, f"{kind}_on_payment": totals.agents_payment_minor,
              f"{kind}_on_customer": totals.agents_customer_window_minor, "window_hours": window_hours}
    if limits is None:
        rule("approval_threshold", "APPROVAL_REQUIRED", True,
             message=f"No refund limits are set for {payment.currency}: a person decides.")
    else:
        threshold = int(limits.reason_thresholds.get(reason, limits.approval_threshold_minor))
        rule("approval_threshold", "APPROVAL_REQUIRED", amount > threshold, limit=threshold, observed=amount,
             message=lambda: f"{money(amount)} is above the {money(threshold)} an agent may refund alone.",
             passed=lambda: f"{money(amount)} is within the {money(threshold)} an agent may refund alone.")
        rule("approval_threshold_cumulative", "APPROVAL_REQUIRED_CUMULATIVE",
             before > 0 and before + amount > threshold, limit=threshold, observed=before + amount, inputs=so_far,
             message=lambda: f"{money(before)} already refunded by {kind} {scope}, plus {money(amount)}, is "
                             f"{money(before + amount)}: above the {money(threshold)} {kind} may refund "
                             f"without a second person.",
             passed=lambda: f"{money(before)} already refunded by {kind} {scope}, plus {money(amount)}, is "
                            f"{money(before + amount)}: within the {money(threshold)} {kind} may refund "
                            f"without a second person.")
    if requester_authority is not None:
        rule("requester_authority", "ABOVE_REQUESTER_AUTHORITY", before + amount > requester_authority,
             limit=requester_authority, observed=before + amount, inputs=so_far,
             message=lambda: (f"{money(amount)}" + (f", with the {money(before)} already refunded by people "
                                                    f"{scope}," if before else "")
                              + f" is above the {money(requester_authority)} the requester may approve: "
                                f"someone else decides."),
             passed=lambda: (f"{money(amount)}" + (f", with the {money(before)} already refunded by people "
                                                   f"{scope}," if before else "")
                             + f" is within the {money(requester_authority)} the requester may approve."))
    rules = rules or HoldRules()  # no rules saved: every hold on (the model's defaults), never none
    if rules.hold_disputed:
        rule("payment_disputed", "PAYMENT_DISPUTED", payment.is_disputed,
             observed=payment.dispute_status)
    if rules.hold_flagged:
        rule("payment_flagged", "PAYMENT_FLAGGED", bool(payment.fraud_flags), observed=payment.fraud_flags)
    if rules.hold_recent_contact_change:
        since = now - timedelta(days=rules.contact_change_days)
        customer = payment.customer
        changed = [name for name, at in (("email", customer.email_changed_at),
                                         ("address", customer.address_changed_at)) if at and at >= since]
        rule("recent_contact_change", "RECENT_CONTACT_CHANGE", bool(changed),
             limit=rules.contact_change_days, observed=changed)
    if rules.hold_customer_velocity:
        would_be = totals.customer_velocity_count + 1
        rule("customer_velocity", "CUSTOMER_VELOCITY", would_be > rules.velocity_max_refunds,
             limit=rules.velocity_max_refunds, observed=totals.customer_velocity_count,
             inputs={"window_hours": rules.velocity_window_hours, "would_be": would_be})
    return fired


def _ledger_check(payment: Payment, mismatch: bool) -> Check:
    return Check("ledger_reconciled", "hold" if mismatch else "pass", code="LEDGER_MISMATCH" if mismatch else "",
                 message=f"Payment {payment.id} has an open reconciliation discrepancy (its gateway's books and "
                         f"ours disagree): a person decides until finance resolves it." if mismatch else "",
                 observed=mismatch)


# Holds that ask who may approve this amount. A person resubmitting a failed refund has had their
# authority for it checked (approvals.services.ensure_approval_authority): they are that approval.
AUTHORITY_HOLDS = ("APPROVAL_REQUIRED", "APPROVAL_REQUIRED_CUMULATIVE", "ABOVE_REQUESTER_AUTHORITY")


def evaluate_resubmission(*, payment: Payment, ask: RefundAsk, limits: RefundLimits | None,
                          rules: HoldRules | None, totals: Totals, now: datetime, approver: str,
                          ledger_mismatch: bool) -> Decision:
    """A person sends a failed refund again: a new ask today, so every check and limit runs again.
    Refusals stand; a hold for a risk that arose (dispute, flag, contact change, velocity) waits for
    a decision; the authority holds are met by the person resubmitting. The kill switch and the
    breaker pause agents, and a person is acting, as when a person approves a held refund."""
    decision = evaluate_refund(payment=payment, ask=ask, limits=limits, rules=rules, totals=totals, now=now,
                               paused=False, breaker_open=False, ledger_mismatch=ledger_mismatch)
    if ledger_mismatch and decision.outcome != "denied" and "LEDGER_MISMATCH" not in decision.hold_reasons:
        # A person's refund too: the failure being sent again may have been paid (see reconciliation).
        decision.checks.append(_ledger_check(payment, True))
        decision.outcome = "held"
        decision.hold_reasons.append("LEDGER_MISMATCH")
    if decision.outcome != "held":
        return decision
    for check in decision.checks:
        if check.result == "hold" and check.code in AUTHORITY_HOLDS:
            check.result, check.code = "pass", ""
            check.message += f" Resubmitted by {approver}, whose authority covers it."
    decision.hold_reasons = [r for r in decision.hold_reasons if r not in AUTHORITY_HOLDS]
    if decision.hold_reasons:
        decision.message = "Held for a person: " + ", ".join(decision.hold_reasons) + "."
        return decision
    return Decision("approved", decision.amount_minor, checks=decision.checks)


# -- what a verdict keeps so that a draft policy can be replayed on it (refundops.services.backtest) --

def _at(value: datetime | None) -> str | None:
    return value.isoformat() if value else None


def _from(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value) if value else None


def policy_input(*, payment: Payment, ask: RefundAsk, limits: RefundLimits | None, rules: HoldRules | None,
                 now: datetime, paused: bool, breaker_open: bool, ledger_mismatch: bool) -> dict[str, Any]:
    """Everything ``evaluate_refund`` read besides the totals (the verdict keeps those): the validated
    ask, the payment and customer facts as locked, which versions decided, the switches, the time."""
    customer = payment.customer
    return {
        "ask": {"amount_minor": ask.amount_minor, "reason": ask.reason, "destination": ask.destination,
                "agent_id": ask.agent_id, "session_id": ask.session_id,
                "requester_authority_minor": ask.requester_authority_minor},
        "payment": {"id": payment.pk, "currency": payment.currency, "status": payment.status,
                    "captured": payment.amount_captured_minor, "refunded": payment.amount_refunded_minor,
                    "reserved": payment.amount_reserved_minor, "captured_at": _at(payment.captured_at),
                    "dispute_status": payment.dispute_status, "fraud_flags": payment.fraud_flags,
                    "email_changed_at": _at(customer.email_changed_at),
                    "address_changed_at": _at(customer.address_changed_at)},
        "limits_id": limits.pk if limits else None, "rules_id": rules.pk if rules else None,
        "now": now.isoformat(), "paused": paused, "breaker_open": breaker_open, "ledger_mismatch": ledger_mismatch,
    }


@dataclass(frozen=True)
class RecordedCustomer:
    email_changed_at: datetime | None
    address_changed_at: datetime | None


@dataclass(frozen=True)
class RecordedPayment:
    """The payment facts a verdict kept, read by ``evaluate_refund`` as it reads a Payment (a model
    instance costs more to build than the whole decision: a backtest replays 100,000 of these)."""

    id: str
    currency: str
    status: str
    amount_captured_minor: int
    amount_refunded_minor: int
    amount_reserved_minor: int
    captured_at: datetime | None
    dispute_status: str
    fraud_flags: list[str]
    customer: RecordedCustomer

    @property
    def pk(self) -> str:
        return self.id

    Dispute = Payment.Dispute
    refundable_minor = Payment.refundable_minor  # the model's own properties: one definition
    is_disputed = Payment.is_disputed


@dataclass(frozen=True)
class Replay:
    """A recorded request, ready for ``evaluate_refund`` again."""

    payment: RecordedPayment
    ask: RefundAsk
    totals: Totals
    now: datetime
    paused: bool
    breaker_open: bool
    limits_id: int | None
    rules_id: int | None
    ledger_mismatch: bool = False  # recorded since reconciliation; older verdicts had none open to read


_TOTAL_FIELDS = frozenset(Totals.__dataclass_fields__)


def replay_input(recorded: dict[str, Any], totals: dict[str, Any]) -> Replay:
    p = recorded["payment"]
    payment = RecordedPayment(
        id=p["id"], currency=p["currency"], status=p["status"], amount_captured_minor=p["captured"],
        amount_refunded_minor=p["refunded"], amount_reserved_minor=p["reserved"], captured_at=_from(p["captured_at"]),
        dispute_status=p["dispute_status"], fraud_flags=p["fraud_flags"],
        customer=RecordedCustomer(_from(p["email_changed_at"]), _from(p["address_changed_at"])))
    return Replay(payment=payment, ask=RefundAsk(**recorded["ask"]),
                  totals=Totals(**{k: v for k, v in totals.items() if k in _TOTAL_FIELDS}),
                  now=datetime.fromisoformat(recorded["now"]), paused=recorded["paused"],
                  breaker_open=recorded["breaker_open"], limits_id=recorded["limits_id"],
                  rules_id=recorded["rules_id"], ledger_mismatch=recorded.get("ledger_mismatch", False))
