"""Prefixed ids that say what they are (``txn_``, ``rf_``, ``vd_``), as Stripe's do."""

import secrets


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"
