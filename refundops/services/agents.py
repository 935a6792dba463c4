"""Agents, their keys and capabilities, and the switches that stop every agent at once.

Operators call these from the command line, administrators from the admin. Each is one
transaction that also writes its audit entry; history rows name the acting user. Authentication
reads the database on every call (``refundops.access``), so each change holds from the next call.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Any

from django.contrib.auth.models import AbstractBaseUser
from django.db import IntegrityError, transaction
from django.db.models import Q
from django.utils import timezone

from audit.services import record_audit
from refundops.access import KEY_PREFIX_LENGTH, generate_key
from refundops.locks import lock_platform
from refundops.models import DEFAULT_MERCHANT_ID, Agent, AgentKey, Capability, Merchant, PlatformState

# A staff user (admin), or a label for who acted elsewhere, such as "cli:alice".
Actor = AbstractBaseUser | str

# Areas that stay with administrators. No capability reaches them; naming one gets a clear no.
WITHHELD_AREAS = ("payout", "key", "webhook")


class AgentAccessError(Exception):
    """A request an operator can correct: an unknown agent, key or capability, a duplicate name."""


def actor_label(actor: Actor) -> str:
    return actor if isinstance(actor, str) else f"user:{actor.get_username()}"


def _save_with_history(instance: Any, *, actor: Actor, reason: str, **save_kwargs: Any) -> Any:
    """Save ``instance``; return the history row it wrote, for the audit entry to record."""
    if not isinstance(actor, str):
        instance._history_user = actor  # simple_history records the acting user from this
    instance._change_reason = f"{reason} by {actor_label(actor)}"
    instance.save(**save_kwargs)
    return instance.history.latest()


def validate_capabilities(capabilities: Iterable[str]) -> list[str]:
    """The capabilities in the contract's order, each once; an unknown one is refused by name."""
    wanted = set()
    for capability in capabilities:
        if capability not in Capability.values:
            withheld = any(area in capability.lower() for area in WITHHELD_AREAS)
            why = ("payout settings, keys and webhooks stay with administrators; no agent capability "
                   "reaches them" if withheld else "not a capability")
            raise AgentAccessError(f"{capability!r}: {why}. Capabilities: {', '.join(Capability.values)}.")
        wanted.add(capability)
    return [c for c in Capability.values if c in wanted]


# Every agent id starts so (models.agents.new_agent_id); no name may, so a value is one or the other.
AGENT_ID_PREFIX = "ag_"


def is_agent_id(value: str) -> bool:
    return value.strip().lower().startswith(AGENT_ID_PREFIX)


def get_agent(agent_id: str, *, lock: bool = False) -> Agent:
    """The agent with this id, never one whose name it is: where an id is meant (the admin's pages,
    proposals), a name shaped like another agent's id must not be taken for it."""
    agents = Agent.objects.select_for_update() if lock else Agent.objects
    agent = agents.filter(pk=agent_id).first()
    if agent is None:
        raise AgentAccessError(f"No agent with id {agent_id!r}.")
    return agent


def find_agent(agent_name_or_id: str, *, lock: bool = False) -> Agent:
    """For the command line, where a person types either: a value starting with 'ag_' is an id, any
    other a name."""
    if is_agent_id(agent_name_or_id):
        return get_agent(agent_name_or_id.strip(), lock=lock)
    agents = Agent.objects.select_for_update() if lock else Agent.objects
    agent = agents.filter(name=agent_name_or_id).first()
    if agent is None:
        raise AgentAccessError(f"No agent named {agent_name_or_id!r} (ids start with {AGENT_ID_PREFIX!r}).")
    return agent


@transaction.atomic
def create_agent(*, name: str, owner: str = "", capabilities: Iterable[str], actor: Actor,
                 expires_at: datetime | None = None, merchant: str = "") -> tuple[Agent, str]:
    """A new agent and its first key. The raw key is returned once and stored only as a hash."""
    name = name.strip()
    if not name or len(name) > 100:
        raise AgentAccessError("An agent name is 1 to 100 characters.")
    if is_agent_id(name):
        raise AgentAccessError(f"An agent name cannot start with {AGENT_ID_PREFIX!r}: agent ids do, and a name "
                               f"shaped like an id could be taken for another agent. Choose another name.")
    granted = validate_capabilities(capabilities)
    if not granted:
        raise AgentAccessError(f"Grant at least one capability: {', '.join(Capability.values)}.")
    # ``merchant``: its id or name; the agent acts for that merchant only (default: the default one).
    found = (Merchant.objects.filter(Q(pk=merchant) | Q(name=merchant)).first() if merchant
             else Merchant.objects.filter(pk=DEFAULT_MERCHANT_ID).first())
    if found is None:
        raise AgentAccessError(f"No merchant {merchant or DEFAULT_MERCHANT_ID!r}.")
    agent = Agent(name=name, owner=owner, capabilities=granted, merchant=found)
    try:
        with transaction.atomic():
            history = _save_with_history(agent, actor=actor, reason="agent created")
    except IntegrityError:
        raise AgentAccessError(f"An agent named {name!r} already exists.") from None
    record_audit(actor=actor_label(actor), action="agent.created", subject_type="agent", subject_id=agent.pk,
                 data={"name": name, "owner": owner, "capabilities": granted, "merchant_id": found.pk},
                 records=[history])
    raw = issue_key(agent=agent, expires_at=expires_at, actor=actor)
    return agent, raw


@transaction.atomic
def issue_key(*, agent: Agent, expires_at: datetime | None = None, actor: Actor) -> str:
    """A new key for ``agent``; the raw key is returned once."""
    if expires_at is not None and expires_at <= timezone.now():
        raise AgentAccessError("A key's expiry must be in the future.")
    raw, prefix, digest = generate_key()
    key = AgentKey(agent=agent, prefix=prefix, key_hash=digest, expires_at=expires_at)
    history = _save_with_history(key, actor=actor, reason="key issued")
    record_audit(actor=actor_label(actor), action="key.issued", subject_type="agent_key", subject_id=prefix,
                 data={"agent_id": agent.pk, "expires_at": expires_at.isoformat() if expires_at else None},
                 records=[history])
    return raw


@transaction.atomic
def revoke_key(*, prefix: str, actor: Actor) -> AgentKey:
    """Revoke the key named by its prefix (a whole pasted key works too). Revoking twice is a no-op."""
    prefix = prefix.strip()[:KEY_PREFIX_LENGTH]
    key = AgentKey.objects.select_for_update().select_related("agent").filter(prefix=prefix).first()
    if key is None:
        raise AgentAccessError(f"No key with prefix {prefix!r}; a prefix is the first {KEY_PREFIX_LENGTH} "
                               f"characters, such as rk_AbCd1234.")
    if key.revoked_at is None:
        key.revoked_at = timezone.now()
        history = _save_with_history(key, actor=actor, reason="key revoked")
        record_audit(actor=actor_label(actor), action="key.revoked", subject_type="agent_key",
                     subject_id=key.prefix, data={"agent_id": key.agent_id}, records=[history])
    return key


def _set_capability(*, agent_id: str, agent_name_or_id: str, capability: str, grant: bool, actor: Actor,
                    proposal: tuple[str, str] | None = None) -> Agent:
    validate_capabilities([capability])
    # The row lock keeps concurrent edits of the list apart. ``agent_id`` where an id is meant.
    agent = get_agent(agent_id, lock=True) if agent_id else find_agent(agent_name_or_id, lock=True)
    held = set(agent.capabilities)
    if (capability in held) == grant:
        return agent
    agent.capabilities = validate_capabilities(held | {capability} if grant else held - {capability})
    verb = "granted" if grant else "revoked"
    # ``proposal``: (id, proposer) when a second person approved this one; the audit entry names both.
    by_proposal = {"proposal_id": proposal[0], "proposed_by": proposal[1]} if proposal else {}
    history = _save_with_history(agent, actor=actor, reason=f"capability {capability} {verb}"
                                 + (f" (proposal {proposal[0]})" if proposal else ""))
    record_audit(actor=actor_label(actor), action=f"capability.{verb}", subject_type="agent",
                 subject_id=agent.pk, data={"capability": capability, "capabilities": agent.capabilities,
                                            **by_proposal},
                 records=[history])
    return agent


@transaction.atomic
def revoke_capability(*, agent_id: str = "", agent_name_or_id: str = "", capability: str, actor: Actor,
                      proposal: tuple[str, str] | None = None) -> Agent:
    return _set_capability(agent_id=agent_id, agent_name_or_id=agent_name_or_id, capability=capability,
                           grant=False, actor=actor, proposal=proposal)


@transaction.atomic
def grant_capability(*, agent_id: str = "", agent_name_or_id: str = "", capability: str, actor: Actor,
                      proposal: tuple[str, str] | None = None) -> Agent:
    return _set_capability(agent_id=agent_id, agent_name_or_id=agent_name_or_id, capability=capability,
                           grant=True, actor=actor, proposal=proposal)


@transaction.atomic
def set_agents_disabled(*, disabled: bool, actor: Actor) -> PlatformState:
    """Switch all agent access off (every key answers UNAUTHENTICATED) or back on."""
    state = lock_platform()
    if state.agents_disabled != disabled:
        state.agents_disabled = disabled
        state.changed_by = actor_label(actor)
        history = _save_with_history(state, actor=actor, reason=f"agents {'disabled' if disabled else 'enabled'}")
        record_audit(actor=actor_label(actor), action=f"agents.{'disabled' if disabled else 'enabled'}",
                     subject_type="platform", subject_id="1", data={"agents_disabled": disabled},
                     records=[history])
    return state


@transaction.atomic
def set_killswitch(*, on: bool, actor: Actor) -> PlatformState:
    """Pause agent refunds (each is refused with CIRCUIT_OPEN) or resume them."""
    state = lock_platform()
    if state.refunds_paused != on:
        state.refunds_paused = on
        state.changed_by = actor_label(actor)
        history = _save_with_history(state, actor=actor, reason=f"kill switch {'on' if on else 'off'}")
        record_audit(actor=actor_label(actor), action=f"killswitch.{'on' if on else 'off'}",
                     subject_type="platform", subject_id="1", data={"refunds_paused": on}, records=[history])
    return state
