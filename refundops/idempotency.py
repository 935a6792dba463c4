"""One idempotency key, one effect. The first answer is stored in the same transaction as the
effect; a unique constraint on (caller, key) makes racing duplicates wait and then replay it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from django.db import connection
from django.utils import timezone

from refundops import batching
from refundops.answers import encoded
from refundops.models import IdempotencyRecord
from refundops.rows import db


def request_hash(operation: str, data: Any) -> str:
    canonical = json.dumps([operation, data], sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass(frozen=True)
class Replay:
    record: IdempotencyRecord | None  # None: this caller now owns the key
    reused: bool = False  # the key was first used with another body


def find(scope: str, key: str, digest: str) -> Replay | None:
    record = IdempotencyRecord.objects.filter(scope=scope, key=key).first()
    if record is None:
        return None
    return Replay(record, reused=record.request_hash != digest)


# ON CONFLICT DO NOTHING rather than catching the unique violation: one statement, and no
# savepoint to keep the transaction usable. PostgreSQL and SQLite alike.
_CLAIM_SQL = f"""
INSERT INTO {IdempotencyRecord._meta.db_table}
  (scope, "key", operation, request_hash, response_status, response_body, created_at)
VALUES (%s, %s, %s, %s, 0, '{{}}', %s)
ON CONFLICT (scope, "key") DO NOTHING
RETURNING id"""


def claim(scope: str, key: str, operation: str, digest: str) -> Replay:
    """Inside the caller's transaction: take the key, or learn who has it. A concurrent first use
    blocks here on the unique index until it commits, then we replay its answer."""
    wrapper = db()
    now = wrapper.ops.adapt_datetimefield_value(timezone.now())
    with wrapper.cursor() as cursor:
        cursor.execute(_CLAIM_SQL, [scope, key, operation, digest, now])
        if cursor.fetchone() is not None:
            return Replay(record=None)
    existing = IdempotencyRecord.objects.get(scope=scope, key=key)
    return Replay(existing, reused=existing.request_hash != digest)


_STORE_SQL = f"""UPDATE {IdempotencyRecord._meta.db_table} SET response_status = %s, response_body = %s::jsonb
 WHERE scope = %s AND "key" = %s"""


def store(scope: str, key: str, status: int, body: dict[str, Any]) -> bytes:
    """The first answer, in the transaction that claimed the key; returns it encoded
    (``answers.encoded``), the text stored and the bytes the REST face sends: encoded once. On
    PostgreSQL the statement the ORM's update() writes, by hand: compiling it cost more Python than
    the claim and the store take in PostgreSQL together (every POST stores one); in a batch
    (refundops.batching) it goes with the writes before the commit."""
    text = encoded(body)
    if connection.vendor != "postgresql":
        IdempotencyRecord.objects.filter(scope=scope, key=key).update(response_status=status, response_body=body)
        return text
    batching.defer(_STORE_SQL, [status, text.decode(), scope, key])
    return text
