"""Benchmark: a full ``manage.py reconcile --gateway sandbox`` (issue 31, section 2).

    .venv/bin/python bench/reconcile.py [--payments 20000] [--reuse] [--checkout DIR]

Recreates the database ``refundops_bench_reconcile`` and seeds, set-based as ``bench/admin_scale.py``
does, payments and their refunds, and the sandbox gateway's own books agreeing with them (a charge
per payment, a succeeded refund per refund settled here). Then it times the command in a child
process (``--checkout`` runs another checkout's code on the same rows, for a before/after) beside
a floor measured in the same run: reading the payments and the sandbox's charges and refunds with
a server-side cursor, nothing else. The goal (issue 31): a million payments under 10 minutes.
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
DB_NAME = "refundops_bench_reconcile"
PG = "postgres://postgres@127.0.0.1:5432"

GATEWAY_BOOKS = [
    """INSERT INTO processors_sandboxcharge (reference, currency, authorized_minor, captured_minor, refunded_minor,
              voided, created_at)
       SELECT processor_reference, currency, amount_authorized_minor, amount_captured_minor, 0, false, created_at
       FROM refundops_payment""",
    """INSERT INTO processors_sandboxrefund (reference, charge_id, amount_minor, currency, idempotency_key, metadata,
              status, settles_at, created_at)
       SELECT r.processor_refund_id, c.id, r.amount_minor, r.currency, 'bench-' || r.id,
              jsonb_build_object('refund_id', r.id), 'succeeded', r.settled_at, r.created_at
       FROM refundops_refund r JOIN refundops_payment p ON p.id = r.payment_id
       JOIN processors_sandboxcharge c ON c.reference = p.processor_reference
       WHERE r.status = 'settled'""",
]


def seed(n: int) -> None:
    from bench.admin_scale import SEED, bulk_session, fresh_database, indexes_set_aside, seeded_tables

    fresh_database(DB_NAME)
    wanted = [sql for sql in SEED if sql.split()[2] in ("refundops_customer", "refundops_payment", "audit_verdict",
                                                        "refundops_refund")]
    with psycopg.connect(f"{PG}/{DB_NAME}") as conn:
        bulk_session(conn)  # foreign keys and triggers step aside, commits do not wait for the disk
        with indexes_set_aside(conn, seeded_tables(wanted + GATEWAY_BOOKS)):
            for sql in wanted:
                conn.execute(sql, {"n": n})
            # The seed's refunds are months old and settled: none is the worker's any more.
            conn.execute("UPDATE refundops_refund SET settled_at = updated_at WHERE status = 'settled'")
            conn.execute("UPDATE refundops_payment SET processor_account = 'default'")  # the sandbox's one account
            for sql in GATEWAY_BOOKS:
                conn.execute(sql)
            conn.commit()
    with psycopg.connect(f"{PG}/{DB_NAME}", autocommit=True) as conn:
        conn.execute("SET maintenance_work_mem = '1GB'")
        conn.execute("VACUUM ANALYZE")


def floor() -> tuple[float, int]:
    started, rows = time.perf_counter(), 0
    with psycopg.connect(f"{PG}/{DB_NAME}") as conn:
        for sql in ("SELECT * FROM refundops_payment ORDER BY created_at, id", "SELECT * FROM refundops_refund",
                    "SELECT * FROM processors_sandboxcharge", "SELECT * FROM processors_sandboxrefund"):
            with conn.cursor(name="floor") as cursor:
                cursor.itersize = 2_000
                for _ in cursor.execute(sql):
                    rows += 1
    return time.perf_counter() - started, rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--payments", type=int, default=20_000)
    parser.add_argument("--reuse", action="store_true", help="time the command on the database already seeded")
    parser.add_argument("--checkout", default=str(ROOT), help="the checkout whose manage.py is timed")
    args = parser.parse_args()

    os.environ.update(DATABASE_URL=f"{PG}/{DB_NAME}", DJANGO_SETTINGS_MODULE="refundops.settings")
    import django

    django.setup()
    if not args.reuse:
        started = time.perf_counter()
        seed(args.payments)
        print(f"seeded {args.payments:,} payments in {time.perf_counter() - started:.0f} s")
    with psycopg.connect(f"{PG}/{DB_NAME}", autocommit=True) as conn:
        payments = conn.execute("SELECT count(*) FROM refundops_payment").fetchone()[0]
        conn.execute("DELETE FROM refundops_ledgerdiscrepancy")  # a rerun finds what the first one found afresh
    floor_s, floor_rows = floor()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "manage.py", "reconcile", "--gateway", "sandbox", "--json"],
                          cwd=args.checkout, env=os.environ, capture_output=True, text=True)
    wall = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    import json

    try:
        report = json.loads(done.stdout)
        said = (f"{report['checked']:,} compared, {len(report['discrepancies'])} discrepancies, "
                f"{len(report['unreachable'])} unreachable")
    except ValueError:
        said = f"FAILED: {done.stderr.strip()[-500:]}"
    print(f"reconcile ({args.checkout}): {said}")
    print(f"reconcile: {payments:,} payments in {wall:.1f} s wall, {cpu:.1f} s CPU, peak {after.ru_maxrss / 1024:.0f} MB "
          f"({payments / wall:,.0f} payments/s; a million would take {1e6 / (payments / wall) / 60:.1f} min)")
    print(f"floor: {floor_rows:,} rows read with a server-side cursor in {floor_s:.1f} s "
          f"({floor_rows / floor_s:,.0f} rows/s); reconcile is {wall / floor_s:.1f}x the floor")


if __name__ == "__main__":
    main()
