"""Benchmark: a backtest over recorded refund requests.

    .venv/bin/python bench/backtest.py [--requests 100000] [--distinct N] [--rounds 2]

Recreates the database ``refundops_bench_backtest`` (PostgreSQL on 127.0.0.1), migrates it, and
writes ``--requests`` verdicts as ``request_refund`` records them (policy input and totals), spread
over the last 7 days: amounts, reasons, agents, flags and totals vary so that the active version
approves, holds and refuses. Then it replays them through a draft (a lower approval threshold and
one reason fewer, so many outcomes change) and prints requests per second. The goal: 100,000 in
under a minute. The machine is shared: run it when nobody's tests are running, and read the median.

``--distinct N`` decides only N requests in Python (8 minutes for 100,000 on a loaded machine) and
copies them set-based, each copy a verdict of its own, up to ``--requests``: a year's million in
minutes. The replay reads and decides every copy as it would a request of its own.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
DB_NAME = "refundops_bench_backtest"
PG = "postgres://postgres@127.0.0.1:5432"


def copy_verdicts(distinct: int, requests: int) -> None:
    """The ``distinct`` verdicts copied, set-based, until there are ``requests``: each copy its own id."""
    from django.db import connection

    columns = [f.column for f in __import__("audit.models", fromlist=["Verdict"]).Verdict._meta.concrete_fields
               if f.column not in ("id", "seq")]
    names = ", ".join(f'"{c}"' for c in columns)
    with connection.cursor() as cursor:
        cursor.execute(
            f"""INSERT INTO audit_verdict (id, {names})
                SELECT 'vd_' || md5(v.id || '-' || k), {", ".join(f'v."{c}"' for c in columns)}
                FROM audit_verdict v CROSS JOIN generate_series(1, %s) k
                ORDER BY k, v.id LIMIT %s""", [(requests - 1) // distinct, requests - distinct])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--distinct", type=int, default=0, help="decide this many, copy them up to --requests")
    args = parser.parse_args()

    with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {DB_NAME}")
    os.environ.update(DATABASE_URL=f"{PG}/{DB_NAME}", DJANGO_SETTINGS_MODULE="refundops.settings")
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    from django.core.management import call_command
    from django.utils import timezone

    from audit.models import Verdict
    from refundops.models import Customer, HoldRules, Payment, PolicyDraft, RefundLimits
    from refundops.policy import RefundAsk, Totals, evaluate_refund, policy_input, policy_version
    from refundops.services.backtest import run_backtest

    call_command("migrate", verbosity=0)
    limits = RefundLimits.objects.create(
        currency="USD", version=1, approval_threshold_minor=20_000,
        allowed_reasons=["customer_request", "duplicate", "fraudulent", "product_issue"],
        customer_daily_count=5, customer_daily_amount_minor=100_000, customer_30d_count=20,
        customer_30d_amount_minor=500_000, agent_hourly_amount_minor=2_000_000, agent_daily_amount_minor=10_000_000,
        session_amount_minor=300_000, global_daily_amount_minor=10**9)
    rules = HoldRules.objects.order_by("-version").first()
    rng, now, started = random.Random(12), timezone.now(), time.monotonic()
    reasons = ["customer_request", "duplicate", "fraudulent", "product_issue"]
    batch: list[Verdict] = []
    distinct = min(args.distinct or args.requests, args.requests)
    for i in range(distinct):
        at = now - timedelta(seconds=rng.randrange(7 * 24 * 3600))
        customer = Customer(email_changed_at=at - timedelta(days=2) if rng.random() < 0.03 else None)
        captured = rng.choice((5_000, 20_000, 60_000, 150_000))
        payment = Payment(id=f"txn_bench{i}", customer=customer, currency="USD", status="captured",
                          amount_captured_minor=captured, amount_refunded_minor=0,
                          amount_reserved_minor=rng.choice((0, 0, 0, captured // 2)),
                          captured_at=at - timedelta(days=rng.choice((1, 5, 30, 100))),
                          dispute_status="open" if rng.random() < 0.02 else "none",
                          fraud_flags=["velocity"] if rng.random() < 0.03 else [])
        ask = RefundAsk(amount_minor=rng.choice((None, 1_000, 4_500, 15_000, 30_000)), reason=rng.choice(reasons),
                        destination="original_method", agent_id=f"ag_{rng.randrange(20)}", session_id="s")
        totals = Totals(payment_refund_count=rng.choice((0, 0, 1, 2)), customer_day_count=rng.choice((0, 1, 2, 5)),
                        customer_day_minor=rng.choice((0, 3_000, 40_000)), customer_30d_count=rng.choice((0, 3, 9)),
                        customer_30d_minor=rng.choice((0, 20_000, 200_000)), customer_velocity_count=rng.choice((0, 1, 4)),
                        agent_hour_minor=0, agent_day_minor=0, session_minor=rng.choice((0, 100_000)),
                        global_day_minor=0, agents_payment_minor=rng.choice((0, 0, 5_000, 18_000)),
                        agents_customer_window_minor=rng.choice((0, 0, 10_000)))
        decision = evaluate_refund(payment=payment, ask=ask, limits=limits, rules=rules, totals=totals, now=at,
                                   paused=False, breaker_open=False, ledger_mismatch=False)
        batch.append(Verdict(
            operation="refund.create", outcome=decision.outcome, code=decision.code, amount_minor=decision.amount_minor,
            currency="USD", payment_id=payment.pk, hold_reasons=decision.hold_reasons, totals=vars(totals),
            checks=decision.checks_json(), policy_version=policy_version(limits, rules),
            policy_input=policy_input(payment=payment, ask=ask, limits=limits, rules=rules, now=at, paused=False,
                                      breaker_open=False, ledger_mismatch=False)))
        if len(batch) == 5_000:
            Verdict.objects.bulk_create(batch)
            batch.clear()
    Verdict.objects.bulk_create(batch)
    Verdict.objects.update(created_at=timezone.now() - timedelta(days=1))  # auto_now_add: all in the window
    if distinct < args.requests:
        copy_verdicts(distinct, args.requests)  # the copies keep that time: no UPDATE of a million rows
    print(f"seeded {args.requests} recorded requests in {time.monotonic() - started:.0f} s")

    values = {f.name: getattr(limits, f.name) for f in RefundLimits._meta.fields
              if f.name not in ("id", "currency", "version", "note", "created_by", "created_at")}
    draft = PolicyDraft.objects.create(kind="limits", currency="USD", values={
        **values, "approval_threshold_minor": 10_000, "allowed_reasons": reasons[:3]})
    took = []
    if os.environ.get("BENCH_PROFILE"):
        import cProfile
        import pstats
        cProfile.runctx("run_backtest(draft=draft, days=7)", globals(), locals(), "/tmp/backtest.prof")
        pstats.Stats("/tmp/backtest.prof").sort_stats("tottime").print_stats(18)
    for _ in range(args.rounds):
        started = time.monotonic()
        result = run_backtest(draft=draft, days=7)
        took.append(time.monotonic() - started)
        print(f"replayed {result.requests} requests in {took[-1]:.1f} s: {result.requests / took[-1]:,.0f}/s; "
              f"{len(result.changes)} change; active {({k: v.count for k, v in result.active.outcomes.items()})}, "
              f"draft {({k: v.count for k, v in result.drafted.outcomes.items()})}")
    import resource

    print(f"peak RSS of this process (seed and replays): {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")
    median = statistics.median(took)
    from refundops.services.backtest import _COLUMNS, recorded_requests

    started = time.monotonic()  # the floor: the same rows read and decoded, nothing replayed
    read = sum(1 for _ in recorded_requests(days=7)[1].exclude(policy_input={}).values_list(*_COLUMNS)
               .iterator(chunk_size=5_000))
    floor = time.monotonic() - started
    print(f"median {median:.1f} s for {args.requests} requests: {args.requests / median:,.0f} requests/s "
          f"({'under' if median < 60 else 'OVER'} a minute); floor: the {read} rows read in {floor:.1f} s "
          f"({median / floor:.1f}x)")
    from django.db import connections

    connections.close_all()
    with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {DB_NAME} WITH (FORCE)")


if __name__ == "__main__":
    main()
