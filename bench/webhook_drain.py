"""Benchmark: how fast a burst of merchant webhook deliveries drains to a local merchant endpoint,
beside a floor measured in the same run.

    .venv/bin/python bench/webhook_drain.py [--deliveries 1000] [--concurrency 4] [--goal 60] [--json]

Real parts (bench/stack.py, as bench/drain.py uses them): the database ``refundops_webhook_drain``
(recreated from a migrated template, dropped at the end unless ``--keep``), a private
``redis-server`` as the broker, and ``celery -A refundops worker`` as deployed (docker-compose.yml's
``worker``: one worker on every queue, the prefork pool, ``--concurrency`` processes). The merchant's
endpoint is a ``ThreadingHTTPServer`` in this process that answers 200 and counts event ids.

Full: while no worker runs, ``--deliveries`` refund events are announced through
``outbound.announce_refund`` (what a refund's change writes: the delivery rows and the outbox rows
whose sender queues ``deliver_webhook``); then the worker starts and delivers them. The figure is
deliveries per second from the first POST the merchant received to the last; ``wall`` adds the
worker's start-up. The goal (issue 27, finding 5): the burst drained within ``--goal`` seconds.

Floor: as many rows of a table of its own, each delivered by a bare task (bench/webhook_drain_floor.py:
read, POST over a kept connection, mark; raw statements) on the same worker command and queue. It is
the Celery, broker, HTTP and PostgreSQL round trips any one-task-per-delivery worker pays; full /
floor is what the product's own path (ORM, signing, address check, attempt log) costs on top.

At the end every delivery must be ``delivered`` and its event received by the merchant; exit 1
otherwise. The machine is shared and noisy: read the ratio, and the load average printed with it.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path[:1]:
    sys.path.insert(0, str(ROOT))
from bench.stack import PrivateRedis, Workers, create_migrated_database, drop_database  # noqa: E402

SETTINGS = "bench.settings_webhook_drain"
FLOOR_TASK = "bench.webhook_drain_floor.post"


def log(message: str) -> None:
    print(f"[webhook-drain {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def database_url(name: str) -> str:
    base = os.environ.get("DATABASE_URL", "")
    if not base.startswith("postgres"):
        base = "postgres://postgres@127.0.0.1:5432/postgres"
    return urlunsplit(urlsplit(base)._replace(path=f"/{name}"))


class Merchant:
    """The merchant's endpoint: 200 to every POST; when each event id first arrived."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.received: collections.Counter[str] = collections.Counter()
        self.first: dict[str, float] = {}
        merchant = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as a merchant's server would

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                event_id = json.loads(body)["id"]
                with merchant.lock:
                    merchant.received[event_id] += 1
                    merchant.first.setdefault(event_id, time.monotonic())
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, args=(0.1,), daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}/refund-events"

    def span(self, ids: set[str]) -> tuple[int, float, float]:
        """How many of ``ids`` arrived, and when the first and the last of them first did."""
        with self.lock:
            times = [self.first[i] for i in ids if i in self.first]
        return len(times), min(times, default=0.0), max(times, default=0.0)


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.workdir = Path(tempfile.mkdtemp(prefix="refundops-webhook-drain-"))
        self.redis = PrivateRedis(self.workdir)
        self.merchant = Merchant()
        self.violations: list[dict[str, Any]] = []

    def setup(self) -> None:
        self.db_url = database_url(self.args.database)
        self.redis.start()
        self.env = {**os.environ, "DJANGO_SETTINGS_MODULE": SETTINGS, "DATABASE_URL": self.db_url,
                    "REDIS_URL": self.redis.url, "REDIS_KEY_PREFIX": "webhook-drain:",
                    "CELERY_TASK_ALWAYS_EAGER": "false", "DATABASE_POOL": "false", "DJANGO_DEBUG": "false",
                    "PYTHONUNBUFFERED": "1"}
        create_migrated_database(self.db_url, self.env)
        os.environ.update(self.env)
        import django

        django.setup()
        from django.db import connection

        from bench.webhook_drain_floor import DDL
        from refundops.models import MerchantEndpoint
        from tests.conftest import make_payment

        with connection.cursor() as cursor:
            cursor.execute(DDL)
        self.endpoint = MerchantEndpoint.objects.create(url=self.merchant.url, description="webhook drain bench")
        self.payment = make_payment(amount=10_000)

    # -- seeding, while no worker runs --------------------------------------------------------------
    def seed_full(self, n: int) -> set[str]:
        from django.db import transaction

        from refundops import outbound, outbox
        from refundops.models import Refund, RefundState

        refund = Refund.objects.create(payment=self.payment, amount_minor=1_000, currency="USD",
                                       reason="customer_request", status=RefundState.SETTLED)
        event_ids: set[str] = set()
        started = time.monotonic()
        for start in range(0, n, 100):  # what n refund changes leave behind, 100 to a transaction
            with transaction.atomic():
                for _ in range(min(100, n - start)):
                    event_ids.update(d.event_id for d in outbound.announce_refund(refund, previous="submitted"))
        if not outbox.drain(timeout=300):
            raise RuntimeError("the outbox's sender did not hand every delivery to the broker")
        log(f"seeded {n} deliveries in {time.monotonic() - started:.1f} s")
        return event_ids

    def seed_floor(self, n: int) -> set[str]:
        from django.db import connection

        from refundops.celery import app

        event_ids = {f"evt_floor_{i}" for i in range(n)}
        with connection.cursor() as cursor:
            cursor.executemany("INSERT INTO webhook_floor_delivery (id, url, body) VALUES (%s, %s, %s)",
                               [(i, self.merchant.url, json.dumps({"id": f"evt_floor_{i}"}).encode())
                                for i in range(n)])
        for i in range(n):
            app.send_task(FLOOR_TASK, kwargs={"delivery_id": i}, queue="default")
        return event_ids

    # -- one drain ----------------------------------------------------------------------------------
    def drain(self, kind: str, event_ids: set[str]) -> dict[str, Any]:
        queues = ["default", "payments.sandbox", "payments.stripe", "payments.paypal"]
        workers = Workers(1, self.env, self.workdir, queues, pool="prefork", concurrency=self.args.concurrency,
                          name=f"webhook-drain-{kind}-", extra=["--include", "bench.webhook_drain_floor"])
        started = time.monotonic()
        workers.start_all()
        deadline = started + self.args.timeout
        try:
            while time.monotonic() < deadline:
                got, _, _ = self.merchant.span(event_ids)
                if got >= len(event_ids):
                    break
                time.sleep(0.2)
        finally:
            workers.shut_down_all(timeout=30)
        got, first, last = self.merchant.span(event_ids)
        seconds = last - first
        run = {"kind": kind, "deliveries": len(event_ids), "received": got, "seconds": round(seconds, 2),
               "wall_seconds": round(last - started, 2) if got else None,
               "per_second": round(got / seconds, 1) if seconds > 0 else 0.0, "load_average": os.getloadavg()}
        log(f"{kind}: {got} of {len(event_ids)} received in {seconds:.1f} s ({run['per_second']}/s; "
            f"wall {run['wall_seconds']} s; load {os.getloadavg()[0]:.1f})")
        return run

    def check(self, event_ids: set[str]) -> dict[str, int]:
        from refundops.models import WebhookDelivery

        counts = dict(collections.Counter(WebhookDelivery.objects.values_list("status", flat=True)))
        for delivery in WebhookDelivery.objects.exclude(status=WebhookDelivery.Status.DELIVERED)[:50]:
            self.violations.append({"delivery": delivery.pk, "status": delivery.status, "error": delivery.last_error})
        missing = event_ids - set(self.merchant.received)
        if missing:
            self.violations.append({"not_received": len(missing)})
        return counts

    def run(self) -> dict[str, Any]:
        n = self.args.deliveries
        floor = self.drain("floor", self.seed_floor(n))
        full_ids = self.seed_full(n)
        full = self.drain("full", full_ids)
        statuses = self.check(full_ids)
        ratio = round(full["per_second"] / floor["per_second"], 2) if floor["per_second"] else None
        return {"deliveries": n, "concurrency": self.args.concurrency, "cpus": os.cpu_count(),
                "full": full, "floor": floor, "full_over_floor": ratio, "statuses": statuses,
                "goal_seconds": self.args.goal, "goal_met": bool(full["wall_seconds"] is not None
                                                                 and full["received"] == n
                                                                 and full["wall_seconds"] <= self.args.goal),
                "duplicates": sum(c - 1 for c in self.merchant.received.values() if c > 1),
                "violations": self.violations}

    def teardown(self) -> None:
        self.merchant.server.shutdown()
        self.redis.kill()
        if not self.args.keep:
            drop_database(self.db_url)
            shutil.rmtree(self.workdir, ignore_errors=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--deliveries", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=4, help="worker processes (docker-compose: 4)")
    parser.add_argument("--goal", type=float, default=60.0, help="seconds the burst should drain within")
    parser.add_argument("--timeout", type=float, default=600.0, help="give up on a drain after this long")
    parser.add_argument("--database", default="refundops_webhook_drain")
    parser.add_argument("--keep", action="store_true", help="keep the database and the work directory (worker logs)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    bench = Bench(args)
    try:
        bench.setup()
        report = bench.run()
    finally:
        bench.teardown()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        full, floor = report["full"], report["floor"]
        print(f"{report['deliveries']} deliveries, {args.concurrency} worker processes, {report['cpus']} CPUs")
        print(f"  full : {full['per_second']:>7}/s  ({full['seconds']} s first to last; wall {full['wall_seconds']} s)")
        print(f"  floor: {floor['per_second']:>7}/s  ({floor['seconds']} s first to last; wall {floor['wall_seconds']} s)")
        print(f"  full / floor = {report['full_over_floor']}; goal {args.goal:g} s "
              f"{'met' if report['goal_met'] else 'NOT met'}; duplicates {report['duplicates']}; "
              f"violations {len(report['violations'])}")
    return 1 if report["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
