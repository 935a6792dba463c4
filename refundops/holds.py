"""What each hold reason means, in a sentence a person reads: the one place the admin's pages
(held queue, refund list and page, verdicts) take them from. The codes themselves are the API's
(docs/CONTRACT.md) and stay as they are; the verdict's checks say the figures."""

from __future__ import annotations

from collections.abc import Iterable

HOLD_REASONS: dict[str, str] = {
    "APPROVAL_REQUIRED": "The amount is above the amount an agent may refund without a person.",
    "APPROVAL_REQUIRED_CUMULATIVE": "With what agents already refunded on this payment or to this customer, "
                                    "the total is above the amount an agent may refund without a person.",
    "ABOVE_REQUESTER_AUTHORITY": "The amount is above what the person who asked may approve: someone else decides.",
    "PAYMENT_DISPUTED": "The customer has disputed this payment with their bank.",
    "PAYMENT_FLAGGED": "The payment is flagged by fraud screening.",
    "RECENT_CONTACT_CHANGE": "The customer's email or address changed recently.",
    "CUSTOMER_VELOCITY": "This customer has had many refunds in a short time.",
    "LEDGER_MISMATCH": "The gateway's books and ours disagree on this payment until finance resolves it.",
}


def hold_reason_sentences(codes: Iterable[str]) -> list[str]:
    """The sentence of each code, in order; a code without one (newer than this table) as itself."""
    return [HOLD_REASONS.get(code, code) for code in codes or ()]
