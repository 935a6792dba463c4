"""Benchmark: how long concurrent refunds wait on locks, and how long a lock they all take is held.

    .venv/bin/python bench/locks.py [--clients 8] [--seconds 10] [--scenarios spread,same] [--json]

Recreates its own database (``--database``, default ``refundops_locks``), migrates and seeds it with
bench/refunds.py's helpers (limits and hold rules whose ceilings no client reaches, one agent and
key per client, payments of 100.00 USD), then runs each scenario:

* ``spread``: ``--clients`` clients, each on a customer of its own and an agent of its own. Nothing
  in the product asks these to serialize; every wait measured here is a shared lock's doing.
* ``same`` (the control): the same number of clients, each with an agent of its own, all on ONE
  customer. These must serialize by design, so the measurement has to see waits here.

Each client is a process of its own calling ``request_refund`` in process (the service the API
and MCP call; no HTTP, so the clients' CPU goes to the lock path, not to parsing), one refund of
5.00 per payment, a fresh Idempotency-Key each, its own PostgreSQL connection (so one backend pid
is one client), first ``--warmup`` seconds unmeasured, then ``--seconds`` measured, all released
at once. Measured in that same window:

* lock waits, sampled: a separate connection reads ``pg_stat_activity`` every ``--interval-ms``
  (``wait_event_type = 'Lock'``: ``transactionid``, ``tuple``, ``advisory``, ...), per client pid;
  a client's wait share is its samples waiting over all samples, its wait time that share of the
  window;
* lock waits, logged: ``log_lock_waits = on`` and ``deadlock_timeout = --deadlock-timeout-ms`` are
  set on the bench database only (``ALTER DATABASE``); every wait that outlasted it is logged with
  its exact length when granted, and read back from the server log (when this process can read
  it: ``pg_current_logfile()``, else Debian's ``/var/log/postgresql/postgresql-<major>-main.log``,
  or ``--pg-log``). Waits shorter than the timeout are not logged: the sampled figure has them;
* hold of shared locks, two ways: (1) in each client, every ``lock*`` function that
  refundops/services/refunds.py imports from refundops/locks.py is wrapped: the time the call takes
  (the wait for the lock, plus its query) and the time from its return to the commit (the hold,
  taken with ``transaction.on_commit``); (2) sampled from PostgreSQL: row locks on
  ``--row-tables`` (default the PlatformState table) through ``pgrowlocks``, and granted advisory
  locks from ``pg_locks``: the share of samples in which each is held, in which mode, by how many
  clients at once; and its waiters (an advisory lock not granted; for a row, a tuple lock on its
  table, which PostgreSQL takes only to queue for a row another holds). An advisory lock that more
  than one client held is reported as shared, named when refundops/locks.py names its keys
  (``_key``: platform, currency, fast-path slots, customer, agent);
* throughput (refunds approved per second) and p50/p99 latency of ``request_refund`` calls.

The machine is shared and small: run it when ``uptime`` shows a modest load, twice, and read the
ratios between scenarios and between runs of the same code, not one figure alone.
"""

from __future__ import annotations

import argparse
import glob
import json
import multiprocessing as mp
import os
import re
import statistics
import sys
import threading
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import psycopg  # noqa: E402

from bench import refunds as base  # noqa: E402

DB_NAME = "refundops_locks"
AMOUNT = 500
SCENARIOS = ("spread", "same")
SAMPLE = """
SELECT extract(epoch FROM clock_timestamp())::float8,
  coalesce((SELECT array_agg(a.pid || ' ' || a.wait_event) FROM pg_stat_activity a
            WHERE a.datname = current_database() AND a.wait_event_type = 'Lock'
              AND a.pid <> pg_backend_pid()), '{}'),
  coalesce((SELECT array_agg(l.pid || ' ' || l.mode || ' ' || l.granted || ' ' || CASE l.locktype
                     WHEN 'advisory' THEN 'advisory ' || l.classid || '/' || l.objid || '/' || l.objsubid
                     ELSE 'tuple ' || l.relation::regclass END)
            FROM pg_locks l
            WHERE (l.locktype = 'advisory' AND l.database = %(db)s)
               OR (l.locktype = 'tuple' AND l.relation = ANY(%(rels)s))), '{}')
"""
ROWS = """coalesce((SELECT array_agg({table!r} || ' ' || r.locker || ' '
                                  || replace(array_to_string(r.modes, '+'), ' ', ''))
            FROM pgrowlocks({table!r}) r), '{{}}')"""
LOGGED = re.compile(r"process (\d+) acquired (\S+) on (\S+).*? after ([\d.]+) ms")


# -- setup ---------------------------------------------------------------------------------------

def prepare(args: argparse.Namespace) -> dict:
    """A fresh database, migrated and seeded: for each scenario and client an agent (with a key), a
    customer (spread) or the scenario's one customer (same), and ``--per-client`` payments."""
    base.recreate_database(args.database)
    with psycopg.connect(f"{base.PG}/postgres", autocommit=True) as conn:
        conn.execute(f"ALTER DATABASE {args.database} SET log_lock_waits = on")
        conn.execute(f"ALTER DATABASE {args.database} SET deadlock_timeout = '{args.deadlock_timeout_ms}ms'")
    with psycopg.connect(f"{base.PG}/{args.database}", autocommit=True) as conn:
        try:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pgrowlocks")  # contrib; Debian's server package has it
            row_locks = True
        except psycopg.Error as failed:
            print(f"pgrowlocks unavailable ({failed}): row locks are not sampled", file=sys.stderr)
            row_locks = False
    base.setup_django(args.database)
    from django.db import connection
    from django.utils import timezone

    from refundops.models import AgentKey, Customer, Payment, PlatformState

    big = 10**12
    # Ceilings no client reaches in a run: every refund is approved on the full policy path.
    base.create_policy(limits={"approval_threshold_minor": big, "customer_daily_count": 10**6,
                               "customer_daily_amount_minor": big, "customer_30d_count": 10**6,
                               "customer_30d_amount_minor": big},
                       rules={"velocity_max_refunds": 10**6})
    PlatformState.objects.get_or_create(pk=1)
    captured_at = timezone.now() - timezone.timedelta(days=2)
    plan: dict = {}
    for scenario in args.scenarios:
        keys = base.create_agents(args.clients, name=f"locks-{scenario}")
        count = args.clients if scenario == "spread" else 1
        customers = Customer.objects.bulk_create(
            [Customer(name=f"Locks {scenario} {i}", email=f"locks-{scenario}-{i}@example.com") for i in range(count)])
        clients = []
        for c, raw in enumerate(keys):
            customer = customers[c % count]
            payments = Payment.objects.bulk_create([
                Payment(customer=customer, processor="sandbox", processor_reference=f"locks_{scenario}_{c}_{j}",
                        currency="USD", amount_authorized_minor=10_000, amount_captured_minor=10_000,
                        method_type="card", method_brand="visa", method_last4="4242", captured_at=captured_at)
                for j in range(args.per_client)], batch_size=5000)
            key = AgentKey.objects.get(prefix=raw[:11])
            clients.append({"key_id": key.pk, "customer": customer.pk, "agent": key.agent_id,
                            "payments": [p.pk for p in payments]})
        plan[scenario] = clients
    with connection.cursor() as cursor:
        cursor.execute("ANALYZE")
    plan["row_tables"] = (args.row_tables or [PlatformState._meta.db_table]) if row_locks else []
    plan["labels"] = advisory_labels(plan, args.scenarios)
    return plan


def advisory_labels(plan: dict, scenarios: list[str]) -> dict[str, str]:
    """Names for the advisory locks refundops/locks.py takes, as pg_locks shows their keys
    (``classid/objid/1`` of a 64-bit key), when it names its scopes with ``_key(*parts)``:
    the platform, the currency, its fast-path slots (one name for all), each customer and agent."""
    from refundops import locks

    key = getattr(locks, "_key", None)
    if key is None:
        return {}
    named = {("platform",): "platform", ("currency", "USD"): "currency USD"}
    named.update({("slot", "USD", str(i)): "fast-path slots USD (any)"
                  for i in range(getattr(locks, "FAST_PATH_SLOTS", 0))})
    for scenario in scenarios:
        for spec in plan[scenario]:
            named[("customer", spec["customer"])] = f"customer {spec['customer']}"
            named[("agent", spec["agent"])] = f"agent {spec['agent']}"
    labels = {}
    for parts, label in named.items():
        value = key(*parts) & 0xFFFF_FFFF_FFFF_FFFF
        labels[f"{value >> 32}/{value & 0xFFFF_FFFF}/1"] = label
    return labels


# -- one client (a process of its own) -----------------------------------------------------------

def instrument(records: dict[str, list[tuple[float, float]]]) -> None:
    """Wrap every ``lock*`` function refundops/services/refunds.py took from refundops/locks.py:
    record (call seconds, seconds from its return to the commit) for each call that commits."""
    from django.db import transaction

    from refundops.services import refunds

    for name, fn in list(vars(refunds).items()):
        if not (callable(fn) and name.startswith("lock") and getattr(fn, "__module__", "") == "refundops.locks"):
            continue
        calls = records.setdefault(name, [])

        def wrapper(*args, _fn=fn, _calls=calls, **kwargs):
            started = time.perf_counter()
            answer = _fn(*args, **kwargs)
            held = time.perf_counter()
            transaction.on_commit(lambda: _calls.append((held - started, time.perf_counter() - held)))
            return answer

        setattr(refunds, name, wrapper)


def client(index: int, scenario: str, spec: dict, args: argparse.Namespace, barrier, results) -> None:
    """Refunds on this client's payments, one at a time: a warm-up, then the measured stretch."""
    from django.db import connection

    import refundops.services.refunds as service
    from refundops.callers import Caller
    from refundops.models import AgentKey

    records: dict[str, list[tuple[float, float]]] = {}
    instrument(records)
    caller = Caller.for_key(AgentKey.objects.select_related("agent__merchant").get(pk=spec["key_id"]))
    with connection.cursor() as cursor:
        cursor.execute("SELECT set_config('application_name', %s, false), pg_backend_pid()",
                       [f"locks-{scenario}-{index}"])
        pid = cursor.fetchone()[1]
    payments = iter(spec["payments"])
    latencies: list[float] = []
    outcomes: Counter = Counter()
    exhausted = False

    def one() -> tuple[float, str]:
        data = {"transaction_id": next(payments), "amount": AMOUNT, "reason": "customer_request",
                "agent": {"session_id": f"locks-{scenario}-{index}", "model": "bench"}}
        started = time.perf_counter()
        answer = service.request_refund(caller=caller, data=data, idempotency_key=str(uuid.uuid4()))
        elapsed = time.perf_counter() - started
        approved = answer.status == 201 and (answer.body.get("refund") or {}).get("status") == "approved"
        return elapsed, "approved" if approved else f"{answer.status} {answer.code}"

    try:
        end = time.monotonic() + args.warmup
        while time.monotonic() < end:
            one()
    except StopIteration:
        exhausted = True
    for calls in records.values():
        calls.clear()
    barrier.wait()
    try:
        end = time.monotonic() + args.seconds
        while not exhausted and time.monotonic() < end:
            elapsed, outcome = one()
            latencies.append(elapsed)
            outcomes[outcome] += 1
    except StopIteration:
        exhausted = True
    results.put({"index": index, "pid": pid, "latencies": latencies, "outcomes": dict(outcomes),
                 "exhausted": exhausted, "locks": records, "customer": spec["customer"], "agent": spec["agent"]})
    connection.close()


# -- the sampler (a thread of this process, a connection of its own) -------------------------------

class Sampler(threading.Thread):
    def __init__(self, database: str, row_tables: list[str], interval: float) -> None:
        super().__init__(daemon=True)
        self.conn = psycopg.connect(f"{base.PG}/{database}", autocommit=True, application_name="locks-sampler")
        self.params = {
            "db": self.conn.execute("SELECT oid FROM pg_database WHERE datname = current_database()").fetchone()[0],
            "rels": [self.conn.execute("SELECT %s::regclass::oid", [t]).fetchone()[0] for t in row_tables]}
        self.query = SAMPLE.rstrip() + "".join(f",\n  {ROWS.format(table=t)}" for t in row_tables)
        self.interval, self.go, self.halt = interval, threading.Event(), threading.Event()
        self.samples: list[tuple] = []

    def run(self) -> None:
        self.go.wait()
        with self.conn.cursor() as cursor:
            due = time.perf_counter()
            while not self.halt.is_set():
                cursor.execute(self.query, self.params, prepare=True)
                self.samples.append(cursor.fetchone())
                due += self.interval
                pause = due - time.perf_counter()
                if pause > 0:
                    time.sleep(pause)
                else:
                    due = time.perf_counter()
        self.conn.close()


def server_log(database: str, explicit: str | None) -> Path | None:
    """The server log this process can read, or None."""
    if explicit:
        return Path(explicit)
    with psycopg.connect(f"{base.PG}/{database}", autocommit=True) as conn:
        current, major, directory = conn.execute(
            "SELECT pg_current_logfile(), current_setting('server_version_num')::int / 10000, "
            "current_setting('data_directory')").fetchone()
    candidates = [str(Path(directory) / current)] if current else []
    candidates += glob.glob(f"/var/log/postgresql/postgresql-{major}-*.log")
    for candidate in candidates:
        if os.access(candidate, os.R_OK):
            return Path(candidate)
    return None


# -- one scenario --------------------------------------------------------------------------------

def run_scenario(scenario: str, clients: list[dict], args: argparse.Namespace, plan: dict) -> dict:
    from django.db import connections

    connections.close_all()  # the children open their own
    context = mp.get_context("fork")
    barrier, results = context.Barrier(len(clients) + 1), context.Queue()
    workers = [context.Process(target=client, args=(i, scenario, spec, args, barrier, results))
               for i, spec in enumerate(clients)]
    log = server_log(args.database, args.pg_log)
    for worker in workers:
        worker.start()
    sampler = Sampler(args.database, plan["row_tables"], args.interval_ms / 1000)  # after the fork
    sampler.start()
    barrier.wait(timeout=args.warmup + 120)
    started = time.perf_counter()
    sampler.go.set()
    log_start = log.stat().st_size if log else 0  # the warm-up's waits are before this
    reports = [results.get(timeout=args.seconds + 120) for _ in workers]
    window = time.perf_counter() - started
    sampler.halt.set()
    sampler.join()
    for worker in workers:
        worker.join(timeout=30)
    logged = read_log(log, log_start, args.database) if log else None
    return summarize(scenario, sorted(reports, key=lambda r: r["index"]), sampler.samples, window, logged, args,
                     log, plan)


def read_log(log: Path, start: int, database: str) -> list[tuple[int, str, str, float]]:
    """(pid, mode, what, ms) of each wait log_lock_waits logged for ``database`` since ``start``."""
    with log.open("rb") as f:
        f.seek(start)
        text = f.read().decode("utf-8", "replace")
    waits = []
    for line in text.splitlines():
        if f"@{database} " in line or f"@{database}:" in line:
            match = LOGGED.search(line)
            if match:
                waits.append((int(match[1]), match[2], match[3], float(match[4])))
    return waits


# -- figures -------------------------------------------------------------------------------------

def percentile(values: list[float], p: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(p * len(ordered) + 0.5) - 1))]


def ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 3)


def summarize(scenario: str, reports: list[dict], samples: list[tuple], window: float,
              logged: list | None, args: argparse.Namespace, log: Path | None, plan: dict) -> dict:
    n = len(samples)
    pid_client = {r["pid"]: r["index"] for r in reports}
    stamps = [s[0] for s in samples]
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    per_client_waiting: Counter = Counter()
    by_event: Counter = Counter()
    for sample in samples:
        for entry in sample[1]:
            pid, event = entry.split(" ", 1)
            if int(pid) in pid_client:
                per_client_waiting[pid_client[int(pid)]] += 1
                by_event[event] += 1

    # Locks that more than one client held: advisory locks (pg_locks, granted) and rows (pgrowlocks).
    # Their waiters: advisory locks not granted; for a row, whoever holds or awaits its tuple lock
    # (PostgreSQL takes one only to queue for a row another transaction has locked).
    holders: dict[str, set] = defaultdict(set)
    keys: dict[str, set] = defaultdict(set)  # name -> the advisory keys it stands for
    held: dict[str, Counter] = defaultdict(Counter)  # name -> samples held, by mode
    waited: dict[str, Counter] = defaultdict(Counter)  # name -> samples with a waiter, waiter-samples
    holders_at_once: dict[str, int] = defaultdict(int)
    waiters_at_once: dict[str, int] = defaultdict(int)
    runs: list[tuple[str, int]] = []  # (name, samples) of each unbroken hold by one holder
    open_runs: dict[tuple[str, str], int] = {}  # (name, holder) -> index in runs
    for sample in samples:
        seen: dict[str, set] = defaultdict(set)
        waiting: dict[str, set] = defaultdict(set)
        modes: dict[str, set] = defaultdict(set)
        for entry in sample[2]:
            pid, mode, granted, kind, ident = entry.split(" ", 4)
            if int(pid) not in pid_client:
                continue
            if kind == "tuple":
                waiting[f"row of {ident}"].add(pid)
                continue
            name = f"advisory {plan['labels'].get(ident, ident)}"
            keys[name].add(ident)
            if granted == "true":
                seen[name].add(pid)
                modes[name].add(mode)
                holders[name].add(pid)
            else:
                waiting[name].add(pid)
        for rows in sample[3:]:
            for entry in rows:
                table, locker, mode = entry.split(" ")
                name = f"row of {table}"
                seen[name].add(locker)
                modes[name].add(mode)
                holders[name].add(locker)
        for name, who in seen.items():
            exclusive = any("Exclusive" in m or m in ("ForUpdate", "Update", "ForNoKeyUpdate", "NoKeyUpdate")
                            for m in modes[name])
            held[name]["exclusive" if exclusive else "shared"] += 1
            holders_at_once[name] = max(holders_at_once[name], len(who))
        for name, who in waiting.items():
            waited[name]["samples"] += 1
            waited[name]["waiter_samples"] += len(who)
            waiters_at_once[name] = max(waiters_at_once[name], len(who))
        now_held = {(name, holder) for name, who in seen.items() for holder in who}
        for pair in list(open_runs):
            if pair not in now_held:
                del open_runs[pair]
        for pair in now_held:
            if pair in open_runs:
                index = open_runs[pair]
                runs[index] = (pair[0], runs[index][1] + 1)
            else:
                open_runs[pair] = len(runs)
                runs.append((pair[0], 1))
    mean_gap = statistics.fmean(gaps) if gaps else 0.0
    hold_runs: dict[str, list[int]] = defaultdict(list)
    for name, length in runs:
        hold_runs[name].append(length)
    shared = []
    for table in plan["row_tables"]:
        held.setdefault(f"row of {table}", Counter())  # listed also when no one held it
    for name in sorted(set(held) | set(waited)):
        if len(holders[name]) < 2 and not name.startswith("row of"):
            continue  # one client's own lock (its customer's, its agent's): nobody else waits on it
        shared.append({
            "lock": name,
            "keys": len(keys[name]) if name.startswith("advisory") else 1,
            "held_share": round(sum(held[name].values()) / n, 4) if n else None,
            "exclusive_share": round(held[name]["exclusive"] / n, 4) if n else None,
            "shared_mode_share": round(held[name]["shared"] / n, 4) if n else None,
            "max_holders_at_once": holders_at_once[name],
            "distinct_holders": len(holders[name]),
            # A hold as sampled: from the first to the last sample that saw it (under by up to a gap).
            "sampled_hold_mean_ms": ms(statistics.fmean(hold_runs[name]) * mean_gap) if hold_runs[name] else None,
            "waited_share": round(waited[name]["samples"] / n, 4) if n else None,
            "max_waiters_at_once": waiters_at_once[name],
            "wait_s": round(waited[name]["waiter_samples"] / n * window, 3) if n else None,
        })

    latencies = [x for r in reports for x in r["latencies"]]
    outcomes: Counter = Counter()
    for r in reports:
        outcomes.update(r["outcomes"])
    approved = outcomes.pop("approved", 0)
    logged_by_pid: dict[int, list[float]] = defaultdict(list)
    logged_by_kind: dict[str, list[float]] = defaultdict(list)
    for pid, _mode, what, wait_ms in logged or []:
        if pid in pid_client:
            logged_by_pid[pid].append(wait_ms)
            logged_by_kind[what].append(wait_ms)

    per_client = []
    for r in reports:
        share = per_client_waiting[r["index"]] / n if n else None
        waits = logged_by_pid.get(r["pid"], [])
        per_client.append({
            "client": r["index"], "customer": r["customer"], "agent": r["agent"], "requests": len(r["latencies"]),
            "approved": r["outcomes"].get("approved", 0), "exhausted": r["exhausted"],
            "lock_wait_share": round(share, 4) if share is not None else None,
            "lock_wait_s": round(share * window, 3) if share is not None else None,
            "logged_waits": len(waits) if logged is not None else None,
            "logged_wait_s": round(sum(waits) / 1000, 3) if logged is not None else None,
        })
    in_process = {}
    for name in sorted({name for r in reports for name in r["locks"]}):
        calls = [c for r in reports for c in r["locks"].get(name, [])]
        acquire, hold = [a for a, _ in calls], [h for _, h in calls]
        in_process[name] = {
            "calls": len(calls),
            "call_p50_ms": ms(percentile(acquire, 0.5)), "call_p99_ms": ms(percentile(acquire, 0.99)),
            "call_total_s": round(sum(acquire), 3),
            "hold_p50_ms": ms(percentile(hold, 0.5)), "hold_p99_ms": ms(percentile(hold, 0.99)),
            "hold_total_s": round(sum(hold), 3),
            "hold_share": round(sum(hold) / window, 4),  # summed over clients: <= 1 if one holds it at a time
        }
    shares = [c["lock_wait_share"] for c in per_client if c["lock_wait_share"] is not None]
    return {
        "scenario": scenario,
        "clients": len(reports),
        "customers": len({r["customer"] for r in reports}),
        "agents": len({r["agent"] for r in reports}),
        "window_s": round(window, 3),
        "requests": len(latencies),
        "approved": approved,
        "errors": dict(outcomes),
        "exhausted": any(r["exhausted"] for r in reports),
        "throughput_rps": round(approved / window, 1),
        "p50_ms": ms(percentile(latencies, 0.5)),
        "p99_ms": ms(percentile(latencies, 0.99)),
        "sampler": {"samples": n, "interval_ms": ms(mean_gap), "target_interval_ms": args.interval_ms},
        "lock_wait": {
            "mean_share": round(statistics.fmean(shares), 4) if shares else None,
            "total_s": round(sum(c["lock_wait_s"] for c in per_client if c["lock_wait_s"] is not None), 3),
            "by_event_s": {event: round(count / n * window, 3) for event, count in by_event.most_common()} if n else {},
            "logged": None if logged is None else {
                "log": str(log), "deadlock_timeout_ms": args.deadlock_timeout_ms,
                "waits": sum(len(v) for v in logged_by_kind.values()),
                "total_s": round(sum(sum(v) for v in logged_by_kind.values()) / 1000, 3),
                "p50_ms": percentile([w for v in logged_by_kind.values() for w in v], 0.5),
                "p99_ms": percentile([w for v in logged_by_kind.values() for w in v], 0.99),
                "by_kind_s": {kind: round(sum(v) / 1000, 3) for kind, v in sorted(logged_by_kind.items())},
            },
        },
        "per_client": per_client,
        "lock_functions": in_process,
        "shared_locks": shared,
    }


# -- the report ----------------------------------------------------------------------------------

def fmt(value, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


def print_report(report: dict) -> None:
    print(f"{report['clients']} clients, {report['seconds']:.0f} s measured after {report['warmup']:.0f} s "
          f"warm-up, {os.cpu_count()} CPUs, database {report['database']}, commit {report['commit']}")
    for s in report["scenarios"].values():
        w = s["lock_wait"]
        print(f"\n== {s['scenario']}: {s['customers']} customer(s), {s['agents']} agents; "
              f"{s['sampler']['samples']} samples every {fmt(s['sampler']['interval_ms'], '.2f')} ms")
        print(f"   {s['throughput_rps']:.1f} refunds/s, p50 {fmt(s['p50_ms'])} ms, p99 {fmt(s['p99_ms'])} ms, "
              f"{s['requests']} requests, errors {s['errors'] or 0}{', RAN OUT OF PAYMENTS' if s['exhausted'] else ''}")
        print(f"   lock wait (sampled): mean share {fmt(w['mean_share'], '.1%')}, total {w['total_s']:.2f} s "
              f"of {s['clients'] * s['window_s']:.1f} client-seconds; by event: "
              + (", ".join(f"{k} {v:.2f} s" for k, v in w["by_event_s"].items()) or "none"))
        if w["logged"] is not None:
            g = w["logged"]
            print(f"   lock wait (log_lock_waits, waits >= {g['deadlock_timeout_ms']} ms): {g['waits']} waits, "
                  f"{g['total_s']:.2f} s, p50 {fmt(g['p50_ms'])} ms, p99 {fmt(g['p99_ms'])} ms; "
                  + (", ".join(f"{k} {v:.2f} s" for k, v in g["by_kind_s"].items()) or "none"))
        print(f"   {'client':>6} {'requests':>8} {'wait share':>10} {'wait s':>7} {'logged':>7} {'logged s':>8}")
        for c in s["per_client"]:
            print(f"   {c['client']:>6} {c['requests']:>8} {fmt(c['lock_wait_share'], '.1%'):>10} "
                  f"{fmt(c['lock_wait_s'], '.2f'):>7} {fmt(c['logged_waits'], 'd'):>7} {fmt(c['logged_wait_s'], '.2f'):>8}")
        for name, f in s["lock_functions"].items():
            print(f"   {name}() in process: {f['calls']} calls, call p50/p99 {fmt(f['call_p50_ms'], '.2f')}/"
                  f"{fmt(f['call_p99_ms'], '.2f')} ms (wait + query); held to commit p50/p99 "
                  f"{fmt(f['hold_p50_ms'], '.2f')}/{fmt(f['hold_p99_ms'], '.2f')} ms, "
                  f"{f['hold_total_s']:.2f} s in all = {f['hold_share']:.2f} x the window")
        for lock in s["shared_locks"]:
            many = f" ({lock['keys']} keys)" if lock["keys"] > 1 else ""
            print(f"   shared {lock['lock']}{many}: held {fmt(lock['held_share'], '.1%')} of samples "
                  f"(exclusive {fmt(lock['exclusive_share'], '.1%')}, shared mode {fmt(lock['shared_mode_share'], '.1%')}), "
                  f"up to {lock['max_holders_at_once']} holder(s) at once, {lock['distinct_holders']} "
                  f"{'transactions' if lock['lock'].startswith('row') else 'clients'} held it, "
                  f"sampled hold ~{fmt(lock['sampled_hold_mean_ms'], '.2f')} ms; waited on in "
                  f"{fmt(lock['waited_share'], '.1%')} of samples, up to {lock['max_waiters_at_once']} waiter(s), "
                  f"{fmt(lock['wait_s'], '.2f')} s in all")
        if not s["shared_locks"]:
            print("   no lock held by more than one client was seen")


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=10)
    parser.add_argument("--warmup", type=float, default=2)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    parser.add_argument("--per-client", type=int, default=2000, help="payments per client and scenario")
    parser.add_argument("--interval-ms", type=float, default=1.0, help="sampling interval")
    parser.add_argument("--deadlock-timeout-ms", type=int, default=1, help="log_lock_waits logs waits past this")
    parser.add_argument("--row-tables", default="", help="tables whose row locks to sample (default PlatformState's)")
    parser.add_argument("--pg-log", default=None, help="the PostgreSQL server log (default: found)")
    parser.add_argument("--database", default=DB_NAME)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    args.scenarios = [s for s in args.scenarios.split(",") if s]
    args.row_tables = [t for t in args.row_tables.split(",") if t]
    if unknown := set(args.scenarios) - set(SCENARIOS):
        parser.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")

    plan = prepare(args)
    commit = os.popen(f"git -C {ROOT} rev-parse --short HEAD 2>/dev/null").read().strip() or None
    report = {"clients": args.clients, "seconds": args.seconds, "warmup": args.warmup, "database": args.database,
              "commit": commit, "row_tables": plan["row_tables"],
              "scenarios": {s: run_scenario(s, plan[s], args, plan) for s in args.scenarios}}
    if args.json:
        print(json.dumps(report))
    else:
        print_report(report)
    return report


if __name__ == "__main__":
    main()
