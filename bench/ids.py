"""Benchmark: a verdict INSERT with random-hex ids vs time-ordered ids (issue 31, last paragraph).

    python bench/ids.py [--rows 3000000] [--inserts 3000] [--warmup 1000] [--no-fsync-wait] [--keep | --reuse]

Needs only psycopg: no Django. In a database of its own (``refundops_bench_ids``, dropped and
created; dropped again at the end unless ``--keep``) it builds three tables shaped like
``audit_verdict``'s hot part: ``varchar(40)`` primary key and the same eight indexes the real table
has after its migrations (id, created_at, code, agent_id, payment_id, refund_id, (outcome,
created_at), id WHERE chained_by IS NULL), a payload column standing in for the JSON (about 250
bytes a row: the heap is appended to at its end whatever the ids, so its width changes how long the
seeding takes, not where an insert writes):

- ``v_random``: ``--rows`` rows seeded set-based with ``vd_`` + 24 random hex (today's ``new_id``);
- ``v_ordered``: the same rows with ``vd_`` + 12 hex of milliseconds + 12 random hex, spread over
  the past year;
- ``v_floor``: empty, the same INSERT's floor.

The seeded indexes are built after the load (sorted, leaves 90 % full); an index grown by random
inserts has leaves ~70 % full, so the random table here is, if anything, smaller than a real one.

Then ``--warmup`` unmeasured rounds (shared_buffers holds what inserts use, as on a server in
use), a CHECKPOINT (as the server does every ``checkpoint_timeout``: the first change to a page after
it writes the whole page to the WAL) and ``--inserts`` rounds; each round inserts one row into each
table, in a shuffled order, each INSERT its own transaction (autocommit, as a decision commits),
timed on the client; a new row's id and refund_id are new ids of the table's kind, its payment_id
an existing payment's (random hex, or for the ordered table a payment of the last 30 days: refunds
follow payments), agent one of 20, code '' for most. Every fourth round also runs one more INSERT
per table under ``EXPLAIN (ANALYZE, BUFFERS, WAL)``, whose counts are the statement's own (this
cluster is shared: a ``pg_current_wal_lsn()`` delta counts other sessions' WAL too; it is printed
for the whole run only). It prints latency median/p95/p99, shared buffers hit/read per INSERT (the
EXPLAIN sample and ``pg_statio_user_indexes`` deltas over all the inserts), WAL bytes and full-page
images per INSERT, each index's size and how much of it sits in shared_buffers afterwards
(pg_buffercache), beside ``shared_buffers``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import statistics
import time

import psycopg

PG = os.environ.get("BENCH_PG", "postgres://postgres@127.0.0.1:5432")
DB_NAME = "refundops_bench_ids"
TABLES = ("v_random", "v_ordered", "v_floor")
AGENTS = [f"ag_{i:024x}" for i in range(20)]
YEAR_MS = 365 * 86_400_000
MONTH_MS = 30 * 86_400_000


def create_table(conn: psycopg.Connection, table: str) -> None:
    conn.execute(f"""CREATE TABLE {table} (
        id varchar(40) PRIMARY KEY,
        created_at timestamptz NOT NULL,
        operation varchar(40) NOT NULL,
        outcome varchar(10) NOT NULL,
        code varchar(40) NOT NULL,
        agent_id varchar(40) NOT NULL,
        payment_id varchar(40) NOT NULL,
        refund_id varchar(40) NOT NULL,
        amount_minor bigint,
        chained_by uuid,
        payload text NOT NULL)""")


def create_indexes(conn: psycopg.Connection, table: str) -> None:
    for sql in (f"CREATE INDEX {table}_created_at ON {table} (created_at)",
                f"CREATE INDEX {table}_code ON {table} (code)",
                f"CREATE INDEX {table}_agent_id ON {table} (agent_id)",
                f"CREATE INDEX {table}_payment_id ON {table} (payment_id)",
                f"CREATE INDEX {table}_refund_id ON {table} (refund_id)",
                f"CREATE INDEX {table}_outcome ON {table} (outcome, created_at)",
                f"CREATE INDEX {table}_unchained ON {table} (id) WHERE chained_by IS NULL"):
        conn.execute(sql)


def seed(conn: psycopg.Connection, rows: int) -> None:
    """Both big tables, set-based: row i was written at now - 1 year + i/rows of a year."""
    now_ms = int(time.time() * 1000)
    start_ms = now_ms - YEAR_MS
    hex24 = "substr(md5(random()::text || i::text), 1, 24)"
    hex12 = "substr(md5(random()::text || i::text), 1, 12)"
    ms = f"({start_ms}::bigint + (i::bigint * {YEAR_MS}) / {rows})"
    kinds = {
        "v_random": (f"'vd_' || {hex24}", f"'txn_' || {hex24}", f"'rf_' || {hex24}"),
        # A payment precedes its refund by up to 30 days.
        "v_ordered": (f"'vd_' || lpad(to_hex({ms}), 12, '0') || {hex12}",
                      f"'txn_' || lpad(to_hex({ms} - (random() * {MONTH_MS})::bigint), 12, '0') || {hex12}",
                      f"'rf_' || lpad(to_hex({ms}), 12, '0') || {hex12}"),
    }
    for table, (vid, pid, rid) in kinds.items():
        started = time.perf_counter()
        conn.execute(f"""INSERT INTO {table}
            SELECT {vid}, to_timestamp({ms} / 1000.0), 'refund.create',
                   (ARRAY['approved','approved','approved','held','denied'])[1 + i % 5],
                   CASE WHEN i % 5 = 4 THEN 'limit_exceeded' ELSE '' END,
                   'ag_' || lpad(to_hex(i % 20), 24, '0'), {pid}, {rid}, 1000 + i % 50000,
                   CASE WHEN i < {rows} - 100 THEN gen_random_uuid() END,
                   repeat('x', 250)
            FROM generate_series(0, {rows} - 1) AS i""")
        conn.commit()
        loaded = time.perf_counter()
        create_indexes(conn, table)
        conn.commit()
        print(f"  {table}: {rows:,} rows in {loaded - started:.0f} s, its indexes in "
              f"{time.perf_counter() - loaded:.0f} s", flush=True)


def random_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def ordered_id(prefix: str, ms: int | None = None) -> str:
    ms = int(time.time() * 1000) if ms is None else ms
    return f"{prefix}_{ms:012x}{secrets.token_hex(6)}"


def new_row(table: str) -> tuple:
    if table == "v_ordered":
        now_ms = int(time.time() * 1000)
        ids = (ordered_id("vd"), ordered_id("txn", now_ms - random.randrange(MONTH_MS)), ordered_id("rf"))
    else:
        ids = (random_id("vd"), random_id("txn"), random_id("rf"))
    return (*ids, random.choice(AGENTS), random.choice(["approved"] * 3 + ["held"]), "x" * 250)


INSERT = ("INSERT INTO {table} (id, payment_id, refund_id, agent_id, outcome, payload, created_at, operation,"
          " code, amount_minor) VALUES (%s, %s, %s, %s, %s, %s, now(), 'refund.create', '', 2500)")


def explain(conn: psycopg.Connection, table: str) -> dict:
    plan = conn.execute("EXPLAIN (ANALYZE, BUFFERS, WAL, FORMAT JSON) " + INSERT.format(table=table),
                        new_row(table)).fetchone()[0]
    node = (json.loads(plan) if isinstance(plan, str) else plan)[0]["Plan"]
    return {key: node.get(key, 0) for key in ("Shared Hit Blocks", "Shared Read Blocks", "Shared Dirtied Blocks",
                                               "Shared Written Blocks", "WAL Records", "WAL FPI", "WAL Bytes")}


def index_io(conn: psycopg.Connection) -> dict[str, tuple[int, int]]:
    conn.execute("SELECT pg_stat_force_next_flush()")
    conn.execute("SELECT pg_stat_clear_snapshot()")
    rows = conn.execute("SELECT relname, sum(idx_blks_hit), sum(idx_blks_read) FROM pg_statio_user_indexes"
                        " GROUP BY relname").fetchall()
    return {name: (int(hit), int(read)) for name, hit, read in rows}


def sizes(conn: psycopg.Connection) -> list[tuple[str, int, int]]:
    """Each index of the big tables: its size and how many of its pages are in shared_buffers."""
    return conn.execute("""
        SELECT c.relname, pg_relation_size(c.oid),
               (SELECT count(*) FROM pg_buffercache b
                WHERE b.relfilenode = pg_relation_filenode(c.oid)
                  AND b.reldatabase = (SELECT oid FROM pg_database WHERE datname = current_database()))
        FROM pg_class c WHERE c.relkind IN ('i', 'r') AND c.relname ~ '^v_(random|ordered)'
        ORDER BY c.relname""").fetchall()


def pct(values: list[float], p: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(p / 100 * (len(values) - 1))))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=3_000_000)
    parser.add_argument("--inserts", type=int, default=2_000)
    parser.add_argument("--warmup", type=int, default=500, help="unmeasured rounds first (caches as in use)")
    parser.add_argument("--no-fsync-wait", action="store_true",
                        help="synchronous_commit off in the inserting sessions: the commit's WAL flush, which a "
                             "busy disk makes most of the time, out of the latency")
    parser.add_argument("--keep", action="store_true", help="keep the database afterwards")
    parser.add_argument("--reuse", action="store_true", help="reuse a kept database (no seeding)")
    args = parser.parse_args()

    if not args.reuse:
        with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
            conn.execute(f"CREATE DATABASE {DB_NAME}")
    admin = psycopg.connect(f"{PG}/{DB_NAME}", autocommit=True)
    try:
        settings = dict(admin.execute(
            "SELECT name, current_setting(name) FROM unnest(ARRAY['shared_buffers', 'effective_cache_size',"
            " 'checkpoint_timeout', 'max_wal_size', 'full_page_writes', 'wal_compression', 'synchronous_commit'])"
            " AS name").fetchall())
        print("server: " + ", ".join(f"{k} {v}" for k, v in settings.items()), flush=True)
        if not args.reuse:
            admin.execute("CREATE EXTENSION IF NOT EXISTS pg_buffercache")
            with psycopg.connect(f"{PG}/{DB_NAME}") as conn:
                for table in TABLES:
                    create_table(conn, table)
                create_indexes(conn, "v_floor")
                conn.commit()
                print(f"seeding {args.rows:,} rows into v_random and v_ordered", flush=True)
                seed(conn, args.rows)
            started = time.perf_counter()
            admin.execute("VACUUM ANALYZE")
            print(f"  VACUUM ANALYZE in {time.perf_counter() - started:.0f} s", flush=True)
        before_sizes = {name: size for name, size, _ in sizes(admin)}

        conns = {table: psycopg.connect(f"{PG}/{DB_NAME}", autocommit=True) for table in TABLES}
        if args.no_fsync_wait:
            for conn in conns.values():
                conn.execute("SET synchronous_commit = off")
        for _ in range(args.warmup):  # connections, plans and caches warm, as on a server in use
            for table, conn in conns.items():
                conn.execute(INSERT.format(table=table), new_row(table))
        admin.execute("CHECKPOINT")
        lsn0 = admin.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
        io0 = index_io(admin)
        latency: dict[str, list[float]] = {t: [] for t in TABLES}
        sample: dict[str, list[dict]] = {t: [] for t in TABLES}
        started = time.perf_counter()
        for i in range(args.inserts):
            order = list(TABLES)
            random.shuffle(order)
            for table in order:
                conn = conns[table]
                row = new_row(table)
                t0 = time.perf_counter()
                conn.execute(INSERT.format(table=table), row)
                latency[table].append((time.perf_counter() - t0) * 1000)
            if i % 4 == 3:
                for table in order:
                    sample[table].append(explain(conns[table], table))
        elapsed = time.perf_counter() - started
        for conn in conns.values():
            conn.execute("SELECT pg_stat_force_next_flush()")
            conn.close()
        io1 = index_io(admin)
        lsn_bytes = int(admin.execute("SELECT pg_current_wal_lsn() - %s::pg_lsn", [lsn0]).fetchone()[0])
        inserted = {t: args.inserts + len(sample[t]) for t in TABLES}

        print(f"\n{args.inserts:,} rounds in {elapsed:.0f} s (one INSERT per table a round, each its own "
              f"transaction{', synchronous_commit off' if args.no_fsync_wait else ''}; EXPLAIN sample: "
              f"{len(sample['v_floor'])} a table)")
        print(f"{'table':<10} {'median ms':>9} {'p95':>6} {'p99':>6} | EXPLAIN sample, per INSERT: {'hit':>5} "
              f"{'read':>5} {'dirtied':>7} {'written':>7} {'WAL B':>7} {'FPI':>5} | statio idx hit/read per INSERT")
        for table in TABLES:
            lat = latency[table]
            mean = {k: statistics.fmean(s[k] for s in sample[table]) for k in sample[table][0]}
            hit = (io1.get(table, (0, 0))[0] - io0.get(table, (0, 0))[0]) / inserted[table]
            read = (io1.get(table, (0, 0))[1] - io0.get(table, (0, 0))[1]) / inserted[table]
            print(f"{table:<10} {statistics.median(lat):>9.2f} {pct(lat, 95):>6.2f} {pct(lat, 99):>6.2f} | "
                  f"{'':>26} {mean['Shared Hit Blocks']:>5.1f} {mean['Shared Read Blocks']:>5.2f} "
                  f"{mean['Shared Dirtied Blocks']:>7.2f} {mean['Shared Written Blocks']:>7.2f} "
                  f"{mean['WAL Bytes']:>7.0f} {mean['WAL FPI']:>5.2f} | {hit:.1f} / {read:.2f}")
        print(f"WAL over the run, whole cluster (other sessions included): {lsn_bytes / 1e6:.1f} MB, "
              f"{lsn_bytes / sum(inserted.values()):.0f} B per INSERT of this run")
        print(f"\n{'relation':<22} {'size MB':>8} {'grew kB':>8} {'in shared_buffers MB':>21}")
        total = {"v_random": [0, 0], "v_ordered": [0, 0]}
        for name, size, buffers in sizes(admin):
            print(f"{name:<22} {size / 2**20:>8.1f} {(size - before_sizes.get(name, 0)) / 1024:>8.0f} "
                  f"{buffers * 8 / 1024:>21.1f}")
            if name != name.split("_")[0] + "_" + name.split("_")[1]:  # an index
                total["_".join(name.split("_")[:2])][0] += size
                total["_".join(name.split("_")[:2])][1] += buffers * 8192
        for table, (size, cached) in total.items():
            print(f"{table}: indexes {size / 2**20:.0f} MB, {cached / 2**20:.0f} MB of them in shared_buffers "
                  f"({settings['shared_buffers']})")
    finally:
        admin.close()
        if not args.keep:
            with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
                conn.execute(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")


if __name__ == "__main__":
    main()
