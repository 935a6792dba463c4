"""Benchmark: ``manage.py verify_audit`` over a large audit chain (issue 31, section 2).

    .venv/bin/python bench/verify_audit.py [--refunds 100000] [--reuse] [--progress-every 10000] [--processes N]

Recreates the database ``refundops_bench_verify`` (or ``$BENCH_DATABASE``) and seeds, set-based as
``bench/admin_scale.py`` does, payments, verdicts, refunds and their history rows (3.9 a refund). Then it writes an audit
entry for each history row after the first (2.9 a refund, as in issue 31's database), each
recording that row as the services do (``record_of``: its digest under the entry's MAC), lets the
sealer cover the verdicts and seal the chain, and times ``verify_audit`` in a child process (its
wall time, CPU and peak memory) beside a floor measured in the same run: reading the same rows
with a server-side cursor and nothing else. ``--processes`` is passed to the command (default: its
own, the machine's cores); the CPU printed is the command's and its worker processes', the peak the
largest one process reached. The goal (issue 31): 3 M entries under 5 minutes, memory bounded
whatever the size.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
DB_NAME = os.environ.get("BENCH_DATABASE", "refundops_bench_verify")  # another name: a run of its own
PG = "postgres://postgres@127.0.0.1:5432"


def seed(n: int) -> None:
    from bench.admin_scale import SEED, fresh_database

    fresh_database(DB_NAME)
    with psycopg.connect(f"{PG}/{DB_NAME}") as conn:
        conn.execute("SET session_replication_role = replica")  # foreign keys step aside while rows go in
        for sql in SEED:
            if sql.split()[2] in ("audit_auditentry", "refundops_agentread", "refundops_idempotencyrecord"):
                continue  # the chain is written below, for real; reads and keys it never looks at
            conn.execute(sql, {"n": n})
    from django.db import transaction

    from audit.chain import chain_verdicts, entry_mac, record_of, seal_pending
    from audit.models import AuditEntry
    from refundops.models import Refund

    started, batch, written = time.perf_counter(), [], 0
    rows = Refund.history.model.objects.exclude(history_type="+").order_by("history_date", "history_id")
    for row in rows.iterator(chunk_size=5_000):
        entry = AuditEntry(created_at=row.history_date, actor="agent:support-bot", action=f"refund.{row.status}",
                           subject_type="refund", subject_id=row.id,
                           data={"payment_id": row.payment_id, "amount": row.amount_minor, "currency": row.currency},
                           records=[record_of(row)])
        entry.mac = entry_mac(entry)
        batch.append(entry)
        if len(batch) == 5_000:
            AuditEntry.objects.bulk_create(batch)
            written += len(batch)
            batch.clear()
            print(f"  … {written:,} entries written", file=sys.stderr, flush=True)
    AuditEntry.objects.bulk_create(batch)
    with transaction.atomic():
        covered = chain_verdicts(batch_size=5_000)
    sealed = seal_pending(batch_size=5_000)
    print(f"  {sealed:,} entries sealed ({covered:,} verdicts covered) in {time.perf_counter() - started:.0f} s")
    with psycopg.connect(f"{PG}/{DB_NAME}", autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")


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
    parser.add_argument("--processes", type=int, default=None,
                        help="verify_audit --processes (default: the command's own, this machine's cores)")
    args = parser.parse_args()

    os.environ.update(DATABASE_URL=f"{PG}/{DB_NAME}", DJANGO_SETTINGS_MODULE="refundops.settings")
    import django

    django.setup()
    if not args.reuse:
        started = time.perf_counter()
        seed(args.refunds)
        print(f"seeded {args.refunds:,} refunds in {time.perf_counter() - started:.0f} s")
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
