"""Where one approved ``POST /api/v1/refunds`` spends its time, in process: Django's test client
through the whole stack (middleware, DRF, service, Redis, PostgreSQL on a persistent connection),
no HTTP server. Prints the mean and median wall time per request, the Redis commands and round
trips per request, the SQL statements and round trips to PostgreSQL per request (counted on the
wire: bench/wire.py), PostgreSQL's own time for each statement (pg_stat_statements, when the
server preloads it), and with ``--pyinstrument`` a profile of the
Python side.

CPU is reported for the request's own thread (what the client waits for) apart from the rest of
the process: the outbox's sender thread, which sends the committed effects after the request has
answered (refundops/outbox.py), is drained at the end of each measurement, so its CPU, statements
and Redis round trips are counted too, per request but on their own line. cProfile and pyinstrument
see the request's thread only.

    .venv/bin/python bench/profile_refund.py [--requests 300] [--pyinstrument out.html] [--cprofile LINES]
                                             [--against-inline ROUNDS]

``--against-inline ROUNDS`` measures, in this one process, alternating blocks of 100 requests with
the nudge run inline in the request's thread (as before the sender, and as when no thread can be
started) and handed to the sender: on a shared machine whose load moves from minute to minute,
only blocks interleaved this way compare fairly. It prints each block and the medians.

Recreates the database ``refundops_bench`` as bench/refunds.py does (it seeds the same way);
``BENCH_DB_NAME=refundops_bench_NAME`` (and ``BENCH_REDIS_URL``) give a checkout a database of its own
when several measure on one machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
import uuid
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.refunds import DB_NAME, PG, analyze, recreate_database, seed  # noqa: E402
from bench.wire import on_the_wire  # noqa: E402


def drain_sender() -> None:
    """Wait until the outbox's sender thread has sent what the requests queued (no-op before it existed)."""
    from refundops import outbox

    if hasattr(outbox, "drain"):
        assert outbox.drain(timeout=60), "the outbox's sender did not drain"


def against_inline(one, rounds: int) -> None:
    """Blocks of 100 requests, the nudge inline then through the sender, ``rounds`` times; CPU ms a
    request of the request's thread and of the process (the sender drained at each block's end)."""
    from refundops import outbox

    sender = outbox._running_sender
    blocks: dict[str, list[tuple[float, float, float]]] = {"inline": [], "sender": []}
    try:
        for _ in range(rounds):
            for mode in blocks:
                # No sender: the nudge runs inline, as when no thread can be started.
                outbox._running_sender = (lambda: None) if mode == "inline" else sender
                cpu, thread_cpu, wall = time.process_time(), time.thread_time(), time.perf_counter()
                for _ in range(100):
                    one()
                thread_cpu = time.thread_time() - thread_cpu
                wall = time.perf_counter() - wall
                drain_sender()
                blocks[mode].append((thread_cpu * 10, (time.process_time() - cpu) * 10, wall * 10))
                print(f"{mode:>6}: CPU a request: request's thread {blocks[mode][-1][0]:.2f} ms, process"
                      f" {blocks[mode][-1][1]:.2f} ms; wall {blocks[mode][-1][2]:.2f} ms", flush=True)
    finally:
        outbox._running_sender = sender
    for mode, rows in blocks.items():
        thread_cpu, cpu, wall = (statistics.median(row[i] for row in rows) for i in range(3))
        print(f"median, nudge {mode}: CPU a request: request's thread {thread_cpu:.2f} ms, process {cpu:.2f} ms;"
              f" wall {wall:.2f} ms ({rounds} blocks of 100)")


def sender_cprofile(one, n: int, lines: int) -> None:
    """cProfile of the outbox's sender thread over ``n`` requests, on that thread's own CPU clock:
    a new sender is started whose whole loop (the wait, the hand-off, the batch) runs profiled."""
    import cProfile
    import pstats

    from refundops import outbox

    outbox.stop_sender()
    profile = cProfile.Profile(time.thread_time)
    run = outbox._Sender._run

    def profiled(self) -> None:
        profile.enable()
        try:
            run(self)
        finally:
            profile.disable()

    outbox._Sender._run = profiled
    try:
        for _ in range(n):
            one()
        drain_sender()
        outbox.stop_sender()
    finally:
        outbox._Sender._run = run
    stats = pstats.Stats(profile)
    print(f"\nthe outbox's sender thread over {n} requests: {stats.total_tt * 1000 / n:.2f} ms of its CPU a request")
    stats.sort_stats("cumulative").print_stats(lines)
    stats.sort_stats("tottime").print_stats(lines)


def backend_cpu(connection) -> float | None:
    """CPU seconds (user and system) the PostgreSQL backend of ``connection`` has used, read from
    /proc (the server on this machine): parsing, planning, executing, the protocol, all of it,
    where pg_stat_statements counts planning and execution only. None when it cannot be read."""
    import os

    try:
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_backend_pid()")
            pid = cursor.fetchone()[0]
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
    except (OSError, IndexError, ValueError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--pyinstrument", metavar="HTML", help="write a pyinstrument profile of the timed requests")
    parser.add_argument("--cprofile", type=int, metavar="LINES", help="cProfile on the request thread's CPU time (not wall): the top LINES")
    parser.add_argument("--sender-cprofile", type=int, metavar="LINES",
                        help="cProfile of the outbox's sender thread on its own CPU clock: the top LINES")
    parser.add_argument("--cprofile-dump", metavar="FILE", help="with --cprofile, also write the stats to FILE (pstats)")
    parser.add_argument("--against-inline", type=int, metavar="ROUNDS",
                        help="alternate 100 requests with the nudge inline and 100 with the sender, ROUNDS times")
    args = parser.parse_args()
    n = args.requests

    recreate_database()
    keys, payments, _ = seed(clients=1, per_client=max(3 * n, 200 * (args.against_inline or 0)) + 60)
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
    drain_sender()
    analyze()  # statistics that know the warm-up's refunds (bench.refunds.analyze)

    # Redis: every command and every round trip (a pipeline is one), by thread: the request's own,
    # and the others' (the outbox's sender).
    request_thread = threading.get_ident()
    commands: dict[str, Counter[str]] = {"request": Counter(), "other": Counter()}
    trips = {"request": 0, "other": 0}
    execute, pipeline_execute = redis.Redis.execute_command, redis.client.Pipeline.execute

    def whose() -> str:
        return "request" if threading.get_ident() == request_thread else "other"

    def counting_execute(self, *a, **kw):
        commands[whose()][str(a[0]).split()[0].upper()] += 1
        trips[whose()] += 1
        return execute(self, *a, **kw)

    def counting_pipeline(self, *a, **kw):
        for command in self.command_stack:
            commands[whose()]["(pipeline) " + str(command[0][0]).upper()] += 1
        trips[whose()] += 1
        return pipeline_execute(self, *a, **kw)

    # The other threads' statements: every cursor's execute, outside the request's thread.
    from django.db.backends.utils import CursorWrapper

    other_sql: list[str] = []
    cursor_execute = CursorWrapper.execute

    def counting_cursor_execute(self, sql, params=None):
        if threading.get_ident() != request_thread:
            other_sql.append(sql)
        return cursor_execute(self, sql, params)

    redis.Redis.execute_command, redis.client.Pipeline.execute = counting_execute, counting_pipeline
    CursorWrapper.execute = counting_cursor_execute
    with CaptureQueriesContext(connection) as queries, on_the_wire(connection) as wire:
        one()
    drain_sender()
    redis.Redis.execute_command, redis.client.Pipeline.execute = execute, pipeline_execute
    CursorWrapper.execute = cursor_execute
    print(f"one request, its own thread: {wire.statements} SQL statements in {wire.round_trips} round trips to"
          f" PostgreSQL ({len(queries)} execute() calls and BEGIN/COMMIT as Django logs them),"
          f" {trips['request']} Redis round trips: {dict(commands['request'])}")
    for q in queries:
        print("   ", " ".join(q["sql"].split())[:130])
    print(f"after it, other threads (the outbox's sender): {len(other_sql)} SQL statements, {trips['other']} Redis "
          f"round trips: {dict(commands['other'])}")
    for sql in other_sql:
        print("   ", " ".join(sql.split())[:130])

    with psycopg.connect(f"{PG}/{DB_NAME}", autocommit=True) as pg:
        try:
            pg.execute("CREATE EXTENSION IF NOT EXISTS pg_stat_statements")
            # This database's statements only: other sessions may be measuring theirs.
            pg.execute("SELECT pg_stat_statements_reset(0, (SELECT oid FROM pg_database WHERE datname = "
                       "current_database()), 0)")
            stats = True
        except psycopg.Error as exc:
            print(f"pg_stat_statements unavailable ({exc.__class__.__name__}): no per-statement times")
            stats = False
    if stats:  # planning time too, for this session only (a superuser's setting)
        try:
            with connection.cursor() as cursor:
                cursor.execute("SET pg_stat_statements.track_planning = on")
        except Exception as exc:  # noqa: BLE001 - not a superuser: execution times only
            print(f"no planning times ({exc.__class__.__name__})")

    if args.against_inline:
        against_inline(one, args.against_inline)
        return

    backend = backend_cpu(connection)
    times, cpu, thread_cpu = [], time.process_time(), time.thread_time()
    for _ in range(n):
        start = time.perf_counter()
        one()
        times.append(time.perf_counter() - start)
    thread_cpu = time.thread_time() - thread_cpu
    backend = backend_cpu(connection) - backend if backend is not None else None
    drain_sender()  # what the requests left to the sender, counted in the process's CPU below
    cpu = time.process_time() - cpu
    print(f"{n} requests: wall mean {statistics.mean(times) * 1000:.2f} ms, p50 {statistics.median(times) * 1000:.2f} ms;"
          f" CPU a request: the request's thread {thread_cpu / n * 1000:.2f} ms, other threads (the outbox's sender)"
          f" {(cpu - thread_cpu) / n * 1000:.2f} ms, the whole (Django) process {cpu / n * 1000:.2f} ms"
          + (f"; its PostgreSQL backend {backend / n * 1000:.2f} ms" if backend is not None else ""))

    with connection.cursor() as cursor:  # refundops.batching's prepared statements, and the plans they run
        cursor.execute("SELECT name, generic_plans, custom_plans FROM pg_prepared_statements ORDER BY name")
        held = cursor.fetchall()
    if held:
        print(f"prepared on the request's connection: {len(held)};"
              f" generic/custom plans: {', '.join(f'{name} {g}/{c}' for name, g, c in held)}")

    if stats:
        with psycopg.connect(f"{PG}/{DB_NAME}", autocommit=True) as pg:
            rows = pg.execute(
                "SELECT calls, total_exec_time, total_plan_time, query FROM pg_stat_statements "
                "WHERE dbid = (SELECT oid FROM pg_database WHERE datname = %s) ORDER BY total_exec_time DESC",
                [DB_NAME]).fetchall()
        total, planning = (sum(r[i] for r in rows if r[0] >= n) for i in (1, 2))
        print(f"\nPostgreSQL per request (statements run at least once a request): execution {total / n:.3f} ms,"
              f" planning {planning / n:.3f} ms")
        print(f"{'calls/req':>9} {'exec ms':>8} {'plan ms':>8}  statement")
        for calls, ms, plan, query in rows:
            if calls >= n // 2:
                print(f"{calls / n:9.2f} {ms / n:8.3f} {plan / n:8.3f}  {' '.join(query.split())[:150]}")

    if args.cprofile:
        import cProfile
        import pstats

        # The request's thread's CPU: with process_time the outbox's sender thread's CPU would be
        # charged to whatever the request was doing meanwhile (mostly its waits on Redis and PostgreSQL).
        profile = cProfile.Profile(time.thread_time)
        profile.enable()
        for _ in range(n):
            one()
        profile.disable()
        drain_sender()
        if args.cprofile_dump:
            profile.dump_stats(args.cprofile_dump)
        pstats.Stats(profile).sort_stats("cumulative").print_stats(args.cprofile)

    if args.sender_cprofile:
        sender_cprofile(one, n, args.sender_cprofile)

    if args.pyinstrument:
        from pyinstrument import Profiler

        profiler = Profiler(interval=0.0002)
        profiler.start()
        for _ in range(n):
            one()
        profiler.stop()
        drain_sender()
        Path(args.pyinstrument).write_text(profiler.output_html())
        print(profiler.output_text(unicode=False, color=False, show_all=False))


if __name__ == "__main__":
    main()
