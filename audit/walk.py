"""The audit chain's spelling and checks, without Django: what ``audit.chain`` computes and what
each process of a parallel ``verify_audit`` (``audit.verify_worker``) runs over its range of the
chain. One copy of each rule, so a range checked in another process is checked by the same code.

Nothing here reads settings or the database: the key and the rows are given.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, date, datetime, time
from decimal import Decimal
from typing import Any
from uuid import UUID

GENESIS = "0" * 64

_AS_IS = frozenset({str, int, bool})


def _plain(value: Any) -> Any:
    """One spelling per value, whether it comes from memory or back from the database (jsonb
    gives 1e2 back as 100, a datetime comes back in UTC, a Decimal with its field's places)."""
    if value is None or type(value) in _AS_IS:  # most values: spelled as they are (not a subclass)
        return value
    if isinstance(value, dict):  # a plain value inside is kept without a call (most of a verdict's)
        return {k if type(k) is str else str(k): v if v is None or type(v) in _AS_IS else _plain(v)
                for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [v if v is None or type(v) in _AS_IS else _plain(v) for v in value]
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, datetime):
        return value.astimezone(UTC).isoformat()
    if isinstance(value, Decimal):
        return format(value.normalize(), "f")
    if isinstance(value, date | time):
        return value.isoformat()
    if isinstance(value, UUID):
        return str(value)
    if isinstance(value, bytes | memoryview):
        return bytes(value).hex()
    return value


# What json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False) builds on each
# call, built once: verify_audit spells millions of values.
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def canonical(value: Any) -> bytes:
    return _CANONICAL.encode(_plain(value)).encode()


@functools.lru_cache(maxsize=4)
def _keyed(key: str) -> hmac.HMAC:
    """HMAC-SHA256 with the key already absorbed; ``.copy()`` it per message (a third of the cost)."""
    return hmac.new(key.encode(), digestmod=hashlib.sha256)


def keyed_hmac(key: str, message: bytes) -> str:
    keyed = _keyed(key).copy()
    keyed.update(message)
    return keyed.hexdigest()


def entry_mac_of(key: str, uid, created_at, actor, action, subject_type, subject_id, data, records) -> str:
    return keyed_hmac(key, canonical({"uid": uid, "created_at": created_at, "actor": actor, "action": action,
                                      "subject_type": subject_type, "subject_id": subject_id, "data": data,
                                      "records": records}))


def values_digest(label: str, names: Sequence[str], values: Sequence[Any]) -> str:
    """SHA-256 of a recorded row read as values, in its model's sealed fields' order."""
    return hashlib.sha256(canonical({"model": label, "fields": dict(zip(names, values, strict=True))})).hexdigest()


@dataclass(frozen=True)
class Head:
    """The last sealed entry, ``SEQ:HASH``: what an operator keeps outside the database."""

    seq: int
    hash: str

    @classmethod
    def parse(cls, text: str) -> Head:
        seq, _, digest = text.strip().partition(":")
        if not seq.isdigit() or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError(f"expected SEQ:HASH as printed by `manage.py audit_head`, got {text.strip()!r}")
        return cls(int(seq), digest)

    def __str__(self) -> str:
        return f"{self.seq}:{self.hash}"


# An entry as the walk reads it: values, not a model instance (building one costs more than its MAC).
ENTRY_COLUMNS = ("pk", "seq", "uid", "created_at", "actor", "action", "subject_type", "subject_id", "data",
                 "records", "mac", "prev_hash", "hash")
RECORDS = ENTRY_COLUMNS.index("records")


def first_broken_link(chunk: Sequence[tuple], *, key: str, prev_hash: str, expected: int,
                      head: Head | None) -> tuple[int, str]:
    """How many entries of ``chunk`` verify, in order, and why the next one does not ("" if all do)."""
    for index, (pk, seq, uid, created_at, actor, action, subject_type, subject_id, data, records, mac, prev,
                digest) in enumerate(chunk):
        if seq != expected + index:
            return index, f"entry #{seq} follows #{expected + index - 1}: an entry is missing"
        if not hmac.compare_digest(mac, entry_mac_of(key, uid, created_at, actor, action, subject_type, subject_id,
                                                     data, records)):
            return index, f"entry #{seq} was altered after it was written"
        # mac matched a hex digest and prev is the hash verified before it (or GENESIS): both hex, so
        # this is canonical()'s spelling of the link's dict, without its walk over the values.
        if prev != prev_hash or not hmac.compare_digest(digest, keyed_hmac(
                key, f'{{"id":{pk:d},"mac":"{mac}","prev_hash":"{prev}","seq":{seq:d}}}'.encode())):
            return index, f"entry #{seq} does not link to the entry before it"
        if head is not None and seq == head.seq and digest != head.hash:
            return index, f"entry #{seq} does not match the head kept outside the database ({head})"
        prev_hash = digest
    return len(chunk), ""


# Recorded rows read per query: a chunk's entries may record many more rows than there are entries (a
# verdicts.chained entry records hundreds or thousands of verdicts), and only their digests are kept.
RECORDS_BATCH = 5_000


def batches(pks: set[Any]) -> Iterator[list[Any]]:
    """``pks`` in lists of at most RECORDS_BATCH: one query each, its rows dropped once digested."""
    listed = list(pks)
    for start in range(0, len(listed), RECORDS_BATCH):
        yield listed[start:start + RECORDS_BATCH]


# A chunk's length in SQL: of the next ``batch_size`` sealed entries, those with fewer than RECORDS_BATCH
# rows recorded before them in the chunk (the first always). So a chunk covers at most RECORDS_BATCH rows
# plus its last entry's, however many consecutive entries each record thousands (212 verdicts.chained
# entries of 5,000 verdicts in one chunk of 5,000 entries: 1.06 M records and their digests, 738 MB).
# A records value that is not an array counts none: its MAC fails, the walk names it.
RECORDS_LENGTH = {
    "postgresql": "CASE WHEN jsonb_typeof({r}) = 'array' THEN jsonb_array_length({r}) ELSE 0 END",
    "sqlite": "CASE WHEN json_valid({r}) THEN CASE WHEN json_type({r}) = 'array' THEN json_array_length({r}) "
              "ELSE 0 END ELSE 0 END",
}


def chunk_end_sql(vendor: str, *, table: str, seq: str, records: str, after: str | None, limit: str,
                  most: str) -> str:
    """SQL for a bound on the next chunk's seq (``seq <`` it): the first entry after ``after`` (a
    placeholder; None from the start), among the next ``limit`` (batch_size), with ``most``
    (RECORDS_BATCH) rows or more recorded before it; past every entry when none has. A chunk cut short
    of ``limit`` so covers at least ``most`` rows: one that covers fewer is the end (``chunk_is_last``).
    The running sum streams in seq order and stops at that entry: the records of the entries after it
    are not read for their length (the bench's 64 covering entries in a row: 29% slower when they were)."""
    where = f"{seq} IS NOT NULL" + (f" AND {seq} > {after}" if after is not None else "")
    length = RECORDS_LENGTH[vendor].format(r=records)
    return (f"COALESCE((SELECT {seq} FROM (SELECT {seq}, SUM(n) OVER (ORDER BY {seq} ROWS UNBOUNDED PRECEDING) - n "
            f"AS before FROM (SELECT {seq}, {length} AS n FROM {table} WHERE {where} ORDER BY {seq} "
            f"LIMIT {limit}) AS following) AS running WHERE before >= {most} ORDER BY {seq} LIMIT 1), "
            f"9223372036854775807)")


def chunk_is_last(chunk: Sequence[tuple], batch_size: int, most: int) -> bool:
    """Whether ``chunk`` (read with ``chunk_end_sql``'s bound ``most``) ends the entries: shorter than
    asked and not cut by its records."""
    return len(chunk) < batch_size and sum(
        len(row[RECORDS]) if isinstance(row[RECORDS], list) else 0 for row in chunk) < most


def wanted_records(chunk: Sequence[tuple]) -> dict[str, set[Any]]:
    """The rows a chunk's entries record: their pks by model label."""
    wanted: dict[str, set[Any]] = {}
    for row in chunk:
        for record in row[RECORDS]:
            wanted.setdefault(record["model"], set()).add(record["pk"])
    return wanted


def first_records_fault(chunk: Sequence[tuple], digests: Mapping[tuple[str, Any], str],
                        verbose_name: Callable[[str], str | None]) -> tuple[int, str] | None:
    """The first entry of ``chunk`` whose recorded rows are gone or differ: its index and why.
    ``digests`` holds the digest of each recorded row found, by (label, pk); ``verbose_name`` names
    a label's model, None for a model this install does not have."""
    for index, row in enumerate(chunk):
        for record in row[RECORDS]:
            name = verbose_name(record["model"])
            if name is None:
                return index, f"it records a row of {record['model']}, a model this install does not have"
            digest = digests.get((record["model"], record["pk"]))
            if digest is None:
                return index, f"the {name} {record['pk']} it records is missing"
            if not hmac.compare_digest(digest, record["digest"]):
                return index, f"the {name} {record['pk']} it records was altered"
    return None
