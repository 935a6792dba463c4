"""A bench's audit chain written in minutes, by the real code (issues 31 and 32).

The benches need chains of millions of entries that ``verify_audit`` accepts. Writing them as the
services do (``record_audit``, then the sealer's ``seal_pending``: an instance, a MAC check and an
UPDATE per entry) took ~29 minutes a million here. This writes the same rows another way, with the
same functions:

- each entry's MAC is ``audit.walk.entry_mac_of`` (what ``entry_mac`` calls), and each recorded
  row's digest ``audit.chain.values_digest`` of the row as Django reads it back (what
  ``verify_audit``'s single-process walk compares), computed in ``processes`` forked processes,
  chunk by chunk;
- this process gives the entries their ids and seqs in order and links each with
  ``audit.chain._link_hash`` (what ``seal_pending`` calls), then sends them sealed with COPY: no
  UPDATE, the sealer finds nothing left to do.

The verdicts are covered the sealer's way too: one ``verdicts.chained`` entry per ``COVER``
verdicts, recording each one's digest, its uid the mark the seeding SQL put in the verdicts'
``chained_by`` (``cover_uid``). tests/test_bench_fast_chain.py seeds a small chain this way and
checks that ``verify_audit`` says ok, and that an edited verdict or history row is then found.
"""

from __future__ import annotations

import collections
import hashlib
import json
import multiprocessing
import uuid
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import Any

import psycopg

COVER = 5_000  # verdicts recorded by one verdicts.chained entry (the benches' sealer batch)
AHEAD = 4  # chunks computed ahead of the writer: memory stays a few chunks whatever the chain's length

# An entry as a task builds it: (uid, created_at, actor, action, subject_type, subject_id, data, records).
Entry = tuple[uuid.UUID, datetime, str, str, str, str, dict[str, Any], list[dict[str, Any]]]
Task = tuple[Callable[..., list[Entry]], tuple]

COLUMNS = ("id", "uid", "seq", "created_at", "actor", "action", "subject_type", "subject_id", "data", "records",
           "mac", "prev_hash", "hash", "sealed_at")


def cover_uid(batch: int) -> uuid.UUID:
    """The uid of the entry covering verdict batch ``batch``; the seeding SQL spells the same mark as
    ``md5('chain' || batch)::uuid``."""
    return uuid.UUID(hashlib.md5(f"chain{batch}".encode()).hexdigest())


COVER_MARK_SQL = f"md5('chain' || ((i - 1) / {COVER}))::uuid"  # for verdict i of 1..n


def cover_entry(batch: int, verdict_ids: Sequence[str]) -> Entry:
    """The ``verdicts.chained`` entry ``chain_verdicts`` writes for these verdicts, with its uid the
    mark they carry: the digests of the verdicts as Django reads them back."""
    from audit.chain import VERDICTS_CHAINED, sealed_fields, values_digest
    from audit.models import Verdict

    names = sealed_fields(Verdict)
    rows = sorted(Verdict._base_manager.filter(pk__in=list(verdict_ids)).values_list("pk", *names))
    if len(rows) != len(verdict_ids):
        raise RuntimeError(f"verdict batch {batch}: {len(rows)} of {len(verdict_ids)} verdicts found")
    records = [{"model": "audit.verdict", "pk": pk, "digest": values_digest("audit.verdict", names, values)}
               for pk, *values in rows]
    latest = max(values[names.index("created_at")] for _, *values in rows)
    return (cover_uid(batch), latest, "system:sealer", VERDICTS_CHAINED, "verdicts",
            f"{rows[0][0]}..{rows[-1][0]}"[:60], {"count": len(rows)}, records)


def _macs(task: Task) -> list[tuple]:
    """In a worker: the task's entries, each with its MAC (``entry_mac``'s function and key)."""
    from django.conf import settings

    from audit import walk

    build, params = task
    return [(*entry, walk.entry_mac_of(settings.AUDIT_KEY, *entry)) for entry in build(*params)]


def write_chain(conninfo: str, tasks: Sequence[Task], *, processes: int = 2) -> int:
    """Write the tasks' entries, in task order, sealed onto the chain's head; return how many."""
    from django.db import connections
    from django.utils import timezone

    from audit.chain import _link_hash, chain_head

    head = chain_head()
    connections.close_all()  # the forked workers open their own connections
    written, now = 0, timezone.now()
    with psycopg.connect(conninfo) as conn, conn.cursor() as cursor:
        conn.execute("SET synchronous_commit = off")  # a bench's rows: a crash means seeding again
        conn.execute("SET session_replication_role = replica")  # the append-only triggers step aside
        if conn.execute("SELECT count(*) FROM audit_auditentry WHERE seq IS NULL").fetchone()[0]:
            raise RuntimeError("entries wait for the sealer: seal them first, the chain is written after them")
        next_id = conn.execute("SELECT coalesce(max(id), 0) + 1 FROM audit_auditentry").fetchone()[0]
        seq, prev = head.seq, head.hash
        with multiprocessing.get_context("fork").Pool(processes) as pool, cursor.copy(
                f"COPY audit_auditentry ({', '.join(COLUMNS)}) FROM STDIN") as copy:
            pending: collections.deque = collections.deque()
            queued = iter(tasks)
            for task in queued:
                pending.append(pool.apply_async(_macs, (task,)))
                if len(pending) >= AHEAD:
                    break
            while pending:
                chunk = pending.popleft().get()
                if (task := next(queued, None)) is not None:
                    pending.append(pool.apply_async(_macs, (task,)))
                for uid, created_at, actor, action, subject_type, subject_id, data, records, mac in chunk:
                    seq += 1
                    link = _link_hash(seq, prev, next_id, mac)
                    copy.write_row((next_id, uid, seq, created_at, actor, action, subject_type, subject_id,
                                    json.dumps(data), json.dumps(records), mac, prev, link, now))
                    next_id, prev = next_id + 1, link
                written += len(chunk)
        if written:  # the next entry the app appends takes the id after the last one written here
            conn.execute("SELECT setval(pg_get_serial_sequence('audit_auditentry', 'id'), %s)", [next_id - 1])
    return written
