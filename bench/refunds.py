"""Benchmark: ``POST /api/v1/refunds`` on the approved path with the full policy, beside a floor.

    .venv/bin/python bench/refunds.py [--rounds 3] [--seconds 10] [--clients 32] [--workers 4] [--threads 4]

Recreates the database ``refundops_bench`` (PostgreSQL on 127.0.0.1), migrates it, seeds payments,
limits, hold rules and one agent key per client through the ORM, then in turn serves

* full: the platform (bench.settings_full) behind gunicorn: key, capability, rate limits in Redis,
  idempotency, payment and platform locks, running totals, the policy, verdict, refund, history,
  audit entry, breaker count; Celery not eager, broker in Redis, no worker (the queue only fills);
* floor: a bare DRF view (bench.floor) that locks the payment row, sums its refunds and inserts one;

and drives them in turn, in alternating rounds, from this process with ``--clients`` threads, every request on a payment of its
own. It prints throughput, p50 and p99 of each and their ratio. The machine is shared and noisy:
read medians and ratios, and run it more than once.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psycopg
import requests

ROOT = Path(__file__).resolve().parent.parent
DB_NAME = "refundops_bench"
PG = "postgres://postgres@127.0.0.1:5432"
ENV = {
    "DATABASE_URL": f"{PG}/{DB_NAME}",
    "REDIS_URL": os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/11"),
    "CELERY_TASK_ALWAYS_EAGER": "false",
    "DJANGO_DEBUG": "false",
}
AMOUNT = 500


def recreate_database() -> None:
    with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {DB_NAME}")
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT, check=True,
                   env={**os.environ, **ENV, "DJANGO_SETTINGS_MODULE": "bench.settings_full"})


def seed(*, clients: int, per_client: int) -> tuple[list[str], list[list[str]], list[list[str]]]:
    """Agent keys, and for each client its own payments for the full run and for the floor run."""
    os.environ.update({**ENV, "DJANGO_SETTINGS_MODULE": "bench.settings_full"})
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    import redis
    from django.conf import settings
    from django.db import connection
    from django.utils import timezone

    from refundops.access import generate_key
    from refundops.models import Agent, AgentKey, Customer, HoldRules, Payment, RefundLimits

    redis.Redis.from_url(settings.REDIS_URL).flushdb()
    big = 10**12
    RefundLimits.objects.create(
        currency="USD", version=1, approval_threshold_minor=100_000, refund_window_days=90,
        allowed_reasons=["customer_request", "duplicate", "fraudulent", "product_issue"],
        max_refunds_per_payment=5, customer_daily_count=10, customer_daily_amount_minor=1_000_000,
        customer_30d_count=50, customer_30d_amount_minor=5_000_000, agent_hourly_amount_minor=big,
        agent_daily_amount_minor=big, session_amount_minor=big, global_daily_amount_minor=big,
        created_by="bench")
    HoldRules.objects.create(version=1, created_by="bench")  # every hold rule on; none fires here
    keys = []
    for i in range(clients):
        agent = Agent.objects.create(name=f"bench-{i}", capabilities=["refunds.create", "payments.read"])
        raw, prefix, digest = generate_key()
        AgentKey.objects.create(agent=agent, prefix=prefix, key_hash=digest)
        keys.append(raw)
    total = clients * per_client * 2
    customers = Customer.objects.bulk_create(
        [Customer(name=f"Bench {i}", email=f"bench{i}@example.com") for i in range(total)], batch_size=5000)
    captured_at = timezone.now() - timezone.timedelta(days=2)
    payments = Payment.objects.bulk_create([
        Payment(customer=c, processor="sandbox", processor_reference=f"bench_{i}", currency="USD",
                amount_authorized_minor=10_000, amount_captured_minor=10_000, method_type="card",
                method_brand="visa", method_last4="4242", captured_at=captured_at)
        for i, c in enumerate(customers)], batch_size=5000)
    with connection.cursor() as cursor:
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


def serve(settings_module: str, *, workers: int, threads: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "gunicorn", "refundops.wsgi", "-w", str(workers), "--threads", str(threads),
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


@dataclass
class Result:
    name: str
    seconds: float
    latencies: list[float]
    errors: dict[str, int]

    @property
    def throughput(self) -> float:
        return len(self.latencies) / self.seconds

    def percentile(self, p: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(p * len(ordered)))] * 1000 if ordered else float("nan")


def drive(name: str, url: str, *, keys: list[str], payments: list[list[str]], warmup: float,
          seconds: float) -> Result:
    """Each client posts refunds back to back, each on a payment of its own; only requests that
    start after the warm-up count."""
    start = time.perf_counter() + warmup
    end = start + seconds
    latencies: list[list[float]] = [[] for _ in keys]
    errors: dict[str, int] = {}
    lock = threading.Lock()

    def client(i: int) -> None:
        session = requests.Session()
        headers = {"Authorization": f"Bearer {keys[i]}", "Content-Type": "application/json"}
        for payment in payments[i]:
            t0 = time.perf_counter()
            if t0 >= end:
                return
            response = session.post(f"{url}/api/v1/refunds", headers={**headers, "Idempotency-Key": uuid.uuid4().hex},
                                    json={"transaction_id": payment, "amount": AMOUNT, "reason": "customer_request",
                                          "agent": {"session_id": f"bench-{i}", "model": "bench"}})
            t1 = time.perf_counter()
            if response.status_code == 201 and (name == "floor" or response.json()["refund"]["status"] == "approved"):
                if t0 >= start:
                    latencies[i].append(t1 - t0)
            else:
                with lock:
                    code = f"{response.status_code} {response.text[:120]}"
                    errors[code] = errors.get(code, 0) + 1
        raise RuntimeError(f"client {i} ran out of payments: raise --per-client")

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(len(keys))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return Result(name, seconds, [x for xs in latencies for x in xs], errors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--warmup", type=float, default=3)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--per-round", type=int, default=400, help="payments per client and round")
    args = parser.parse_args()

    recreate_database()
    keys, full_payments, floor_payments = seed(clients=args.clients, per_client=args.per_round * args.rounds)
    runs: dict[str, list[Result]] = {"full": [], "floor": []}
    servers = {name: serve(module, workers=args.workers, threads=args.threads)
               for name, module in (("full", "bench.settings_full"), ("floor", "bench.settings_floor"))}
    try:
        # Alternate short rounds so that the noise of a shared machine falls on both alike.
        for round_ in range(args.rounds):
            for name, payments in (("full", full_payments), ("floor", floor_payments)):
                mine = [p[round_ * args.per_round:(round_ + 1) * args.per_round] for p in payments]
                runs[name].append(drive(name, servers[name][1], keys=keys, payments=mine,
                                        warmup=args.warmup, seconds=args.seconds))
    finally:
        for server, _ in servers.values():
            stop(server)
    results = [Result(name, sum(r.seconds for r in rs), [x for r in rs for x in r.latencies],
                      {k: sum(r.errors.get(k, 0) for r in rs) for r in rs for k in r.errors})
               for name, rs in runs.items()]
    for name, rs in runs.items():
        print(f"{name:6} rounds, req/s: " + ", ".join(f"{r.throughput:.0f}" for r in rs))

    print(f"\n{args.clients} clients, gunicorn -w {args.workers} --threads {args.threads}, {args.rounds} rounds "
          f"of {args.seconds:.0f} s each after {args.warmup:.0f} s warm-up, {os.cpu_count()} CPUs")
    print(f"{'':6} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'ok':>7}  errors")
    for r in results:
        print(f"{r.name:6} {r.throughput:8.1f} {r.percentile(0.5):8.1f} {r.percentile(0.99):8.1f} "
              f"{len(r.latencies):7d}  {sum(r.errors.values())}")
        for code, n in sorted(r.errors.items()):
            print(f"       {n} x {code}")
    full, floor = results
    ratio = full.throughput / floor.throughput
    verdict = "meets" if ratio >= 1 / 3 and full.percentile(0.99) < 100 else "misses"
    print(f"full / floor throughput: {ratio:.2f} (bar: >= 0.33 with full p99 < 100 ms: {verdict} it)")
    print(f"median latency full / floor: {statistics.median(full.latencies) / statistics.median(floor.latencies):.1f}x")


if __name__ == "__main__":
    main()
