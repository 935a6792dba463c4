"""Agent keys and capabilities, the same for REST and MCP. Keys are stored as SHA-256 and compared
in constant time; the raw key is shown once."""

from __future__ import annotations

import hashlib
import hmac
import secrets
from datetime import timedelta

from django.db.models import Exists
from django.utils import timezone

from refundops.errors import ApiError
from refundops.models import Agent, AgentKey, Merchant, PlatformState
from refundops.rows import Columns, cache_related, db

KEY_PREFIX_LENGTH = 11  # "rk_" + 8 characters: enough to name a key, useless to use it
LAST_USED_RESOLUTION = timedelta(seconds=60)


def hash_key(raw: str) -> str:
    return hashlib.sha256(raw.encode()).hexdigest()


def generate_key() -> tuple[str, str, str]:
    """(raw key shown once, its prefix, its hash)."""
    raw = "rk_" + secrets.token_urlsafe(32)
    return raw, raw[:KEY_PREFIX_LENGTH], hash_key(raw)


def authenticate_key(raw: str | None) -> AgentKey:
    """The live key for ``raw``, or ApiError UNAUTHENTICATED saying why. Used by REST and MCP."""
    if not raw:
        raise ApiError("UNAUTHENTICATED", "Send your agent key as 'Authorization: Bearer rk_…'.")
    key = _key_named(raw[:KEY_PREFIX_LENGTH]) if raw.startswith("rk_") else None
    if key is None or not hmac.compare_digest(key.key_hash, hash_key(raw)):
        raise ApiError("UNAUTHENTICATED", "This agent key is not recognised.")
    now = timezone.now()
    if key.revoked_at is not None:
        raise ApiError("UNAUTHENTICATED", f"Key {key.prefix}… was revoked; ask an operator for a new one.")
    if key.expires_at is not None and key.expires_at <= now:
        raise ApiError("UNAUTHENTICATED", f"Key {key.prefix}… expired; ask an operator for a new one.")
    if not key.agent.is_active:
        raise ApiError("UNAUTHENTICATED", f"Agent {key.agent.name} is disabled.")
    if key.all_agents_disabled:
        raise ApiError("UNAUTHENTICATED", "All agent access is switched off by an operator.")
    if key.last_used_at is None or now - key.last_used_at > LAST_USED_RESOLUTION:
        AgentKey.objects.filter(pk=key.pk).update(last_used_at=now)
    return key


def _key_named(prefix: str) -> AgentKey | None:
    """The key with ``prefix``, its agent and the agent's merchant (as ``select_related``), and the
    operators' "all agents off" switch in the same query (``all_agents_disabled``)."""
    wrapper = db()
    if wrapper.vendor != "postgresql":
        all_disabled = Exists(PlatformState.objects.filter(pk=1, agents_disabled=True))
        return (AgentKey.objects.select_related("agent__merchant").annotate(all_agents_disabled=all_disabled)
                .filter(prefix=prefix).first())
    # The statement the ORM would write for the query above, without compiling it on every request.
    global _KEY_SQL
    if _KEY_SQL is None:
        _KEY_SQL = (
            f"SELECT {_KEY.sql}, {_AGENT.sql}, {_MERCHANT.sql}, EXISTS(SELECT 1 FROM"
            f" {PlatformState._meta.db_table} s WHERE s.id = 1 AND s.agents_disabled)"
            f" FROM {AgentKey._meta.db_table} k JOIN {Agent._meta.db_table} a ON a.id = k.agent_id"
            f" JOIN {Merchant._meta.db_table} m ON m.id = a.merchant_id WHERE k.prefix = %s")
    with wrapper.cursor() as cursor:
        cursor.execute(_KEY_SQL, [prefix])
        row = cursor.fetchone()
    if row is None:
        return None
    k, a, m = len(_KEY), len(_KEY) + len(_AGENT), len(_KEY) + len(_AGENT) + len(_MERCHANT)
    key, agent, merchant = _KEY.make(row[:k]), _AGENT.make(row[k:a]), _MERCHANT.make(row[a:m])
    cache_related(agent, "merchant", merchant)
    cache_related(key, "agent", agent)
    key.all_agents_disabled = row[m]
    return key


_KEY, _AGENT, _MERCHANT = Columns(AgentKey, "k"), Columns(Agent, "a"), Columns(Merchant, "m")
_KEY_SQL: str | None = None


def require_capability(key: AgentKey, capability: str) -> None:
    if not key.agent.has_capability(capability):
        raise ApiError("CAPABILITY_NOT_GRANTED",
                       f"Agent {key.agent.name} does not have the '{capability}' capability.",
                       capability=capability)
