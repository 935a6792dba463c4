"""Locks in one place, always taken in the same order, so two transactions never wait on each other
in a circle: the payment's row, then the customer, the agent, the platform's switches and the
currency's global total (``lock_scopes``). Locks live in PostgreSQL, not in memory.

No lock is one that every refund waits on. A decision locks the scopes its running totals read:
its payment (row lock), its customer and its agent (exclusive advisory locks; the agent's covers its
sessions). Refunds of different customers and agents run side by side. Two things are global:

* the switches (kill switch, agents off): deciders hold the platform lock *shared*, the switches
  take it exclusively, so a switch waits for the decisions under way and every later one sees it;
* the global daily limit, a total of every refund in a currency. A quarter of the limit is
  headroom for the decisions in flight, cut into ``FAST_PATH_SLOTS`` slots (advisory locks). A
  decider holds the currency's lock shared and as many free slots as its amount ``a`` fills, and
  reads the committed total ``T``. It may pass on that read when ``T + headroom + a <= limit``:
  what the decisions in flight add, unseen by ``T``, is covered by the other slots, so it is at most
  the headroom. A refund that finds too few slots free, or a day past three quarters of its limit,
  is decided again under the currency's lock held exclusively: it waits for those in flight and
  sees every one of them (a one-slot refund finding none free waits for one instead). So the limit
  holds exactly, and refunds serialise on it only near it.
  The slots are sized by the limit, so every decision in flight must count on the same one: a change
  of the limits takes the currency's lock exclusively (``lock_currency``), and a decision that finds
  the limits it read are no longer the latest is decided again exclusively, on the latest.

SQLite (the embedded mode) has no advisory locks and needs none: it lets one writer in at a time.
"""

from __future__ import annotations

import functools
import hashlib
import random
from dataclasses import dataclass

from django.db import connection

from refundops.models import Customer, Payment, PlatformState, Refund
from refundops.rows import Columns, cache_related, db

FAST_PATH_SLOTS = 32
HEADROOM_SHARE = 4  # a quarter of the global daily limit covers the fast-path decisions in flight


def slot_size(limit_minor: int) -> int:
    """What one slot covers of the global daily limit (``limit_minor``)."""
    return limit_minor // HEADROOM_SHARE // FAST_PATH_SLOTS


def slots_for(amount_minor: int, limit_minor: int | None) -> int:
    """The slots a refund of ``amount_minor`` takes on the fast path (more than there are: it can't)."""
    if limit_minor is None:
        return 0  # no limits: nothing global to count against
    size = slot_size(limit_minor)
    return -(-max(amount_minor, 1) // size) if size > 0 else FAST_PATH_SLOTS + 1


def advisory_key(*parts: str) -> int:
    """A stable signed 64-bit advisory lock key for a scope (PostgreSQL's one-key form)."""
    digest = hashlib.blake2b("\x1f".join(("refundops", *parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


PLATFORM_KEY = advisory_key("platform")


def lock_payment(payment_id: str, *, merchant_id: str | None = None) -> Payment | None:
    """The payment, locked, with its customer; None when there is none, or it is not
    ``merchant_id``'s (an agent must not tell the two apart, and must not lock another merchant's
    row). On PostgreSQL the statement the ORM would write, by hand (refundops.rows): the worker takes
    this lock twice a refund, and compiling the ORM's query cost more than running it."""
    wrapper = db()
    if wrapper.vendor != "postgresql":
        payments = Payment.objects.select_for_update(of=("self",)).select_related("customer").filter(pk=payment_id)
        return (payments.filter(merchant_id=merchant_id) if merchant_id else payments).first()
    with wrapper.cursor() as cursor:
        cursor.execute(_lock_payment_sql(bool(merchant_id)), [payment_id, *([merchant_id] if merchant_id else [])])
        row = cursor.fetchone()
    if row is None:
        return None
    payment = _PAYMENT.make(row[:len(_PAYMENT)])
    cache_related(payment, "customer", _CUSTOMER.make(row[len(_PAYMENT):]))
    return payment


def lock_refund(refund_id: str, *, payment: Payment | None = None) -> Refund:
    """The refund, locked, with its payment (``payment``: the caller's, locked before it and so
    current; not read again). Raises ``Refund.DoesNotExist`` as ``get`` does."""
    return _refund(refund_id, payment=payment, lock=True)


def read_refund(refund_id: str) -> Refund:
    """The refund with its payment, as ``lock_refund`` reads them, not locked: the worker's first
    look, before its transaction."""
    return _refund(refund_id, payment=None, lock=False)


def _refund(refund_id: str, *, payment: Payment | None, lock: bool) -> Refund:
    wrapper = db()
    if wrapper.vendor != "postgresql":
        refunds = Refund.objects.select_related("payment")
        return (refunds.select_for_update(of=("self",)) if lock else refunds).get(pk=refund_id)
    with wrapper.cursor() as cursor:
        cursor.execute(_refund_sql(payment is None, lock), [refund_id])
        row = cursor.fetchone()
    if row is None:
        raise Refund.DoesNotExist(f"no refund {refund_id}")
    refund = _REFUND.make(row[:len(_REFUND)])
    if payment is None:
        payment = _PAYMENT.make(row[len(_REFUND):])
    if payment.pk == refund.payment_id:  # else not cached: the caller named the wrong payment
        cache_related(refund, "payment", payment)
    return refund


_PAYMENT, _CUSTOMER, _REFUND = Columns(Payment, "p"), Columns(Customer, "c"), Columns(Refund, "r")


@functools.cache
def _lock_payment_sql(by_merchant: bool) -> str:
    return (
        f"SELECT {_PAYMENT.sql}, {_CUSTOMER.sql} FROM {Payment._meta.db_table} p"
        f" JOIN {Customer._meta.db_table} c ON c.id = p.customer_id WHERE p.id = %s"
        + (" AND p.merchant_id = %s" if by_merchant else "") + " FOR UPDATE OF p")


@functools.cache
def _refund_sql(with_payment: bool, lock: bool) -> str:
    columns, tables = _REFUND.sql, f"{Refund._meta.db_table} r"
    if with_payment:
        columns, tables = f"{columns}, {_PAYMENT.sql}", f"{tables} JOIN {Payment._meta.db_table} p ON p.id = r.payment_id"
    return f"SELECT {columns} FROM {tables} WHERE r.id = %s" + (" FOR UPDATE OF r" if lock else "")


@dataclass(frozen=True)
class ScopeLocks:
    """What ``lock_scopes`` holds: ``slots``, how many fast-path slots (none when exclusive)."""

    exclusive: bool
    slots: int

    def global_fast_path(self, *, limit_minor: int, committed_minor: int, amount_minor: int) -> bool:
        """May a refund of ``amount_minor`` count against the currency's global daily limit on a
        read of the committed total alone? (The module's docstring says why this is exact.)"""
        if self.exclusive:
            return True  # the read saw every refund: nothing else is in flight
        return (slots_for(amount_minor, limit_minor) <= self.slots
                and committed_minor + limit_minor // HEADROOM_SHARE + amount_minor <= limit_minor)


# The locks in the FROM clause run first; the slots are tried after them, so no slot is held while
# a customer's or agent's lock is awaited. LIMIT stops at as many free slots as are wanted.
# The currency's ring of slots is spelled in the statement (fixed by the code, one statement per
# currency), turned by a parameter: bound as a parameter, its 32 keys cost psycopg more to adapt
# on every request than the rest of the statement.
_LOCK_SQL = """
SELECT (SELECT count(*) FROM (SELECT FROM unnest({ring}) AS k WHERE pg_try_advisory_xact_lock(k) LIMIT %s) s)
  FROM (SELECT {locks} OFFSET 0) AS held"""


@functools.cache
def _slot_keys(currency: str) -> tuple[int, ...]:
    return tuple(advisory_key("slot", currency, str(i)) for i in range(FAST_PATH_SLOTS))


@functools.cache
def _lock_sql(currency: str | None, functions: tuple[str, ...]) -> str:
    """The statement for ``functions`` (one parameter each: its key) and, with a currency, its ring
    of slots from a first one given as two parameters: ``ring[start + 1:]``, ``ring[:start]``
    (1-based, as ``ring[start:] + ring[:start]`` in Python)."""
    if currency is None:
        ring = "'{}'::bigint[]"
    else:
        keys = "'{" + ",".join(str(key) for key in _slot_keys(currency)) + "}'::bigint[]"
        ring = f"({keys})[%s:{FAST_PATH_SLOTS}] || ({keys})[1:%s]"
    return _LOCK_SQL.format(ring=ring, locks=", ".join(f"{function}(%s)" for function in functions))


def lock_scopes(*, customer_id: str, agent_id: str | None, currency: str, exclusive: bool = False,
                slots: int = 0) -> ScopeLocks:
    """The locks a refund decision takes after its payment's row, in one statement; held until
    commit. ``exclusive``: the currency's global total too (a decision or a write that must see
    every refund in flight); else up to ``slots`` fast-path slots (``slots_for``) are tried.
    Taken before the running totals are read."""
    wrapper = db()
    if wrapper.vendor != "postgresql":
        return ScopeLocks(exclusive=True, slots=0)
    keys = [("pg_advisory_xact_lock", advisory_key("customer", customer_id))]
    if agent_id:
        keys.append(("pg_advisory_xact_lock", advisory_key("agent", agent_id)))
    keys.append(("pg_advisory_xact_lock_shared", PLATFORM_KEY))
    keys.append(("pg_advisory_xact_lock" if exclusive else "pg_advisory_xact_lock_shared",
                 advisory_key("currency", currency)))
    wanted = 0 if exclusive or slots > FAST_PATH_SLOTS else slots
    start = random.randrange(FAST_PATH_SLOTS)  # spread deciders over the slots
    ring = _slot_keys(currency)
    functions = tuple(function for function, _ in keys)
    with wrapper.cursor() as cursor:
        if wanted:
            cursor.execute(_lock_sql(currency, functions), [start + 1, start, wanted, *(key for _, key in keys)])
        else:
            cursor.execute(_lock_sql(None, functions), [wanted, *(key for _, key in keys)])
        held = cursor.fetchone()[0]
        if wanted == 1 and held == 0:
            # Every slot busy: wait for one rather than decide exclusively, which would queue every
            # decision in the currency behind this one. A slot's holder is a decision under way that
            # waits for nothing this one holds (its own locks came before its slots), so it ends.
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [ring[start]])
            held = 1
    return ScopeLocks(exclusive=exclusive, slots=held)


def lock_currency(currency: str) -> None:
    """For a change of the currency's limits: waits for the decisions in flight (they hold the
    currency's lock shared; a fast-path one holds slots sized by the limit it read) and holds later
    ones until commit. A decision sees the limits it read are still the latest after its own locks
    (``selectors.totals_and_pause``), so every decision in flight counts on the same limit."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [advisory_key("currency", currency)])


def lock_platform() -> PlatformState:
    """For the switches: waits for every refund decision under way (they hold the platform lock
    shared) and holds later ones until commit, so each decision sees a switch before or after."""
    if connection.vendor == "postgresql":
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", [PLATFORM_KEY])
    state = PlatformState.objects.select_for_update().filter(pk=1).first()
    if state is None:
        PlatformState.objects.get_or_create(pk=1)
        state = PlatformState.objects.select_for_update().get(pk=1)
    return state
