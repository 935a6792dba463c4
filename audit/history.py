"""django-simple-history keeps a change reason in 100 characters. Reasons are built from names and
notes people type, so one that is longer is cut to fit (ending in "…") rather than failing the act
it describes; the act's audit entry keeps the whole text (actor, note, proposal)."""

from __future__ import annotations

from typing import Any


def fitted_reason(history_model: Any, reason: str | None) -> str | None:
    """``reason`` cut to what ``history_model``'s change reason keeps. Also for history rows written
    without simple_history's signal (refundops.services.refunds.write_history, the refund's INSERT
    with its history): a reason too long would fail the act itself."""
    limit = history_model._meta.get_field("history_change_reason").max_length
    if reason and limit and len(reason) > limit:
        return reason[:limit - 1] + "…"
    return reason


def fit_change_reason(sender, history_instance: Any, **kwargs: Any) -> None:
    history_instance.history_change_reason = fitted_reason(type(history_instance),
                                                          history_instance.history_change_reason)
