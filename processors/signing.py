"""HMAC-SHA256 signatures in the ``t=…,v1=…`` form (as Stripe signs its webhooks).

Used for our outbound events (``RefundOps-Signature``) and for the sandbox gateway's inbound
events (``Sandbox-Signature``). The timestamp is signed with the body, so a replay of an old
event fails the tolerance check.
"""

from __future__ import annotations

import hashlib
import hmac
import time


def sign(payload: bytes, secret: str, *, timestamp: int | None = None) -> str:
    timestamp = int(time.time()) if timestamp is None else timestamp
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + payload, hashlib.sha256)
    return f"t={timestamp},v1={mac.hexdigest()}"


def verify(payload: bytes, header: str, secret: str, *, tolerance: int = 300,
           now: float | None = None) -> int:
    """Return the signed timestamp, or raise ValueError saying what is wrong."""
    parts: dict[str, list[str]] = {}
    for item in (header or "").split(","):
        key, _, value = item.strip().partition("=")
        if key and value:
            parts.setdefault(key, []).append(value)
    try:
        timestamp = int(parts["t"][0])
    except (KeyError, ValueError):
        raise ValueError("signature header has no timestamp") from None
    candidates = parts.get("v1", [])
    if not candidates:
        raise ValueError("signature header has no v1 signature")
    expected = sign(payload, secret, timestamp=timestamp).split("v1=", 1)[1]
    if not any(hmac.compare_digest(expected, c) for c in candidates):
        raise ValueError("signature does not match the payload")
    now = time.time() if now is None else now
    if abs(now - timestamp) > tolerance:
        raise ValueError(f"signature timestamp is outside the {tolerance}s tolerance")
    return timestamp
