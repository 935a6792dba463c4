"""The merchant webhook drain benchmark's floor (bench/webhook_drain.py): the least a worker does to
deliver one event, on the same Celery worker, pool, broker and queue as ``deliver_webhook``.

Per delivery: read its body (one statement), POST it to the merchant over a kept connection, mark it
delivered (one statement), on one psycopg connection the worker process keeps. No ORM, no signing,
no address check, no attempt log.
"""

from __future__ import annotations

import os

import psycopg
import urllib3
from celery import shared_task

DDL = """
CREATE TABLE IF NOT EXISTS webhook_floor_delivery (
    id bigint PRIMARY KEY, url text NOT NULL, body bytea NOT NULL, delivered_at timestamptz);
"""
_connection: psycopg.Connection | None = None
_http: urllib3.PoolManager | None = None


def _kept() -> tuple[psycopg.Connection, urllib3.PoolManager]:
    """This worker process's own connection and HTTP pool, made on first use (after the fork)."""
    global _connection, _http
    if _connection is None or _connection.closed:
        _connection = psycopg.connect(os.environ["DATABASE_URL"], autocommit=True)
    if _http is None:
        _http = urllib3.PoolManager(maxsize=4)
    return _connection, _http


@shared_task(name="bench.webhook_drain_floor.post", acks_late=True)
def post(*, delivery_id: int) -> str:
    conn, http = _kept()
    row = conn.execute("SELECT url, body FROM webhook_floor_delivery WHERE id = %s AND delivered_at IS NULL",
                       [delivery_id]).fetchone()
    if row is None:
        return "delivered"
    answer = http.request("POST", row[0], body=bytes(row[1]), headers={"Content-Type": "application/json"},
                          retries=False, timeout=10)
    if not 200 <= answer.status < 300:
        return f"HTTP {answer.status}"
    conn.execute("UPDATE webhook_floor_delivery SET delivered_at = clock_timestamp() WHERE id = %s", [delivery_id])
    return "delivered"
