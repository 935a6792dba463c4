"""``verify_audit`` over several processes: the chain split into ranges of seq, each range checked
by a process of its own (``audit.verify_worker``), the results put together in chain order.

Each entry's MAC and the digests of the rows it records stand alone, and the link of an entry
needs only its own columns and the hash of the entry before, so a range (lo, hi] is checked from
the stored hash of entry #lo. That start is then proven by the range before: its result is taken
only if every range before it verified in whole and ended at #lo with that very hash. Otherwise
(an entry missing at a range's edge, a range that could not be read exactly, a process that died)
the chain is checked from the end of the last range taken by the single-process walk of
``audit.chain``, in this process. Either way the first failure named, and the count before it, are
those a single process gives; progress counts the entries checked across the ranges so far.

Memory: each process holds one chunk (``--chunk-size``); this one holds the ranges' last lines.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from django.apps import apps
from django.conf import settings
from django.db import connection
from django.db.models import Max
from psycopg.conninfo import make_conninfo

from audit import chain
from audit import walk as rules  # this module's walk() is the parallel one
from audit.models import AuditEntry
from audit.walk import GENESIS, ENTRY_COLUMNS, Head

log = logging.getLogger("refundops.audit")

# Below this many sealed entries one process is quicker than starting others (~0.3 s each).
MIN_ENTRIES = 20_000


def default_processes() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def usable(processes: int) -> bool:
    """Other processes see only what is committed, through PostgreSQL: not inside a transaction
    (a test's, or one that wrote entries not yet committed), not on SQLite (embedded mode)."""
    return processes > 1 and connection.vendor == "postgresql" and not connection.in_atomic_block


def conninfo() -> str:
    params = connection.get_connection_params()
    plain = {k: v for k, v in params.items() if isinstance(v, str | int) and not isinstance(v, bool)
             and k not in ("cursor_factory", "context", "prepare_threshold")}
    return make_conninfo("", **plain)


# Primary keys loaded as str or int, as a record's pk is in its JSON (the worker spells other types at load).
_PLAIN_PKS = frozenset({"AutoField", "BigAutoField", "SmallAutoField", "IntegerField", "BigIntegerField",
                        "SmallIntegerField", "PositiveIntegerField", "PositiveBigIntegerField",
                        "PositiveSmallIntegerField", "CharField", "TextField", "SlugField"})


def _models() -> dict[str, dict[str, Any]]:
    """How each model an entry may record is stored: what the worker reads for its digest."""
    specs = {}
    for model in apps.get_models(include_auto_created=True):
        names = chain.sealed_fields(model)
        by_attname = {f.attname: f for f in model._meta.concrete_fields}
        specs[model._meta.label_lower] = {
            "table": connection.ops.quote_name(model._meta.db_table),
            "pk": connection.ops.quote_name(model._meta.pk.column),
            "names": names, "columns": [connection.ops.quote_name(by_attname[n].column) for n in names],
            "verbose": str(model._meta.verbose_name), "plain_pk": model._meta.pk.get_internal_type() in _PLAIN_PKS}
    return specs


def _job(*, batch_size: int, head: Head | None) -> dict[str, Any]:
    by_name = {f.name: f for f in AuditEntry._meta.concrete_fields}
    columns = [connection.ops.quote_name(AuditEntry._meta.pk.column if name == "pk" else by_name[name].column)
               for name in ENTRY_COLUMNS]
    return {"conninfo": conninfo(), "key": settings.AUDIT_KEY, "batch_size": batch_size,
            "records_batch": rules.RECORDS_BATCH,
            "head": [head.seq, head.hash] if head else None, "models": _models(),
            "entry_table": connection.ops.quote_name(AuditEntry._meta.db_table), "entry_columns": columns}


class _Range:
    """One worker process and what it said."""

    def __init__(self, index: int, job: dict[str, Any], said: queue.Queue):
        self.index, self.lo, self.result, self.checked = index, job["lo"], None, 0
        self.errors = tempfile.TemporaryFile()
        root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        self.process = subprocess.Popen([sys.executable, "-m", "audit.verify_worker"], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self.errors, env=env, cwd=root)
        self.process.stdin.write(json.dumps(job).encode())
        self.process.stdin.close()
        threading.Thread(target=self._read, args=(said,), daemon=True).start()

    def _read(self, said: queue.Queue) -> None:
        try:
            for line in self.process.stdout:
                try:
                    said.put((self.index, json.loads(line)))
                except ValueError:  # not one of its lines: the range falls back when it ends
                    continue
        finally:
            self.process.wait()
            said.put((self.index, None))  # the end of what it says

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        self.errors.close()

    def why_not(self) -> str:
        self.errors.seek(0)
        return self.errors.read().decode(errors="replace")[-2000:]


def observe(run: dict[str, Any]) -> None:
    """How a parallel walk went (tests watch it): ranges started, results taken in chain order, and
    the count from which this process walked on by itself (None if it did not)."""


def walk(*, processes: int, batch_size: int, progress: chain._Progress, head: Head | None,
         snapshot: str | None = None) -> Iterator[tuple[int, AuditEntry | None, str]]:
    """``chain._walk`` over ``processes`` ranges at once; the same items, returns the same count."""
    last = AuditEntry.objects.filter(seq__isnull=False).aggregate(last=Max("seq"))["last"]
    if last is None or last < max(MIN_ENTRIES, processes):
        return (yield from chain._walk(batch_size=batch_size, progress=progress, head=head))
    bounds = [None, *(last * k // processes for k in range(1, processes)), None]
    said: queue.Queue = queue.Queue()
    job = {**_job(batch_size=batch_size, head=head), "snapshot": snapshot}  # each range reads the same snapshot
    ranges: list[_Range] = []
    try:
        for k, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            ranges.append(_Range(k, {**job, "lo": lo, "hi": hi}, said))
    except OSError as cannot:  # no process to be had (limits, a read-only interpreter): one walk, here
        log.warning("verify_audit: checking the chain in one process: %s", cannot)
        for started in ranges:
            started.stop()
        return (yield from chain._walk(batch_size=batch_size, progress=progress, head=head))
    run = {"ranges": len(ranges), "taken": 0, "checked_here_from": None}
    try:
        checked, prev_hash, after = 0, GENESIS, None
        for current in ranges:
            while current.result is None:
                index, message = said.get()
                where = ranges[index]
                if message is None:
                    where.result = where.result or {"fallback": f"the process ended ({where.why_not()})"}
                elif "progress" in message:
                    where.checked = message["progress"]
                    yield from progress.at(sum(r.checked for r in ranges))
                else:
                    where.result = message
            result = current.result
            proven = current.lo is None or (checked == current.lo and result.get("done", {}).get("start_prev")
                                            == prev_hash)
            if "done" not in result or not proven:
                if "fallback" in result:
                    log.warning("verify_audit: range %s of the chain checked in one process: %s", current.index,
                                result["fallback"])
                for other in ranges:
                    other.stop()
                run["checked_here_from"] = checked
                return (yield from chain._walk(batch_size=batch_size, progress=progress, head=head,
                                               prev_hash=prev_hash, checked=checked, after=after))
            done = result["done"]
            run["taken"] += 1
            if fault := done["fault"]:
                yield checked + fault["index"], AuditEntry.objects.get(pk=fault["id"]), fault["why"]
                return None
            if done["verified"]:
                checked, prev_hash, after = checked + done["verified"], done["last_hash"], done["last_seq"]
        return checked
    finally:
        for one in ranges:
            one.stop()
        observe(run)
