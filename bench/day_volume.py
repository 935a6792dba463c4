"""What one approved ``POST /api/v1/refunds`` costs as the day's refunds pile up, beside the floor.

    .venv/bin/python bench/day_volume.py [--volumes 0,5000,20000] [--requests 100] [--database NAME] [--json]

Each decision reads the currency's total of the day (the global daily limit) and its agent's total
of the day and of the last hour (refundops/selectors.py, ``_TOTALS_SQL``): summed from the day's
refunds, they cost a decision more with every refund of the day; kept as they change
(refundops/models/totals.py), they are a few rows a quarter hour (and the last hour's first minutes,
before its first quarter hour, summed from the refunds). Recreates the database ``refundops_bench``
and seeds it as bench/refunds.py does, then for each volume brings the day's counting refunds of the one agent, in the one currency,
up to it (copies of the refunds already made, inserted with SQL: the platform's own rows and
trigger, each copy a session of its own, counted at a random time of the day so far; then one fold
of the totals, as beat makes every few seconds) and sends ``--requests`` approved refunds
through Django's test client in process (every middleware, DRF, the service; PostgreSQL on a
persistent connection, as bench/profile_refund.py). Beside each, on the same connection and the
same payments' table: the bare floor (bench/floor.py's view called directly: lock the payment,
sum its refunds, insert one), which reads no day total. Prints for each volume the wall p50 and
the CPU a request of the request's thread and of its PostgreSQL backend, for both, and the floor's
CPU over the full path's; ``--json`` prints them as one object, ``{"requests", "volumes": [{"day_refunds",
"full": {"p50_ms", "thread_ms", "backend_ms"}, "floor": {...}, "cpu_ratio"}]}``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def grow_to(connection, volume: int, *, day_start) -> int:
    """Copy the day's refunds until there are ``volume`` of them (at least as many as there are),
    each counted at a random time of the day so far (``day_start`` to now), as a day's refunds are."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM refundops_refund")
        have = cursor.fetchone()[0]
        while have < volume:
            batch = min(have, volume - have)
            cursor.execute("CREATE TEMP TABLE IF NOT EXISTS bench_grow AS SELECT * FROM refundops_refund LIMIT 0")
            cursor.execute("TRUNCATE bench_grow")
            cursor.execute("INSERT INTO bench_grow SELECT * FROM refundops_refund ORDER BY id LIMIT %s", [batch])
            # Each copy a session of its own (a conversation makes a refund or two): the session's
            # sum, read by every decision, is the measured requests' one.
            cursor.execute("UPDATE bench_grow SET id = 'rf_' || replace(gen_random_uuid()::text, '-', ''),"
                           " agent_session_id = 'copy-' || left(md5(random()::text), 12),"
                           " counted_at = %(start)s + random() * (now() - %(start)s)", {"start": day_start})
            cursor.execute("INSERT INTO refundops_refund SELECT * FROM bench_grow")
            have += batch
        cursor.execute("ANALYZE refundops_refund")
    from refundops.services.totals import fold_totals

    fold_totals()  # what beat does every few seconds
    return have


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--volumes", default="0,5000,20000", help="the day's refunds before each measure")
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--database", default=os.environ.get("BENCH_DB_NAME", "refundops_bench"))
    parser.add_argument("--json", action="store_true", help="print one JSON object, nothing else on stdout")
    args = parser.parse_args()
    os.environ["BENCH_DB_NAME"] = args.database  # read by bench.refunds when it is imported
    from bench.profile_refund import backend_cpu, drain_sender
    from bench.refunds import recreate_database, seed

    volumes = sorted(int(v) for v in args.volumes.split(","))
    n = args.requests

    recreate_database()
    keys, payments, floor_payments = seed(clients=1, per_client=(n + 10) * len(volumes) + 30)
    from django.db import connection
    from django.test import Client, RequestFactory

    from django.utils import timezone

    from bench.floor import floor_refund
    from refundops.selectors import start_of_day

    client, factory = Client(), RequestFactory()
    headers = {"Authorization": f"Bearer {keys[0]}"}
    full_sent, floor_sent = iter(payments[0]), iter(floor_payments[0])

    def full() -> None:
        body = {"transaction_id": next(full_sent), "amount": 500, "reason": "customer_request",
                "agent": {"session_id": "bench-0", "model": "bench"}}
        response = client.post("/api/v1/refunds", body, content_type="application/json",
                               headers={**headers, "Idempotency-Key": uuid.uuid4().hex})
        assert response.status_code == 201 and response.json()["refund"]["status"] == "approved", response.content

    def floor() -> None:
        body = f'{{"transaction_id": "{next(floor_sent)}", "amount": 500, "reason": "customer_request"}}'
        response = floor_refund(factory.post("/api/v1/refunds", body, content_type="application/json"))
        assert response.status_code == 201, response.content

    def measure(one, count: int) -> tuple[float, float, float]:
        """p50 wall, the thread's CPU and the backend's CPU a request, in ms."""
        times, backend, thread = [], backend_cpu(connection), time.thread_time()
        for _ in range(count):
            start = time.perf_counter()
            one()
            times.append(time.perf_counter() - start)
        thread = time.thread_time() - thread
        backend = backend_cpu(connection) - backend if backend is not None else float("nan")
        return statistics.median(times) * 1000, thread / count * 1000, backend / count * 1000

    for _ in range(20):  # warm: imports, caches, the key's first use, the connection
        full()
        floor()
    drain_sender()
    rows = []
    if not args.json:
        print(f"{'day refunds':>11}  {'full p50 ms':>11} {'thread ms':>9} {'backend ms':>10}"
              f"  {'floor p50 ms':>12} {'thread ms':>9} {'backend ms':>10}  {'floor/full CPU':>14}")
    for volume in volumes:
        have = grow_to(connection, volume, day_start=start_of_day(timezone.now()))
        full_p50, full_thread, full_backend = measure(full, n)
        drain_sender()
        floor_p50, floor_thread, floor_backend = measure(floor, n)
        ratio = (floor_thread + floor_backend) / (full_thread + full_backend)
        rows.append({"day_refunds": have, "cpu_ratio": round(ratio, 3),
                     "full": {"p50_ms": round(full_p50, 2), "thread_ms": round(full_thread, 2),
                              "backend_ms": round(full_backend, 2)},
                     "floor": {"p50_ms": round(floor_p50, 2), "thread_ms": round(floor_thread, 2),
                               "backend_ms": round(floor_backend, 2)}})
        if args.json:
            continue
        print(f"{have:>11,}  {full_p50:>11.2f} {full_thread:>9.2f} {full_backend:>10.2f}"
              f"  {floor_p50:>12.2f} {floor_thread:>9.2f} {floor_backend:>10.2f}  {ratio:>14.3f}", flush=True)
    if args.json:
        print(json.dumps({"requests": n, "volumes": rows}))


if __name__ == "__main__":
    main()
