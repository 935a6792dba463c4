"""Where one approved ``POST /api/v1/refunds`` spends its time, in process: Django's test client
through the whole stack (middleware, DRF, service, Redis, PostgreSQL on a persistent connection),
no HTTP server. Prints the mean and median wall time per request, the Redis commands and round
trips per request, the SQL statements per request with PostgreSQL's own time for each
(pg_stat_statements, when the server preloads it), and with ``--pyinstrument`` a profile of the
Python side.

    .venv/bin/python bench/profile_refund.py [--requests 300] [--pyinstrument out.html]

Recreates the database ``refundops_bench`` as bench/refunds.py does (it seeds the same way);
``BENCH_DB_NAME=refundops_bench_NAME`` (and ``BENCH_REDIS_URL``) give a checkout a database of its own
when several measure on one machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.refunds import DB_NAME, PG, recreate_database, seed  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--pyinstrument", metavar="HTML", help="write a pyinstrument profile of the timed requests")
    parser.add_argument("--cprofile", type=int, metavar="LINES", help="cProfile on CPU time (not wall): the top LINES")
    args = parser.parse_args()
    n = args.requests

    recreate_database()
    keys, payments, _ = seed(clients=1, per_client=3 * n + 50)
    payments = payments[0]
    import psycopg
    import redis
    from django.db import connection
    from django.test import Client
    from django.test.utils import CaptureQueriesContext

    client = Client()
    headers = {"Authorization": f"Bearer {keys[0]}"}
    sent = iter(payments)

    def one() -> None:
        body = {"transaction_id": next(sent), "amount": 500, "reason": "customer_request",
                "agent": {"session_id": "bench-0", "model": "bench"}}
        response = client.post("/api/v1/refunds", body, content_type="application/json",
                                headers={**headers, "Idempotency-Key": uuid.uuid4().hex})
        assert response.status_code == 201 and response.json()["refund"]["status"] == "approved", response.content

    for _ in range(50):  # warm: imports, caches, the key's first use, the connection
        one()

    # Redis: every command and every round trip (a pipeline is one).
    commands: Counter[str] = Counter()
    trips = [0]
    execute, pipeline_execute = redis.Redis.execute_command, redis.client.Pipeline.execute

    def counting_execute(self, *a, **kw):
        commands[str(a[0]).split()[0].upper()] += 1
        trips[0] += 1
        return execute(self, *a, **kw)

    def counting_pipeline(self, *a, **kw):
        for command in self.command_stack:
            commands["(pipeline) " + str(command[0][0]).upper()] += 1
        trips[0] += 1
        return pipeline_execute(self, *a, **kw)

    redis.Redis.execute_command, redis.client.Pipeline.execute = counting_execute, counting_pipeline
    with CaptureQueriesContext(connection) as queries:
        one()
    redis.Redis.execute_command, redis.client.Pipeline.execute = execute, pipeline_execute
    print(f"one request: {len(queries)} SQL statements, {trips[0]} Redis round trips: {dict(commands)}")
    for q in queries:
        print("   ", " ".join(q["sql"].split())[:130])

    with psycopg.connect(f"{PG}/{DB_NAME}", autocommit=True) as pg:
        try:
            pg.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            pg.execute("SELECT pg_stat_statements_reset()")
            stats = True
        except psycopg.Error as exc:
            print(f"pg_stat_statements unavailable ({exc.__class__.__name__}): no per-statement times")
            stats = False

    times, cpu = [], time.process_time()
    for _ in range(n):
        start = time.perf_counter()
        one()
        times.append(time.perf_counter() - start)
    cpu = time.process_time() - cpu
    print(f"{n} requests: wall mean {statistics.mean(times) * 1000:.2f} ms, p50 {statistics.median(times) * 1000:.2f} ms;"
          f" CPU of this (Django) process {cpu / n * 1000:.2f} ms a request")

    if stats:
        with psycopg.connect(f"{PG}/{DB_NAME}", autocommit=True) as pg:
            rows = pg.execute(
                "SELECT calls, total_exec_time, rows, query FROM pg_stat_statements "
                "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = %s) ORDER BY total_exec_time DESC",
                [DB_NAME]).fetchall()
        total = sum(r[1] for r in rows if r[0] >= n)
        print(f"\nPostgreSQL execution time per request: {total / n:.3f} ms (statements run at least once a request)")
        print(f"{'calls/req':>9} {'ms/req':>8}  statement")
        for calls, ms, _, query in rows:
            if calls >= n // 2:
                print(f"{calls / n:9.2f} {ms / n:8.3f}  {' '.join(query.split())[:150]}")

    if args.cprofile:
        import cProfile
        import pstats

        profile = cProfile.Profile(time.process_time)
        profile.enable()
        for _ in range(n):
            one()
        profile.disable()
        pstats.Stats(profile).sort_stats("cumulative").print_stats(args.cprofile)

    if args.pyinstrument:
        from pyinstrument import Profiler

        profiler = Profiler(interval=0.0002)
        profiler.start()
        for _ in range(n):
            one()
        profiler.stop()
        Path(args.pyinstrument).write_text(profiler.output_html())
        print(profiler.output_text(unicode=False, color=False, show_all=False))


if __name__ == "__main__":
    main()
