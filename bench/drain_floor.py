"""The drain benchmark's floor (bench/drain.py): the least a worker does to pay an approved refund
once, on the same Celery worker, pool, broker and queue as the real task (acks late, prefetch 1).

Per refund, three single-statement transactions on tables of its own, over one psycopg connection
the worker process keeps: claim it (``approved`` to ``submitting``, only if still approved), the
"gateway" (an insert keyed by the refund's idempotency key, a repeat does nothing), record it
(``settled``). No ORM, no lease row, no history, audit, webhooks or ledger sums.
"""

from __future__ import annotations

import os

import psycopg
from celery import shared_task

DDL = """
CREATE TABLE IF NOT EXISTS drain_floor_refund (
    id bigint PRIMARY KEY, amount_minor bigint NOT NULL, idempotency_key text NOT NULL,
    status text NOT NULL DEFAULT 'approved', started_at timestamptz, settled_at timestamptz);
CREATE TABLE IF NOT EXISTS drain_floor_gateway (
    idempotency_key text PRIMARY KEY, refund_id bigint NOT NULL, amount_minor bigint NOT NULL);
"""
_connection: psycopg.Connection | None = None


def connection() -> psycopg.Connection:
    """This worker process's own connection, opened on first use (after the fork) and kept."""
    global _connection
    if _connection is None or _connection.closed:
        _connection = psycopg.connect(os.environ["DATABASE_URL"], autocommit=True)
    return _connection


@shared_task(name="bench.drain_floor.pay", acks_late=True)
def pay(*, refund_id: int) -> str:
    conn = connection()
    claimed = conn.execute(
        "UPDATE drain_floor_refund SET status = 'submitting', started_at = clock_timestamp()"
        " WHERE id = %s AND status = 'approved' RETURNING amount_minor, idempotency_key", [refund_id]).fetchone()
    if claimed is None:
        return "not approved"
    amount_minor, key = claimed
    conn.execute("INSERT INTO drain_floor_gateway (idempotency_key, refund_id, amount_minor) VALUES (%s, %s, %s)"
                 " ON CONFLICT (idempotency_key) DO NOTHING", [key, refund_id, amount_minor])
    conn.execute("UPDATE drain_floor_refund SET status = 'settled', settled_at = clock_timestamp() WHERE id = %s",
                 [refund_id])
    return "settled"
