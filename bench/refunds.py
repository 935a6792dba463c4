"""Benchmark: ``POST /api/v1/refunds`` on the approved path with the full policy, beside a floor.

    .venv/bin/python bench/refunds.py [--rounds 3] [--seconds 10] [--clients 32] [--workers 4] [--threads 1]
                                      [--server wsgi|asgi] [--json]

Needs ``wrk`` (Debian: ``apt-get install wrk``). Recreates the database ``refundops_bench``
(PostgreSQL on 127.0.0.1), migrates it, seeds payments, limits, hold rules and one agent key per
client through the ORM, then serves

* full: the platform (bench.settings_full) behind gunicorn: key, capability, rate limits in Redis,
  idempotency, the payment's, customer's and agent's locks, running totals, the policy, verdict, refund, history,
  audit entry, breaker count; Celery not eager, broker in Redis, no worker (the queue only fills;
  the driver folds the day's totals every 5 s, as beat does);
* floor: bench.floor, raw SQL in a plain Django view with no middleware on a persistent connection:
  lock the payment row, sum its refunds in a table of its own, insert one, commit;

and drives both with wrk (``bench/refunds.lua``: C, keep-alive, light beside the server on a small
machine), ``--clients`` connections, every request on a payment of its own: a warm-up each, then
alternating rounds. It prints throughput, p50 and p99 of each, their ratio and issue 11's goals
(one client: full p50 <= 8 ms; 32 clients: full >= 200 req/s and >= 25 % of the floor, p99 <= 250 ms,
no errors), and the CPU a request cost each part in the same rounds (bench/cpu.py: the server's
processes, the database's backends, Redis, wrk; on two cores the ratio is about the inverse of the
totals'); ``--json`` prints one object instead: ``{"clients", "full": {"rps", "p50_ms", "p99_ms",
"errors", "cpu_ms"}, "floor": {...}, "ratio"}``. Both servers are gunicorn with ``--workers`` processes:
``--server wsgi`` (sync workers, refundops.wsgi) or ``asgi`` (uvicorn workers, refundops.asgi, as
gunicorn.conf.py deploys it); the database connection is the platform's default for that mode. The
machine is shared and noisy: read medians and ratios, and run it more than once.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psycopg
import requests

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path[:1]:
    sys.path.insert(0, str(ROOT))  # run as a script: the project first
from bench import cpu  # after the path is set

DB_NAME = os.environ.get("BENCH_DB_NAME", "refundops_bench")  # one per checkout when several measure at once
PG = "postgres://postgres@127.0.0.1:5432"
AMOUNT = 500


def bench_env(db_name: str) -> dict[str, str]:
    """The environment the benchmark's processes run with, on database ``db_name``."""
    return {
        "DATABASE_URL": f"{PG}/{db_name}",
        "REDIS_URL": os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/11"),
        "CELERY_TASK_ALWAYS_EAGER": "false",
        "DJANGO_DEBUG": "false",
        "DATABASE_POOLER": "none",  # straight to PostgreSQL: psycopg's prepared statements on
    }


ENV = bench_env(DB_NAME)


def recreate_database(db_name: str = DB_NAME) -> None:
    """``db_name`` dropped and made anew, migrated: a copy of the migrated template kept beside it
    (bench/stack.py; ``migrate`` itself runs only when a migration file changed, 10-20 s under load)."""
    from bench.stack import create_migrated_database

    create_migrated_database(f"{PG}/{db_name}", {**os.environ, **bench_env(db_name),
                                                 "DJANGO_SETTINGS_MODULE": "bench.settings_full"})


def setup_django(db_name: str = DB_NAME) -> None:
    """This process on ``db_name`` with the benchmark's settings (bench.settings_full)."""
    os.environ.update({**bench_env(db_name), "DJANGO_SETTINGS_MODULE": "bench.settings_full"})
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()


def create_policy(*, limits: dict | None = None, rules: dict | None = None) -> None:
    """Limits (USD, version 1) with ceilings per agent, session and platform far above what a
    benchmark sends, and hold rules with every rule on (migration 0007's version 1, or version 2
    with ``rules``' fields changed); ``limits`` overrides the limits' fields."""
    from refundops.models import HoldRules, RefundLimits

    big = 10**12
    RefundLimits.objects.create(**{
        "currency": "USD", "version": 1, "approval_threshold_minor": 100_000, "refund_window_days": 90,
        "allowed_reasons": ["customer_request", "duplicate", "fraudulent", "product_issue"],
        "max_refunds_per_payment": 5, "customer_daily_count": 10, "customer_daily_amount_minor": 1_000_000,
        "customer_30d_count": 50, "customer_30d_amount_minor": 5_000_000, "agent_hourly_amount_minor": big,
        "agent_daily_amount_minor": big, "session_amount_minor": big, "global_daily_amount_minor": big,
        "created_by": "bench", **(limits or {})})
    HoldRules.objects.get_or_create(version=1, defaults={"created_by": "bench"})
    if rules:
        HoldRules.objects.create(version=2, created_by="bench", **rules)  # the latest version binds


def create_agents(count: int, *, name: str = "bench") -> list[str]:
    """``count`` agents that may create refunds and read payments, one key each; the raw keys."""
    from refundops.access import generate_key
    from refundops.models import Agent, AgentKey

    keys = []
    for i in range(count):
        agent = Agent.objects.create(name=f"{name}-{i}", capabilities=["refunds.create", "payments.read"])
        raw, prefix, digest = generate_key()
        AgentKey.objects.create(agent=agent, prefix=prefix, key_hash=digest)
        keys.append(raw)
    return keys


def seed(*, clients: int, per_client: int) -> tuple[list[str], list[list[str]], list[list[str]]]:
    """Agent keys, and for each client its own payments for the full run and for the floor run."""
    setup_django()
    import redis
    from django.conf import settings
    from django.db import connection
    from django.utils import timezone

    from refundops.models import Customer, Payment

    redis.Redis.from_url(settings.REDIS_URL).flushdb()
    create_policy()  # every hold rule on; none fires here (a customer of its own for each refund)
    keys = create_agents(clients)
    total = clients * per_client * 2
    customers = Customer.objects.bulk_create(
        [Customer(name=f"Bench {i}", email=f"bench{i}@example.com") for i in range(total)], batch_size=5000)
    captured_at = timezone.now() - timezone.timedelta(days=2)
    payments = Payment.objects.bulk_create([
        Payment(customer=c, processor="sandbox", processor_reference=f"bench_{i}", currency="USD",
                amount_authorized_minor=10_000, amount_captured_minor=10_000, method_type="card",
                method_brand="visa", method_last4="4242", captured_at=captured_at)
        for i, c in enumerate(customers)], batch_size=5000)
    from bench.floor import CREATE_TABLE

    with connection.cursor() as cursor:
        for statement in CREATE_TABLE:  # the floor's own table: not the platform's, no migration
            cursor.execute(statement)
        cursor.execute("ANALYZE")  # planner statistics, as a live database has them
    ids = [p.pk for p in payments]
    half = clients * per_client
    split = [[ids[start + c * per_client + j] for j in range(per_client)] for start in (0, half)
             for c in range(clients)]
    return keys, split[:clients], split[clients:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(settings_module: str, *, server_mode: str, workers: int, threads: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    # gunicorn reads ./gunicorn.conf.py (the deployment's: uvicorn workers) unless told otherwise.
    mode = (["refundops.asgi:application", "-c", "gunicorn.conf.py"] if server_mode == "asgi"
            else ["refundops.wsgi", "-c", "python:bench", "-k", "sync", "--threads", str(threads)])
    server = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", *mode, "-w", str(workers),
         "-b", f"127.0.0.1:{port}", "--log-level", "warning", "--backlog", "256"],
        cwd=ROOT, env={**os.environ, **ENV, "DJANGO_SETTINGS_MODULE": settings_module},
        start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            requests.get(f"{url}/api/v1/refunds", timeout=10)
            return server, url
        except requests.RequestException:
            time.sleep(0.1)
    server.kill()
    raise RuntimeError(f"gunicorn ({settings_module}) did not start")


def stop(server: subprocess.Popen) -> None:
    os.killpg(server.pid, signal.SIGTERM)
    server.wait(timeout=30)


def analyze(db_name: str = DB_NAME) -> None:
    """Planner statistics with the warm-ups' refunds in them. Taken at seeding only, they describe
    empty refund, verdict and delta tables, and PostgreSQL then scans them whole on every decision
    until autovacuum analyzes them (in a 10 s round, maybe never): 6 sequential scans of the refunds
    a request were counted in one run (issue 11). A live database's statistics know its refunds."""
    with psycopg.connect(f"{PG}/{db_name}", autocommit=True) as conn:
        conn.execute("ANALYZE")


class Folding(threading.Thread):
    """What beat does in production every few seconds, here in the driver: fold the day's totals
    (refundops/services/totals.py), so that a decision reads the buckets and not a run's worth of
    rows."""

    def __init__(self, every: float = 5.0) -> None:
        super().__init__(daemon=True)
        self.every, self.halt = every, threading.Event()
        self.start()

    def run(self) -> None:
        from django.db import connection

        from refundops.services.totals import fold_totals

        try:
            while not self.halt.wait(self.every):
                fold_totals()
        finally:
            connection.close()

    def stop(self) -> None:
        self.halt.set()
        self.join()


@dataclass
class Result:
    name: str
    seconds: float
    ok: int
    latencies: list[tuple[float, float]]  # (seconds, how many requests it stands for), from wrk's percentiles
    errors: dict[str, int]
    cpu_seconds: dict[str, float]  # by part (bench/cpu.py), over the round; empty without /proc

    @property
    def throughput(self) -> float:
        return self.ok / self.seconds

    def cpu_ms(self) -> dict[str, float]:
        """CPU a completed request, by part: server, postgres, redis, wrk, and their total."""
        done = max(self.ok + sum(self.errors.values()), 1)
        parts = {name: round(s * 1000 / done, 2) for name, s in self.cpu_seconds.items()}
        if parts:
            parts["total"] = round(sum(self.cpu_seconds.values()) * 1000 / done, 2)
        return parts

    def summary(self) -> dict[str, float | int | dict]:
        return {"rps": round(self.throughput, 1), "p50_ms": round(self.percentile(0.5), 2),
                "p99_ms": round(self.percentile(0.99), 2), "errors": sum(self.errors.values()),
                "cpu_ms": self.cpu_ms()}

    def percentile(self, p: float) -> float:
        total, seen = sum(w for _, w in self.latencies), 0.0
        for latency, weight in sorted(self.latencies):
            seen += weight
            if seen >= p * total - 1e-9:
                return latency * 1000
        return float("nan")


def meter(server: subprocess.Popen, db_name: str = DB_NAME) -> cpu.Meter | None:
    """What a round costs in CPU: the server's processes, the database's backends (the server's, the
    driver's folding, and autovacuum's while it works on this database), Redis."""
    if not cpu.available():
        return None
    import redis

    redis_pid = int(redis.Redis.from_url(ENV["REDIS_URL"]).info("server")["process_id"])

    def backends() -> set[int]:
        with psycopg.connect(f"{PG}/{db_name}", autocommit=True) as conn:
            return {pid for (pid,) in conn.execute(
                "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()"
                " AND backend_type IN ('client backend', 'autovacuum worker', 'parallel worker')", (db_name,))}

    return cpu.Meter({"server": lambda: cpu.descendants(server.pid), "postgres": backends,
                      "redis": lambda: {redis_pid}})


def drive(name: str, url: str, *, keys: list[str], payments: list[list[str]], seconds: float,
          wrk_threads: int, meter: cpu.Meter | None = None) -> Result:
    """wrk (C, keep-alive, ``bench/refunds.lua``) with one connection per client, each request a
    refund on a payment of its own under that client's key. Counts only approved refunds (201
    for the floor); anything else is an error, listed. With ``meter``, the CPU each part spent."""
    with tempfile.NamedTemporaryFile("w", suffix=".plan") as plan:
        plan.writelines(f"{keys[c]} {c} {ps[j]}\n" for j in range(len(payments[0])) for c, ps in enumerate(payments))
        plan.flush()
        if meter:
            meter.start()
        out = subprocess.run(
            ["wrk", "-t", str(wrk_threads), "-c", str(len(keys)), "-d", f"{seconds:.0f}s", "--timeout", "30s",
             "-s", str(ROOT / "bench" / "refunds.lua"), f"{url}/api/v1/refunds", "--",
             plan.name, name, str(wrk_threads), uuid.uuid4().hex],
            check=True, capture_output=True, text=True).stdout
        spent = meter.stop() if meter else {}
    quantiles: list[tuple[float, float]] = []
    errors: dict[str, int] = {}
    for line in out.splitlines():
        kind, *fields = line.split("\t")
        if kind == "quantile":
            quantiles.append((float(fields[0]), int(fields[1]) / 1e6))
        elif kind == "error":
            errors[fields[1]] = int(fields[0])
        elif kind == "total":
            duration, ok = int(fields[0]) / 1e6, int(fields[1])
            if int(fields[2]):
                raise RuntimeError(f"{name}: wrk ran out of payments: raise --per-round")
    completed = ok + sum(errors.values())
    steps = zip([0.0] + [p for p, _ in quantiles], quantiles)
    return Result(name, duration, ok, [(latency, (p - before) / 100 * completed) for before, (p, latency) in steps],
                  errors, spent)


def merged(name: str, results: list[Result]) -> Result:
    errors: dict[str, int] = {}
    spent: dict[str, float] = {}
    for r in results:
        for code, count in r.errors.items():
            errors[code] = errors.get(code, 0) + count
        for part, seconds in r.cpu_seconds.items():
            spent[part] = spent.get(part, 0.0) + seconds
    return Result(name, sum(r.seconds for r in results), sum(r.ok for r in results),
                  [x for r in results for x in r.latencies], errors, spent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--warmup", type=float, default=3)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)  # on 2 cores, threads only fight over the GIL
    parser.add_argument("--wrk-threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-round", type=int, default=None,
                        help="payments per client and round (default: enough for 2,500 req/s)")
    parser.add_argument("--server", choices=("wsgi", "asgi"), default="wsgi")
    parser.add_argument("--json", action="store_true", help="print one JSON object, nothing else on stdout")
    args = parser.parse_args()
    out = sys.stderr if args.json else sys.stdout
    if args.per_round is None:
        args.per_round = max(400, int(2500 * max(args.seconds, args.warmup) / args.clients))

    recreate_database()
    # One slice of payments per round, and one more for each server's warm-up.
    keys, full_payments, floor_payments = seed(clients=args.clients, per_client=args.per_round * (args.rounds + 1))
    runs: dict[str, list[Result]] = {"full": [], "floor": []}
    servers = {name: serve(module, server_mode=args.server, workers=args.workers, threads=args.threads)
               for name, module in (("full", "bench.settings_full"), ("floor", "bench.settings_floor"))}

    def slice_(payments: list[list[str]], n: int) -> list[list[str]]:
        return [p[n * args.per_round:(n + 1) * args.per_round] for p in payments]

    meters = {name: meter(server) for name, (server, _) in servers.items()}
    folding = Folding()
    try:
        for name, payments in (("full", full_payments), ("floor", floor_payments)):
            drive(name, servers[name][1], keys=keys, payments=slice_(payments, args.rounds), seconds=args.warmup,
                  wrk_threads=args.wrk_threads)
        analyze()
        # Alternate short rounds so that the noise of a shared machine falls on both alike.
        for round_ in range(args.rounds):
            for name, payments in (("full", full_payments), ("floor", floor_payments)):
                runs[name].append(drive(name, servers[name][1], keys=keys, payments=slice_(payments, round_),
                                        seconds=args.seconds, wrk_threads=args.wrk_threads, meter=meters[name]))
    finally:
        folding.stop()
        for server, _ in servers.values():
            stop(server)
    results = [merged(name, rs) for name, rs in runs.items()]
    full, floor = results
    ratio = full.throughput / floor.throughput
    goals = verdicts(args.clients, full, ratio)
    for name, rs in runs.items():  # on stderr under --json, which keeps stdout to the one object
        print(f"{name:6} rounds, req/s: " + ", ".join(f"{r.throughput:.0f}" for r in rs), file=out)
    if args.json:
        print(json.dumps({"clients": args.clients, "full": full.summary(), "floor": floor.summary(),
                          "ratio": round(ratio, 3), "server": args.server, "workers": args.workers,
                          "goals": {name: met for name, met in goals}}))
        return

    print(f"\n{args.clients} clients (wrk -t {args.wrk_threads}), gunicorn {args.server} -w {args.workers}"
          + (f" --threads {args.threads}" if args.server == "wsgi" else "")
          + f", {args.rounds} rounds of {args.seconds:.0f} s each after {args.warmup:.0f} s warm-up, "
          f"{os.cpu_count()} CPUs")
    print(f"{'':6} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'ok':>7}  errors")
    for r in results:
        print(f"{r.name:6} {r.throughput:8.1f} {r.percentile(0.5):8.1f} {r.percentile(0.99):8.1f} "
              f"{r.ok:7d}  {sum(r.errors.values())}")
        for code, n in sorted(r.errors.items()):
            print(f"       {n} x {code}")
    if full.cpu_seconds:
        parts = {r.name: r.cpu_ms() for r in results}
        print("CPU a request, ms (server, postgres, redis, wrk): " + "; ".join(
            f"{name} " + ", ".join(f"{ms[part]:.2f}" for part in ("server", "postgres", "redis", "wrk"))
            + f" = {ms['total']:.2f}" for name, ms in parts.items()))
    print(f"full / floor throughput: {ratio:.2f}; median latency full / floor: "
          f"{full.percentile(0.5) / floor.percentile(0.5):.1f}x")
    print("goals (issue 11): " + "; ".join(f"{name}: {'met' if met else 'MISSED'}" for name, met in goals))


def verdicts(clients: int, full: Result, ratio: float) -> list[tuple[str, bool]]:
    """Issue 11's goals for this client count: one client, p50; many (read at 32), throughput, share of
    the floor, p99 and no errors."""
    errors = sum(full.errors.values())
    if clients == 1:
        return [("full p50 <= 8 ms", full.percentile(0.5) <= 8), ("no errors", errors == 0)]
    return [("full >= 200 req/s", full.throughput >= 200), (">= 25 % of the floor", ratio >= 0.25),
            ("full p99 <= 250 ms", full.percentile(0.99) <= 250), ("no errors", errors == 0)]

if __name__ == "__main__":
    main()
