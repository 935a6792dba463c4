"""django-simple-history keeps a change reason in 100 characters. Reasons are built from names and
notes people type, so one that is longer is cut to fit (ending in "…") rather than failing the act
it describes; the act's audit entry keeps the whole text (actor, note, proposal)."""

from __future__ import annotations

from typing import Any


def fit_change_reason(sender, history_instance: Any, **kwargs: Any) -> None:
    reason = history_instance.history_change_reason
    limit = history_instance._meta.get_field("history_change_reason").max_length
    if reason and limit and len(reason) > limit:
        history_instance.history_change_reason = reason[:limit - 1] + "…"
