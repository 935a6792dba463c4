"""Prefixed ids that say what they are (``txn_``, ``rf_``, ``vd_``), as Stripe's do.

``new_id`` makes ``<prefix>_`` + 24 lowercase hex: 12 hex of the Unix time in milliseconds, then 12
random hex (48 bits from ``secrets``). Ids made in different milliseconds sort as text in the order
they were made (fixed width, lowercase), so a new row's key lands at the right edge of its primary
key's index, and of every index on a column that holds such an id (a verdict's refund_id), instead of
on a random leaf page: bench/ids.py measured a verdict INSERT against 3 M rows (docs/PERFORMANCE.md).
Within one millisecond their order is random; two ids collide only if made in the same millisecond
with the same 48 random bits (about 2 in 10^9 for a thousand ids in one millisecond), and the
primary key refuses the second.

Such an id tells when it was made and is guessable enough that it must never be the only secret:
what is (the sandbox's payment-link page, a webhook endpoint's signing secret) takes ``new_secret``.
"""

import secrets
import time


def new_id(prefix: str) -> str:
    return f"{prefix}_{time.time_ns() // 1_000_000:012x}{secrets.token_hex(6)}"


def new_secret(prefix: str) -> str:
    """``<prefix>_`` + 24 random hex (96 bits): for an id or token that is itself the secret."""
    return f"{prefix}_{secrets.token_hex(12)}"
