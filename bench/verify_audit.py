"""Benchmark: ``manage.py verify_audit`` over a large audit chain (issue 31, section 2).

    .venv/bin/python bench/verify_audit.py [--refunds 100000] [--reuse] [--progress-every 10000] [--processes N]

Recreates the database ``refundops_bench_verify`` (or ``$BENCH_DATABASE``) and seeds, set-based as
``bench/admin_scale.py`` does, payments, verdicts, refunds and their history rows (3.9 a refund). Then it writes an audit
entry for each history row after the first (2.9 a refund, as in issue 31's database), each
recording that row as the services do (``record_of``: its digest under the entry's MAC), and the
sealer's cover of the verdicts, written sealed by ``bench/fast_chain.py`` (the real MAC, digest and
link functions, two processes, COPY; ordered by history id; tests/test_bench_fast_chain.py checks
that such a chain verifies); ``--seed-only`` stops there. Then it times ``verify_audit`` in a child process (its
wall time, CPU and peak memory) beside a floor measured in the same run: reading the same rows
with a server-side cursor and nothing else. ``--processes`` is passed to the command (default: its
own, the machine's cores); the CPU printed is the command's and its worker processes', the peak the
largest one process reached. The goal (issue 31): 3 M entries under 5 minutes, memory bounded
whatever the size.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import resource
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from bench.fast_chain import COVER, COVER_MARK_SQL, cover_entry, write_chain  # noqa: E402
DB_NAME = os.environ.get("BENCH_DATABASE", "refundops_bench_verify")  # another name: a run of its own
PG = "postgres://postgres@127.0.0.1:5432"


def _marked(sql: str) -> str:
    """admin_scale's verdicts, each marked with the uid of the verdicts.chained entry that covers it."""
    marked = sql.replace("policy_input, shadow)", "policy_input, shadow, chained_by)").replace(
        "'{}', '{}', '{}'\n       FROM generate_series(1, (%(n)s * 106) / 100) i",
        f"'{{}}', '{{}}', '{{}}', {COVER_MARK_SQL}\n       FROM generate_series(1, (%(n)s * 106) / 100) i")
    assert "chained_by" in marked and COVER_MARK_SQL in marked, \
        "bench/admin_scale.py's verdicts changed: mark them here again"
    return marked


def seed(n: int, processes: int = 2) -> None:
    from bench.admin_scale import SEED, fresh_database

    fresh_database(DB_NAME)
    with psycopg.connect(f"{PG}/{DB_NAME}") as conn:
        conn.execute("SET synchronous_commit = off")  # a bench's rows: a crash means seeding again
        conn.execute("SET session_replication_role = replica")  # foreign keys step aside while rows go in
        for sql in SEED:
            table = sql.split()[2]
            if table in ("audit_auditentry", "refundops_agentread", "refundops_idempotencyrecord"):
                continue  # the chain is written below, for real; reads and keys it never looks at
            started = time.perf_counter()
            conn.execute(_marked(sql) if table == "audit_verdict" else sql, {"n": n})
            conn.commit()
            print(f"  seeded {table:<28} {time.perf_counter() - started:6.1f} s", flush=True)
        last_history = conn.execute("SELECT max(history_id) FROM refundops_historicalrefund").fetchone()[0] or 0
        verdicts = conn.execute("SELECT count(*) FROM audit_verdict").fetchone()[0]
    from audit.chain import seal

    started = time.perf_counter()
    seal()  # anything the migrations wrote, before the seeded chain
    tasks = [(history_entries, (lo, lo + COVER - 1)) for lo in range(1, last_history + 1, COVER)]
    tasks += [(verdict_cover, (lo, min(lo + COVER - 1, verdicts))) for lo in range(1, verdicts + 1, COVER)]
    written = write_chain(f"{PG}/{DB_NAME}", tasks, processes=processes)
    print(f"  {written:,} entries written sealed (MACs and digests in {processes} processes, COPY) in "
          f"{time.perf_counter() - started:.0f} s", flush=True)
    started = time.perf_counter()
    with psycopg.connect(f"{PG}/{DB_NAME}", autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
    print(f"  VACUUM ANALYZE {time.perf_counter() - started:.0f} s", flush=True)


def history_entries(lo: int, hi: int) -> list:
    """An entry for each refund history row of ids lo..hi after the first (the request's own), each
    recording that row as the services do (``record_of``: its digest, as Django reads the row back)."""
    from audit.chain import sealed_fields, values_digest
    from refundops.models import Refund

    model = Refund.history.model
    label, names = model._meta.label_lower, sealed_fields(model)
    rows = (model.objects.filter(history_id__gte=lo, history_id__lte=hi).exclude(history_type="+")
            .order_by("history_id").values_list("pk", *names))
    entries = []
    for pk, *values in rows:
        row = dict(zip(names, values))
        entries.append((uuid.UUID(hashlib.md5(f"h{pk}".encode()).hexdigest()), row["history_date"],
                        "agent:support-bot", f"refund.{row['status']}", "refund", row["id"],
                        {"payment_id": row["payment_id"], "amount": row["amount_minor"], "currency": row["currency"]},
                        [{"model": label, "pk": pk, "digest": values_digest(label, names, values)}]))
    return entries


def verdict_cover(lo: int, hi: int) -> list:
    """The sealer's verdicts.chained entry for verdicts lo..hi (admin_scale's ids, marked by ``_marked``)."""
    return [cover_entry((lo - 1) // COVER, ["vd_" + hashlib.md5(f"v{i}".encode()).hexdigest()[:24]
                                            for i in range(lo, hi + 1)])]


def floor() -> tuple[float, int]:
    """Every sealed entry and every row they record read once with a server-side cursor, no checking."""
    started, rows = time.perf_counter(), 0
    with psycopg.connect(f"{PG}/{DB_NAME}") as conn:
        for sql in ("SELECT * FROM audit_auditentry WHERE seq IS NOT NULL ORDER BY seq",
                    "SELECT * FROM refundops_historicalrefund", "SELECT * FROM audit_verdict"):
            with conn.cursor(name="floor") as cursor:
                cursor.itersize = 5_000
                for _ in cursor.execute(sql):
                    rows += 1
    return time.perf_counter() - started, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--refunds", type=int, default=100_000)
    parser.add_argument("--reuse", action="store_true", help="time the command on the database already seeded")
    parser.add_argument("--progress-every", type=int, default=10_000)
    parser.add_argument("--seed-only", action="store_true", help="seed the database, time nothing")
    parser.add_argument("--seed-processes", type=int, default=2, help="processes computing MACs and digests")
    parser.add_argument("--processes", type=int, default=None,
                        help="verify_audit --processes (default: the command's own, this machine's cores)")
    args = parser.parse_args()

    os.environ.update(DATABASE_URL=f"{PG}/{DB_NAME}", DJANGO_SETTINGS_MODULE="refundops.settings")
    import django

    django.setup()
    if not args.reuse:
        started = time.perf_counter()
        seed(args.refunds, args.seed_processes)
        print(f"seeded {args.refunds:,} refunds in {time.perf_counter() - started:.0f} s "
              f"(load {os.getloadavg()[0]:.1f})", flush=True)
    if args.seed_only:
        return
    from audit.models import AuditEntry

    entries = AuditEntry.objects.filter(seq__isnull=False).count()
    floor_s, floor_rows = floor()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    command = [sys.executable, "manage.py", "verify_audit", "--progress-every", str(args.progress_every)]
    if args.processes:
        command += ["--processes", str(args.processes)]
    done = subprocess.run(command, cwd=ROOT, env=os.environ, capture_output=True, text=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    print(done.stdout.strip().splitlines()[0] if done.returncode == 0 else f"FAILED: {done.stderr.strip()[-500:]}")
    per_million = wall / entries * 1e6
    # CPU: the command and the processes it waited for; peak: the largest one process reached.
    print(f"verify_audit --processes {args.processes or 'default'}, load {os.getloadavg()[0]:.1f}:")
    print(f"verify_audit: {entries:,} entries in {wall:.1f} s wall, {cpu:.1f} s CPU, peak {after.ru_maxrss / 1024:.0f} MB"
          f" ({entries / wall:,.0f} entries/s; 3 M would take {per_million * 3 / 60:.1f} min)")
    print(f"floor: {floor_rows:,} rows read with a server-side cursor in {floor_s:.1f} s "
          f"({floor_rows / floor_s:,.0f} rows/s); verify is {wall / floor_s:.1f}x the floor")


if __name__ == "__main__":
    main()
