"""Benchmark: how fast the worker pays approved refunds, with 1 and 2 worker processes, beside a floor.

    .venv/bin/python bench/drain.py [--refunds 2000] [--processes 1,2] [--json] [--profile DIR]

Real parts (bench/stack.py, as bench/chaos.py uses them): the database ``refundops_drain``
(``--database``; recreated from a migrated template, dropped at the end unless ``--keep``), a private
``redis-server`` on a free port as the broker, and ``celery -A refundops worker`` as deployed
(docker-compose.yml's ``worker``: one worker on every queue, the prefork pool) with
``--concurrency`` 1, then 2: one or two processes that run tasks. The gateway is the sandbox, its
settle delay set to zero: it answers ``succeeded`` at once, so one ``submit_refund`` task takes an
approved refund to settled (approved, submitted, settled in one recorded answer).

For each process count, while no worker runs, ``--refunds`` refunds are asked through
``services.refunds.request_refund`` as an agent, each on a payment (and sandbox charge) of its own:
what a real request leaves behind (the refund approved, its verdict, history, audit entry, the
outbox row whose nudge queues ``submit_refund`` on ``payments.sandbox``, the breaker's count task
on ``default``). Then the worker starts and drains them; the figure is refunds settled per second,
from the first gateway attempt opened to the last refund settled (the worker's start-up is not in
it). Progress goes to stderr every few seconds.

The floor, in the same run and with the same worker command and process count: as many refunds on a
table of its own, each paid by a bare task (``bench/drain_floor.py``: claim, keyed "gateway" insert,
settle, three raw statements on a kept connection). It is the Celery, broker and PostgreSQL round
trips that any worker paying one refund at a time pays; the ratio full / floor is what the product's
own path (ORM, lease, locks, history, audit, outbox, webhooks) costs on top.

Beside each figure, the CPU a refund settled took, by part (bench/cpu.py, from ``/proc``): the worker's
processes, their PostgreSQL backends, the private redis-server, from the first refund seen settled to
the last. On a shared machine the rate moves with the others' load; the CPU a refund moves less, and
on two cores 2,000 ms over it is the rate's ceiling.

At the end it checks the sandbox's own books against ours: every refund settled, exactly one
sandbox refund per refund of ours, its amount and reference ours, one gateway attempt per refund,
succeeded; the floor's gateway table has one row per refund with its amount. Exits 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path[:1]:
    sys.path.insert(0, str(ROOT))  # run as a script: the project (and its tests) first
from bench import cpu  # noqa: E402
from bench.stack import PrivateRedis, Workers, create_migrated_database, drop_database  # noqa: E402

SETTINGS = "bench.settings_drain"
FLOOR_TASK = "bench.drain_floor.pay"
QUEUE = "payments.sandbox"


def log(message: str) -> None:
    print(f"[drain {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def database_url(name: str) -> str:
    """``name`` on DATABASE_URL's PostgreSQL server, or on the local one."""
    base = os.environ.get("DATABASE_URL", "")
    if not base.startswith("postgres"):
        base = "postgres://postgres@127.0.0.1:5432/postgres"
    return urlunsplit(urlsplit(base)._replace(path=f"/{name}"))


@dataclass
class Drained:
    refunds: int
    settled: int = 0
    seconds: float = 0.0  # first attempt opened to last refund settled
    wall_seconds: float = 0.0  # worker started to last refund settled (its start-up included)
    seed_seconds: float = 0.0
    connections: int = 0  # database sessions the worker opened, start to shutdown (pg_stat_database)
    # CPU ms a refund settled, from the first refund seen settled to the last (start-up left out), by
    # part: the worker (Celery's main process and its pool), its PostgreSQL backends, the private
    # redis-server. On two cores the throughput's ceiling is 2,000 ms over their sum.
    cpu_ms: dict[str, float] = field(default_factory=dict)

    @property
    def per_second(self) -> float:
        return self.settled / self.seconds if self.seconds > 0 else 0.0

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "per_second": round(self.per_second, 1), "seconds": round(self.seconds, 2),
                "cpu_ms": {k: round(v, 2) for k, v in self.cpu_ms.items()},
                "wall_seconds": round(self.wall_seconds, 2), "seed_seconds": round(self.seed_seconds, 1)}


@dataclass
class Report:
    refunds: int
    runs: list[dict[str, Any]] = field(default_factory=list)
    violations: list[dict[str, Any]] = field(default_factory=list)
    checked: dict[str, int] = field(default_factory=dict)
    load_average: dict[str, list[float]] = field(default_factory=dict)
    cpus: int = os.cpu_count() or 0

    def as_json(self) -> dict[str, Any]:
        return {"refunds": self.refunds, "cpus": self.cpus, "runs": self.runs, "checked": self.checked,
                "exactly_once": not self.violations, "violations": len(self.violations),
                "violation_details": self.violations[:50], "load_average": self.load_average}


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.report = Report(refunds=args.refunds)
        self.workdir = Path(tempfile.mkdtemp(prefix="refundops-drain-"))
        self.redis = PrivateRedis(self.workdir)
        self.full_ids: list[str] = []
        self.floor_ids: list[int] = []
        self.workers: Workers | None = None

    # -- setup --------------------------------------------------------------------------------------
    def setup(self) -> None:
        self.db_url = database_url(self.args.database)
        self.redis.start()
        self.env = {**os.environ, "DJANGO_SETTINGS_MODULE": SETTINGS, "DATABASE_URL": self.db_url,
                    "REDIS_URL": self.redis.url, "REDIS_KEY_PREFIX": "drain:", "CELERY_TASK_ALWAYS_EAGER": "false",
                    "DATABASE_POOL": "false",  # as docker-compose.yml runs workers
                    "DJANGO_DEBUG": "false", "PYTHONUNBUFFERED": "1", **dict(self.args.env)}
        create_migrated_database(self.db_url, self.env)
        os.environ.update(self.env)
        import django

        django.setup()
        import logging

        from django.db import connection

        from bench.drain_floor import DDL
        from processors import sandbox
        from refundops.callers import Caller
        from tests.conftest import make_agent_key, make_limits, make_rules

        logging.getLogger("refundops").setLevel(logging.CRITICAL)
        make_limits()
        make_rules()
        sandbox.set_mode("up", settle_delay_seconds=0)  # succeeded as soon as accepted
        key, _ = make_agent_key(name="drain-agent")
        self.caller = Caller.for_key(key)
        with connection.cursor() as cursor:
            cursor.execute(DDL)

    # -- seeding ------------------------------------------------------------------------------------
    def seed_full(self, n: int) -> list[str]:
        """``n`` approved refunds, each asked through the service on a payment of its own."""
        from django.db import connection
        from django.utils import timezone

        from processors.models import SandboxCharge
        from refundops.models import Customer, Payment
        from refundops.services.refunds import request_refund

        tag = uuid.uuid4().hex[:8]
        customers = Customer.objects.bulk_create(
            [Customer(name=f"Drain {tag} {i}", email=f"drain-{tag}-{i}@example.com") for i in range(n)])
        SandboxCharge.objects.bulk_create(
            [SandboxCharge(reference=f"sbch_{tag}_{i}", currency="USD", authorized_minor=10_000, captured_minor=10_000)
             for i in range(n)])
        captured_at = timezone.now()
        payments = Payment.objects.bulk_create([
            Payment(customer=c, processor="sandbox", processor_reference=f"sbch_{tag}_{i}", currency="USD",
                    amount_authorized_minor=10_000, amount_captured_minor=10_000, status=Payment.Status.CAPTURED,
                    method_type="card", method_brand="visa", method_last4="4242", captured_at=captured_at)
            for i, c in enumerate(customers)])

        def ask(i: int) -> str:
            try:
                answer = request_refund(caller=self.caller, idempotency_key=uuid.uuid4().hex, data={
                    "transaction_id": payments[i].pk, "amount": amount_of(i), "reason": "customer_request"})
            finally:
                connection.close()
            refund = answer.body.get("refund") or {}
            if answer.status != 201 or refund.get("status") != "approved":
                raise RuntimeError(f"seeding: refund {i} not approved: {answer.status} {answer.body}")
            return refund["id"]

        done = [0]
        stop = threading.Event()
        started = time.monotonic()

        def progress() -> None:
            while not stop.wait(5):
                log(f"seeding: {done[0]} of {n} refunds asked")

        watcher = threading.Thread(target=progress, daemon=True)
        watcher.start()
        ids = []
        with ThreadPoolExecutor(self.args.seed_threads) as pool:
            for refund_id in pool.map(ask, range(n)):
                ids.append(refund_id)
                done[0] += 1
        stop.set()
        from refundops import outbox

        outbox.drain(timeout=120)  # every submit_refund queued before a worker starts (the sender sends them)
        log(f"seeded {n} approved refunds in {time.monotonic() - started:.1f} s")
        return ids

    def seed_floor(self, n: int) -> list[int]:
        """``n`` approved rows on the floor's table, and a bare task for each on the same queue."""
        from celery import current_app
        from django.db import connection

        with connection.cursor() as cursor:
            cursor.execute("SELECT coalesce(max(id), 0) FROM drain_floor_refund")
            first = cursor.fetchone()[0] + 1
            ids = list(range(first, first + n))
            cursor.executemany("INSERT INTO drain_floor_refund (id, amount_minor, idempotency_key) VALUES (%s, %s, %s)",
                               [(i, amount_of(i), f"floor:{i}:0") for i in ids])
        connection.close()
        for i in ids:
            current_app.send_task(FLOOR_TASK, kwargs={"refund_id": i}, queue=QUEUE)
        return ids

    # -- draining -----------------------------------------------------------------------------------
    def settled_count(self, kind: str, ids: list) -> int:
        from django.db import connection

        with connection.cursor() as cursor:
            if kind == "full":
                cursor.execute("SELECT count(*) FROM refundops_refund WHERE id = ANY(%s) AND status = 'settled'", [ids])
            else:
                cursor.execute("SELECT count(*) FROM drain_floor_refund WHERE id = ANY(%s) AND status = 'settled'",
                               [ids])
            return cursor.fetchone()[0]

    def sessions(self) -> int:
        """Sessions opened on the bench's database so far: each new connection counts once."""
        from django.db import connection

        connection.close()  # this process's next statement opens the one it keeps while a worker runs
        with connection.cursor() as cursor:
            cursor.execute("SELECT pg_stat_force_next_flush()")
        with connection.cursor() as cursor:
            cursor.execute("SELECT sessions FROM pg_stat_database WHERE datname = current_database()")
            return int(cursor.fetchone()[0])

    def span(self, kind: str, ids: list) -> float:
        """Seconds from the first refund's work starting to the last refund settled, from the database."""
        from django.db import connection

        with connection.cursor() as cursor:
            if kind == "full":
                cursor.execute("SELECT extract(epoch FROM (SELECT max(settled_at) FROM refundops_refund WHERE id = ANY(%s))"
                               " - (SELECT min(started_at) FROM refundops_gatewayattempt WHERE refund_id = ANY(%s)))",
                               [ids, ids])
            else:
                cursor.execute("SELECT extract(epoch FROM max(settled_at) - min(started_at)) FROM drain_floor_refund"
                               " WHERE id = ANY(%s)", [ids])
            return float(cursor.fetchone()[0] or 0.0)

    def drain(self, kind: str, ids: list, processes: int, seed_seconds: float) -> Drained:
        from django.db import connection

        result = Drained(refunds=len(ids), seed_seconds=seed_seconds)
        self.workers = Workers(1, self.env, self.workdir, self.queues, pool="prefork", concurrency=processes,
                               name=f"drain-{kind}-{processes}-", extra=["--include", "bench.drain_floor"])
        sessions = self.sessions()
        started = time.monotonic()
        self.workers.start_all()
        profiler = self.start_profiler(kind, processes)
        deadline = started + self.args.drain_seconds
        last_log = started
        meter, metered_from = None, 0
        try:
            while True:
                result.settled = self.settled_count(kind, ids)  # on one kept connection
                now = time.monotonic()
                if meter is None and result.settled and cpu.available():
                    meter, metered_from = self.cpu_meter(), result.settled
                    meter.start()
                elif meter is not None:
                    meter.sample()  # a backend closed mid-run (Celery's fixup, every 1,000 tasks) still counts
                if result.settled >= len(ids) or now > deadline:
                    break
                proc = self.workers.procs[0]
                if proc is None or proc.poll() is not None:
                    raise RuntimeError(f"the worker stopped; its log is in {self.workdir}")
                if now - last_log >= self.args.progress_seconds:
                    log(f"{kind}, {processes} process(es): {result.settled} of {len(ids)} settled "
                        f"after {now - started:.0f} s")
                    last_log = now
                time.sleep(0.2)
            result.wall_seconds = time.monotonic() - started
            if meter is not None and result.settled > metered_from:
                spent = meter.stop()
                result.cpu_ms = {part: spent[part] * 1000 / (result.settled - metered_from)
                                 for part in ("worker", "postgres", "redis")}
                result.cpu_ms["total"] = sum(result.cpu_ms.values())
        finally:
            self.stop_profiler(profiler)
            self.workers.shut_down_all()
        result.seconds = self.span(kind, ids)
        result.connections = self.sessions() - sessions - 1  # not this process's own (it was kept)
        connection.close()
        if result.settled < len(ids):
            self.report.violations.append({"kind": "not_drained", "run": kind, "processes": processes,
                                           "settled": result.settled, "refunds": len(ids)})
        log(f"{kind}, {processes} process(es): {result.settled} settled in {result.seconds:.1f} s: "
            f"{result.per_second:.1f} refunds/s; {result.connections} database connections opened")
        return result

    def cpu_meter(self) -> cpu.Meter:
        """The worker's processes, the PostgreSQL backends on the bench's database but this
        process's own, and the private redis-server (bench/cpu.py), sampled every poll: a backend
        that ends mid-run (Celery's fixup recycles one every 1,000 tasks) counts to its last sample;
        one that starts counts from zero."""
        from django.db import connection

        def backends() -> set[int]:
            with connection.cursor() as cursor:
                cursor.execute("SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                               " AND pid <> pg_backend_pid()")
                return {pid for (pid,) in cursor.fetchall()}

        worker = self.workers.procs[0].pid
        return cpu.Meter({"worker": lambda: cpu.descendants(worker), "postgres": backends,
                          "redis": lambda: {self.redis.proc.pid}})

    def start_profiler(self, kind: str, processes: int) -> subprocess.Popen | None:
        """py-spy on the worker and its pool processes, for the product's run with one process."""
        if not self.args.profile or kind != "full" or processes != min(self.args.processes):
            return None
        out = Path(self.args.profile) / f"drain-worker-{processes}.txt"
        out.parent.mkdir(parents=True, exist_ok=True)
        py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
        return subprocess.Popen([py_spy, "record", "--pid", str(self.workers.procs[0].pid), "--subprocesses",
                                 "--format", "raw", "--rate", "200", "--output", str(out), "--nonblocking"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    @staticmethod
    def stop_profiler(profiler: subprocess.Popen | None) -> None:
        if profiler is not None:
            profiler.send_signal(2)  # SIGINT: py-spy writes what it recorded
            profiler.wait(timeout=60)

    # -- the books ----------------------------------------------------------------------------------
    def check(self) -> None:
        """Nothing paid twice: the sandbox's books against ours, refund by refund; the floor's too."""
        from django.db import connection

        from processors.models import SandboxRefund
        from refundops.models import GatewayAttempt, Refund

        violations = self.report.violations
        ours = {r.pk: r for r in Refund.objects.filter(pk__in=self.full_ids)}
        at_gateway: dict[str, list[SandboxRefund]] = {}
        for sandbox_refund in SandboxRefund.objects.select_related("charge"):
            at_gateway.setdefault(str(sandbox_refund.metadata.get("refund_id")), []).append(sandbox_refund)
        attempts: dict[str, list[GatewayAttempt]] = {}
        for attempt in GatewayAttempt.objects.filter(refund_id__in=self.full_ids):
            attempts.setdefault(attempt.refund_id, []).append(attempt)
        for refund_id in self.full_ids:
            refund, paid = ours.get(refund_id), at_gateway.get(refund_id, [])
            if refund is None or refund.status != "settled":
                violations.append({"kind": "not_settled", "refund": refund_id,
                                   "status": refund.status if refund else None})
                continue
            if len(paid) != 1:
                violations.append({"kind": "paid_twice" if len(paid) > 1 else "not_paid", "refund": refund_id,
                                   "gateway_refunds": [p.reference for p in paid]})
                continue
            (one,) = paid
            if one.amount_minor != refund.amount_minor or one.reference != refund.processor_refund_id \
                    or one.charge.refunded_minor != refund.amount_minor:
                violations.append({"kind": "amount_or_reference_differs", "refund": refund_id,
                                   "ours": [refund.amount_minor, refund.processor_refund_id],
                                   "theirs": [one.amount_minor, one.reference, one.charge.refunded_minor]})
            tries = attempts.get(refund_id, [])
            if [a.outcome for a in tries] != ["succeeded"]:
                violations.append({"kind": "attempts", "refund": refund_id, "outcomes": [a.outcome for a in tries]})
        strays = set(at_gateway) - set(self.full_ids)
        if strays:
            violations.append({"kind": "gateway_refund_not_ours", "refunds": sorted(strays)[:20]})
        with connection.cursor() as cursor:
            cursor.execute("SELECT r.id, r.status, r.amount_minor, count(g.*), coalesce(sum(g.amount_minor), 0)"
                           " FROM drain_floor_refund r LEFT JOIN drain_floor_gateway g ON g.refund_id = r.id"
                           " GROUP BY r.id HAVING r.status <> 'settled' OR count(g.*) <> 1"
                           " OR coalesce(sum(g.amount_minor), 0) <> r.amount_minor")
            for row in cursor.fetchall():
                violations.append({"kind": "floor_not_paid_once", "row": list(row)})
        self.report.checked = {"refunds": len(self.full_ids),
                               "sandbox_refunds": sum(len(v) for v in at_gateway.values()),
                               "floor_refunds": len(self.floor_ids)}
        connection.close()

    # -- the whole run ------------------------------------------------------------------------------
    def run(self) -> Report:
        try:
            self.report.load_average["start"] = [round(x, 2) for x in os.getloadavg()]
            self.setup()
            from django.conf import settings

            self.queues = list(settings.CELERY_WORKER_QUEUES)
            for processes in self.args.processes:
                started = time.monotonic()
                ids = self.seed_full(self.args.refunds)
                full = self.drain("full", ids, processes, time.monotonic() - started)
                self.full_ids += ids
                started = time.monotonic()
                floor_ids = self.seed_floor(self.args.refunds)
                floor = self.drain("floor", floor_ids, processes, time.monotonic() - started)
                self.floor_ids += floor_ids
                self.report.runs.append({
                    "processes": processes, "full": full.as_json(), "floor": floor.as_json(),
                    "ratio": round(full.per_second / floor.per_second, 3) if floor.per_second else None})
            self.report.load_average["end"] = [round(x, 2) for x in os.getloadavg()]
            self.check()
        finally:
            self.teardown()
        return self.report

    def teardown(self) -> None:
        if self.workers is not None:
            self.workers.stop_all()
        self.redis.kill()
        if not self.args.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)
            if getattr(self, "db_url", None):  # the migrated template stays, for the next run
                drop_database(self.db_url)


def amount_of(i: int) -> int:
    """Refund amounts in minor units, varied so that a mixed-up pair shows in the books."""
    return 100 + (i % 97) * 50


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--refunds", type=int, default=2000, help="approved refunds to drain per run")
    parser.add_argument("--processes", default="1,2", help="worker pool sizes to measure, comma-separated")
    parser.add_argument("--database", default="refundops_drain", help="the bench's own database (recreated)")
    parser.add_argument("--drain-seconds", type=float, default=900, help="deadline for one run to drain")
    parser.add_argument("--seed-threads", type=int, default=4, help="threads asking for refunds while seeding")
    parser.add_argument("--progress-seconds", type=float, default=5)
    parser.add_argument("--env", action="append", default=[], type=lambda kv: tuple(kv.split("=", 1)),
                        metavar="KEY=VALUE", help="a setting for the workers (and seeding), e.g. DATABASE_CONN_MAX_AGE=600")
    parser.add_argument("--profile", default="", metavar="DIR",
                        help="py-spy the worker (collapsed stacks) during the product's run with the fewest processes")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (worker logs) and the database")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    args.processes = [int(p) for p in args.processes.split(",")]
    report = Bench(args).run().as_json()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(f"drain: {report['refunds']} approved refunds per run, sandbox settle delay 0, celery worker "
              f"--pool prefork, {report['cpus']} CPUs, load average {report['load_average']}")
        print(f"{'processes':>9} {'full refunds/s':>15} {'floor refunds/s':>16} {'full/floor':>11}"
              f" {'full s':>7} {'floor s':>8} {'connections':>12}   CPU ms a refund, full (floor):"
              f" worker, postgres, redis, total")
        for run in report["runs"]:
            full_cpu, floor_cpu = run["full"]["cpu_ms"], run["floor"]["cpu_ms"]
            spent = ", ".join(f"{full_cpu.get(part, 0):.2f} ({floor_cpu.get(part, 0):.2f})"
                              for part in ("worker", "postgres", "redis", "total"))
            print(f"{run['processes']:>9} {run['full']['per_second']:>15.1f} {run['floor']['per_second']:>16.1f} "
                  f"{run['ratio'] or 0:>11.3f} {run['full']['seconds']:>7.1f} {run['floor']['seconds']:>8.1f} "
                  f"{run['full']['connections']:>12}   {spent}")
        checked = report["checked"]
        if report["exactly_once"]:
            print(f"exactly once: {checked.get('refunds')} refunds settled, {checked.get('sandbox_refunds')} sandbox "
                  f"refunds, one each with our amount and reference; none paid twice; floor "
                  f"{checked.get('floor_refunds')} paid once each")
        else:
            print(f"VIOLATIONS: {report['violations']}")
            for violation in report["violation_details"][:20]:
                print(f"  {json.dumps(violation, default=str)[:400]}")
    return 0 if report["exactly_once"] else 1


if __name__ == "__main__":
    sys.exit(main())
