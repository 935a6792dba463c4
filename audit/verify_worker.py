"""One process of a parallel ``verify_audit``: check one range of the audit chain's seq.

    python -m audit.verify_worker < job.json

Started by ``audit.parallel`` (never by hand), which writes the job on stdin: the database to read
(a libpq conninfo), AUDIT_KEY, the range (``lo`` < seq <= ``hi``; either end open), the chunk size,
the head kept outside the database, and how each model an entry may record is stored. It answers on
stdout, one JSON object a line: ``{"progress": n}`` after each chunk (entries of the range checked
so far), then ``{"done": {...}}`` (how many verified, the last seq and hash, the hash of entry
``lo`` it started from, and the first fault), or ``{"fallback": why}`` when it meets something it
does not read exactly as Django does (then that range is checked again in the verify_audit process).

No Django here: the rows are read with psycopg and checked by ``audit.walk``, the same checks a
single process runs. Each value is read as Django reads it (jsonb decoded by the json module, or by
orjson where it decodes to the same value, inet as text), so each canonical spelling is the same.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable
from datetime import UTC
from typing import Any

import psycopg
from psycopg import sql
from psycopg.adapt import Loader
from psycopg.pq import Format
from psycopg.types.json import set_json_loads
from psycopg.types.string import TextLoader

from audit import walk

try:
    import orjson
except ImportError:  # pragma: no cover - orjson is a dependency; json decodes the same values, slower
    orjson = None

# orjson decodes an integer beyond 64 bits as a float (json.loads keeps it whole) and refuses what
# json.loads takes (1e400, a lone surrogate): a text with such a number, or that orjson refuses,
# goes to json.loads. Any run of 19 digits counts, in a string too: a slower path, never a wrong one.
_LONG_DIGITS = re.compile(rb"[0-9]{19}")


def json_loads(data: bytes | str) -> Any:
    """json.loads's value for a jsonb text, by orjson when it gives the same (test_audit_walk.py)."""
    if orjson is None:
        return json.loads(data)
    raw = data.encode() if isinstance(data, str) else data
    if _LONG_DIGITS.search(raw):
        return json.loads(raw)
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)


class Fallback(Exception):
    """Something this process does not read as Django would: the range is checked in Django."""


# Values the walk only spells: loaded already spelled (``walk._plain`` of what psycopg loads), so the
# spelling of a row or an entry walks no datetime or UUID again. The same function on the same value:
# the same bytes. A primary key of such a type falls back (``plain_pk``): a pk is looked up, not spelled.
SPELLED_AT_LOAD = ("timestamptz", "timestamp", "date", "time", "timetz", "uuid", "numeric", "bytea")


def _spelled(base: type[Loader], name: str) -> type[Loader]:
    if name == "timestamptz":  # most values: walk._plain's own branch for an aware datetime, without the walk
        class Spelled(Loader):
            def __init__(self, oid: int, context=None):
                super().__init__(oid, context)
                self.inner = base(oid, context).load

            def load(self, data):
                return self.inner(data).astimezone(UTC).isoformat()
    else:
        class Spelled(Loader):
            def __init__(self, oid: int, context=None):
                super().__init__(oid, context)
                self.inner = base(oid, context).load

            def load(self, data):
                return walk._plain(self.inner(data))

    return Spelled


def connect(conninfo: str) -> psycopg.Connection:
    conn = psycopg.connect(conninfo, autocommit=True, prepare_threshold=None)  # PgBouncer-safe
    set_json_loads(json_loads, conn)  # Django reads jsonb as text and json.loads it: the same values
    for name in ("inet", "cidr"):  # as Django registers them (psycopg_any.get_adapters_template)
        conn.adapters.register_loader(name, TextLoader)
    if conn.info.parameter_status("TimeZone") != "UTC":
        conn.execute("SET TIME ZONE 'UTC'")  # as Django does; each timestamptz is spelled in UTC either way
    for name in SPELLED_AT_LOAD:
        oid = conn.adapters.types[name].oid
        conn.adapters.register_loader(name, _spelled(conn.adapters.get_loader(oid, Format.TEXT), name))
    return conn


def check_range(job: dict[str, Any], report: Callable[[int], None]) -> dict[str, Any]:
    key, batch_size, lo, hi = job["key"], job["batch_size"], job["lo"], job["hi"]
    most = job.get("records_batch") or walk.RECORDS_BATCH  # the chunks' cut, as the Django walk's
    head = walk.Head(*job["head"]) if job["head"] else None
    models: dict[str, dict[str, Any]] = job["models"]
    table, columns = job["entry_table"], job["entry_columns"]
    seq, records = columns[walk.ENTRY_COLUMNS.index("seq")], columns[walk.RECORDS]
    select = f"SELECT {', '.join(columns)} FROM {table} WHERE {seq} IS NOT NULL"
    if hi is not None:
        select += f" AND {seq} <= %(hi)s"
    with connect(job["conninfo"]) as conn:
        if job.get("snapshot"):  # the evidence pack's: every range reads the rows its CSV lists
            conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
            conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(job["snapshot"])))
        start_prev = None
        if lo is None:
            prev_hash, after = walk.GENESIS, None
        else:
            row = conn.execute(f"SELECT {columns[-1]} FROM {table} WHERE {seq} = %s", [lo]).fetchone()
            start_prev = row[0] if row else None
            prev_hash, after = start_prev or "", lo
        verified, last_hash = 0, None
        expected = 1 if lo is None else lo + 1
        while True:
            end = walk.chunk_end_sql("postgresql", table=table, seq=seq, records=records,
                                     after="%(after)s" if after is not None else None, limit="%(n)s", most="%(most)s")
            query = (select + (f" AND {seq} > %(after)s" if after is not None else "") + f" AND {seq} < {end}"
                     + f" ORDER BY {seq} LIMIT %(n)s")
            chunk = conn.execute(query, {"hi": hi, "after": after, "n": batch_size,
                                         "most": most}).fetchall()
            if not chunk:
                break
            index, why = walk.first_broken_link(chunk, key=key, prev_hash=prev_hash, expected=expected + verified,
                                                head=head)
            if fault := _records_fault(conn, chunk[:index], models):
                index, why = fault
            if why:
                return {"verified": verified + index, "start_prev": start_prev, "last_seq": None, "last_hash": None,
                        "fault": {"index": verified + index, "id": chunk[index][0], "why": why}}
            verified += len(chunk)
            after, prev_hash = chunk[-1][1], chunk[-1][-1]
            last_hash = prev_hash
            report(verified)
            if walk.chunk_is_last(chunk, batch_size, most):
                break
    return {"verified": verified, "start_prev": start_prev, "last_seq": after if verified else None,
            "last_hash": last_hash, "fault": None}


def _records_fault(conn: psycopg.Connection, chunk: list[tuple], models: dict[str, dict[str, Any]]):
    """``audit.chain._records_fault``, reading each model's rows with ``= ANY`` queries of RECORDS_BATCH."""
    digests: dict[tuple[str, Any], str] = {}
    for label, pks in walk.wanted_records(chunk).items():
        spec = models.get(label)
        if spec is None:  # not a model's label_lower: Django's apps.get_model decides what it is
            raise Fallback(f"a record of {label!r}")
        if not spec["plain_pk"]:
            raise Fallback(f"{label}'s primary key is not a string or an integer")
        if any(type(pk) not in (str, int) for pk in pks) or len({type(pk) for pk in pks}) > 1:
            raise Fallback(f"records of {label} by pks of another type")
        query = f"SELECT {spec['pk']}, {', '.join(spec['columns'])} FROM {spec['table']} WHERE {spec['pk']} = ANY(%s)"
        names = spec["names"]
        for batch in walk.batches(pks):
            for pk, *values in conn.execute(query, [batch]):
                digests[label, pk] = walk.values_digest(label, names, values)
    return walk.first_records_fault(chunk, digests, lambda label: models[label]["verbose"])


def main() -> None:
    job = json.load(sys.stdin)

    def say(message: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(message) + "\n")
        sys.stdout.flush()

    try:
        result = check_range(job, lambda verified: say({"progress": verified}))
    except Exception as exc:  # anything unexpected: that range is checked by Django instead, as it always was
        say({"fallback": f"{type(exc).__name__}: {exc}"})
        return
    say({"done": result})


if __name__ == "__main__":
    main()
