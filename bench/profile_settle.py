"""Where the worker's time goes paying one approved refund (issue 31), in process.

    .venv/bin/python bench/profile_settle.py [--refunds 300] [--cprofile 40] [--json] [--pstats FILE]

Seeds ``--refunds`` approved refunds as bench/drain.py does (its database ``refundops_drain``
recreated under ``--database``, a private redis-server, the sandbox at settle delay zero), then
runs the Celery task ``submit_refund`` on each in this process through Celery's own ``apply`` (the
task's tracer, its request and result handling; not the broker: kombu's share is read from
bench/drain.py's floor, a bare task on the real worker). Prints the statements of one settle, the
process's CPU and its PostgreSQL backend's CPU a refund, PostgreSQL's execution per statement
(pg_stat_statements, when the server preloads it), and the task's CPU by part (cProfile on CPU time:
each part's inclusive time, shares of the task scaled to the CPU a refund measured without cProfile).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path[:1]:
    sys.path.insert(0, str(ROOT))
from bench.drain import Bench  # noqa: E402
from bench.profile_refund import backend_cpu  # noqa: E402

# (label, module path fragment, function name): inclusive CPU under cProfile. Nested parts are
# listed under their parent with a leading "  ".
PARTS = [
    ("Celery: the task's tracer around our function (apply, request, signals)", "celery/app/task.py", "apply"),
    ("the refund read at the start", "refundops/services/payouts.py", "submit_refund"),
    ("opening the attempt (transaction: locks, open attempts, INSERT, COMMIT)", "refundops/services/payouts.py",
     "_open_attempt"),
    ("the gateway call (breaker in Redis, metrics, the sandbox's own transaction)", "refundops/services/payouts.py",
     "call_gateway"),
    ("  of which the sandbox's refund (its statements)", "processors/sandbox.py", "refund"),
    ("  of which the breaker (Redis)", "processors/breaker.py", "wait_seconds"),
    ("  of which the breaker's success (Redis)", "processors/breaker.py", "record_success"),
    ("recording the answer (transaction)", "refundops/services/payouts.py", "record_gateway_result"),
    ("  the locks (payment, refund)", "refundops/services/payouts.py", "_lock"),
    ("  the attempt closed (before issue 31)", "refundops/services/attempts.py", "close_attempt"),
    ("  the attempt closed with the news it brings (one UPDATE)", "refundops/services/attempts.py",
     "close_with_news"),
    ("  two state moves saved with history (simple-history) and announced", "refundops/services/payouts.py", "_save"),
    ("    of which the webhook announcements (endpoints read, deliveries)", "refundops/outbound.py",
     "announce_refund"),
    ("  the attempts the news resolves (before issue 31)", "refundops/services/attempts.py", "resolve_by_news"),
    ("  the payment's sums", "refundops/services/refunds.py", "sync_payment_amounts"),
    ("  the verdict's gateway answer", "refundops/services/payouts.py", "_answer_on_verdict"),
    ("  the audit entry, built (digests, MAC)", "audit/services.py", "new_audit_entry"),
    ("  the audit entry, written (before issue 31: record_audit, reading the rows it vouches for)",
     "audit/services.py", "record_audit"),
    ("  COMMIT and what runs on it", "django/db/transaction.py", "__exit__"),
]


def cumulative(stats: pstats.Stats, path: str, name: str) -> float:
    total = 0.0
    for (filename, _line, function), (_cc, _nc, _tt, ct, _callers) in stats.stats.items():
        if function == name and filename.endswith(path):
            total += ct
    return total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--refunds", type=int, default=300)
    parser.add_argument("--database", default="refundops_drain_profile")
    parser.add_argument("--cprofile", type=int, default=0, metavar="LINES", help="also print cProfile's top LINES")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--pstats", metavar="FILE", help="also save the cProfile (pstats) to FILE")
    args = parser.parse_args(argv)
    bench_args = argparse.Namespace(refunds=args.refunds, database=args.database, seed_threads=4, env=[],
                                    keep=False, processes=[1])
    bench = Bench(bench_args)
    try:
        bench.setup()
        from django.db import connection
        from django.test.utils import CaptureQueriesContext

        from refundops.tasks import submit_refund

        ids = bench.seed_full(args.refunds + 1)
        warm, ids = ids[0], ids[1:]
        connection.close()
        with CaptureQueriesContext(connection) as queries:  # a connection opened, as a task's first is
            submit_refund.apply(kwargs={"refund_id": warm})
        statements = [q["sql"] for q in queries]
        half = len(ids) // 2
        measured, profiled = ids[:half], ids[half:]

        import psycopg

        with psycopg.connect(bench.db_url, autocommit=True) as pg:
            try:
                pg.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
                pg.execute("SELECT pg_stat_statements_reset(0, (SELECT oid FROM pg_database WHERE datname = "
                           "current_database()), 0)")
                have_stats = True
            except psycopg.Error:
                have_stats = False
        backend = backend_cpu(connection)
        cpu, wall = time.process_time(), time.perf_counter()
        for refund_id in measured:
            submit_refund.apply(kwargs={"refund_id": refund_id})
        cpu, wall = (time.process_time() - cpu) / len(measured), (time.perf_counter() - wall) / len(measured)
        backend = (backend_cpu(connection) - backend) / len(measured) if backend is not None else None
        per_statement = []
        if have_stats:
            with psycopg.connect(bench.db_url, autocommit=True) as pg:
                rows = pg.execute("SELECT calls, total_exec_time, query FROM pg_stat_statements WHERE dbid = "
                                  "(SELECT oid FROM pg_database WHERE datname = current_database())"
                                  " ORDER BY total_exec_time DESC").fetchall()
            per_statement = [(calls / len(measured), ms / len(measured), " ".join(q.split())[:110])
                             for calls, ms, q in rows if calls >= len(measured) // 2]

        profile = cProfile.Profile(time.process_time)
        profile.enable()
        for refund_id in profiled:
            submit_refund.apply(kwargs={"refund_id": refund_id})
        profile.disable()
        stats = pstats.Stats(profile)
        if args.pstats:
            stats.dump_stats(args.pstats)
        whole = cumulative(stats, "celery/app/task.py", "apply")
        parts = []
        for label, path, name in PARTS:
            share = cumulative(stats, path, name) / whole if whole else 0.0
            parts.append((label, share, share * cpu * 1000))
        # the refund read: submit_refund's own body minus its named children
        top = next(p for p in parts if p[0] == "the refund read at the start")
        children = sum(p[1] for p in parts if not p[0].startswith(" ") and p[0] not in (
            top[0], PARTS[0][0]))
        parts[1] = (top[0], top[1] - children, (top[1] - children) * cpu * 1000)
        parts[0] = (parts[0][0], 1 - top[1], (1 - top[1]) * cpu * 1000)
        settled = bench.settled_count("full", ids)
        report = {"refunds": len(ids), "settled": settled, "statements": len(statements),
                  "cpu_ms": round(cpu * 1000, 2), "wall_ms": round(wall * 1000, 2),
                  "backend_cpu_ms": round(backend * 1000, 2) if backend is not None else None,
                  "parts": [(label.strip(), round(share * 100, 1), round(ms, 2)) for label, share, ms in parts],
                  "pg_stat_statements": [(round(c, 2), round(ms, 3), q) for c, ms, q in per_statement]}
        if args.json:
            print(json.dumps(report, indent=2))
        else:
            print(f"{len(ids)} refunds settled by submit_refund.apply in process ({settled} settled): CPU "
                  f"{report['cpu_ms']} ms a refund, wall {report['wall_ms']} ms, its PostgreSQL backend "
                  f"{report['backend_cpu_ms']} ms; {len(statements)} execute() calls a settle (statements deferred"
                  f" into a batch, refundops.batching, are not among them):")
            for sql in statements:
                print("   ", " ".join(sql.split())[:120])
            print(f"\n{'part':<80} {'share':>6} {'ms':>6}")
            for label, share, ms in parts:
                print(f"{label:<80} {share * 100:5.1f}% {ms:6.2f}")
            if per_statement:
                print(f"\nPostgreSQL execution a refund: {sum(r[1] for r in per_statement):.3f} ms")
                for calls, ms, q in per_statement[:25]:
                    print(f"{calls:6.2f} {ms:7.3f}  {q}")
            if args.cprofile:
                stats.sort_stats("cumulative").print_stats(args.cprofile)
                stats.sort_stats("tottime").print_stats(args.cprofile)
    finally:
        bench.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
