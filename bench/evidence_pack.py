"""Benchmark: the auditors' evidence pack for a quarter of many refunds (issue 32).

    .venv/bin/python bench/evidence_pack.py [--refunds 200000] [--reuse]

Recreates the database ``refundops_bench_evidence`` (or ``$BENCH_DATABASE``; PostgreSQL on 127.0.0.1),
migrates it and seeds the quarter 2026-10-01..2026-12-31 with set-based SQL (``INSERT … SELECT …
FROM generate_series``, as bench/admin_scale.py does): per refund one payment, one verdict with its running totals, one
gateway attempt when it was paid, and one audit entry; a customer for every ten payments; limits
and an agent in force from before the quarter. The audit entries need the key's MAC, the verdicts
the sealer's cover: ``bench/fast_chain.py`` computes both with the real functions in two processes
and COPYs the entries already sealed (linked by the sealer's own function), so the pack's
``verify_audit`` walks a chain that verifies (tests/test_bench_fast_chain.py). ``--reuse`` keeps an
already seeded database of the same size; ``--seed-only`` seeds and stops.

Then, each in a fresh process so that each peak memory is its own:
- the floor: a plain streaming read of the same rows (verdicts, refunds, attempts, audit entries of
  the quarter; one server-side cursor each) written as CSV into a deflated ZIP, nothing checked;
- the pack: ``build_pack`` for the quarter, with a progress bar on stderr (one line per control).
Both print wall time and peak RSS; read the pack's beside the floor's (the machine is shared).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import os
import subprocess
import sys
import time
import uuid
import zipfile
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from bench.fast_chain import COVER_MARK_SQL  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
DB_NAME = os.environ.get("BENCH_DATABASE", "refundops_bench_evidence")  # another name: a run of its own
PG = "postgres://postgres@127.0.0.1:5432"
START, END = datetime(2026, 10, 1, tzinfo=UTC), datetime(2027, 1, 1, tzinfo=UTC)  # END exclusive
QUARTER = "(timestamptz '2026-10-01 00:00+00' + (i::float / %(n)s) * interval '92 days')"

SEED = [
    """INSERT INTO refundops_customer (id, name, email, address, created_at, merchant_id)
       SELECT 'cus_' || substr(md5('c' || i), 1, 24), 'Customer ' || i, 'customer' || i || '@example.com', '',
              timestamptz '2026-01-01 00:00+00', 'mer_default'
       FROM generate_series(1, greatest(%(n)s / 10, 1)) i""",
    f"""INSERT INTO refundops_payment (id, processor, processor_account, processor_reference,
              authorization_reference, status, currency, amount_authorized_minor, amount_captured_minor,
              amount_refunded_minor, amount_reserved_minor, method_type, method_brand, method_last4,
              order_reference, order_amount_minor, amount_owed_minor, dispute_status, dispute_reference,
              fraud_flags, paid_twice, captured_at, created_at, customer_id, merchant_id)
       SELECT 'txn_' || substr(md5('p' || i), 1, 24), 'sandbox', '', 'ch_' || substr(md5('pr' || i), 1, 20), '',
              'captured', 'USD', 2000 + i %% 90000, 2000 + i %% 90000, 500 + i %% 500, 0, 'card', 'visa',
              lpad((i %% 10000)::text, 4, '0'), 'order-' || i, NULL, 0, 'none', '', '[]', false,
              {QUARTER} - interval '1 day', {QUARTER} - interval '1 day',
              'cus_' || substr(md5('c' || (1 + i %% greatest(%(n)s / 10, 1))), 1, 24), 'mer_default'
       FROM generate_series(1, %(n)s) i""",
    f"""INSERT INTO audit_verdict (id, created_at, operation, dry_run, deduplicated, outcome, code, message,
              agent_id, agent_name, key_prefix, staff_username, idempotency_key, payment_id, refund_id,
              amount_minor, currency, request, checks, totals, hold_reasons, policy_version, gateway_response,
              policy_input, shadow, chained_by)
       SELECT 'vd_' || substr(md5('v' || i), 1, 24), {QUARTER}, 'refund.create', false, false,
              CASE WHEN i %% 20 = 0 THEN 'denied' ELSE 'approved' END,
              CASE WHEN i %% 20 = 0 THEN 'DAILY_LIMIT_REACHED' ELSE '' END, '',
              %(agent)s, 'support-bot', 'rk_bench', '', 'idem-' || i,
              'txn_' || substr(md5('p' || i), 1, 24), 'rf_' || substr(md5('r' || i), 1, 24),
              500 + i %% 500, 'USD', '{{"agent": {{"session_id": "sess"}}}}',
              '[{{"name": "amount", "result": "pass"}}, {{"name": "reason", "result": "pass"}}]',
              jsonb_build_object('customer_day_minor', i %% 3000, 'customer_day_count', i %% 3,
                                 'customer_30d_minor', i %% 9000, 'customer_30d_count', i %% 9,
                                 'global_day_minor', i %% 900000, 'agent_hour_minor', i %% 50000,
                                 'agent_day_minor', i %% 400000, 'session_minor', i %% 2000),
              '[]', 'limits v1 / rules v1', '{{}}', '{{}}', '{{}}', {COVER_MARK_SQL}
       FROM generate_series(1, %(n)s) i""",
    f"""INSERT INTO refundops_refund (id, amount_minor, currency, reason, note, status, origin, agent_session_id,
              agent_model, agent_reasoning, conversation_context, idempotency_key, hold_reasons,
              processor_refund_id, failure_code, failure_message, submit_attempts, created_at, updated_at,
              submitted_at, settled_at, agent_id, payment_id, verdict_id, counted_at, synced_at)
       SELECT 'rf_' || substr(md5('r' || i), 1, 24), 500 + i %% 500, 'USD', 'customer_request', '',
              CASE WHEN i %% 20 = 0 THEN 'denied' WHEN i %% 50 = 2 THEN 'failed' ELSE 'settled' END,
              'agent', 'sess', 'bench-model', 'the customer asked', '', 'idem-' || i, '[]',
              're_' || substr(md5('pr' || i), 1, 20), '', '', 1, t, t,
              CASE WHEN i %% 20 = 0 THEN NULL ELSE t + interval '1 second' END,
              CASE WHEN i %% 20 = 0 OR i %% 50 = 2 THEN NULL ELSE t + interval '1 minute' END,
              %(agent)s, 'txn_' || substr(md5('p' || i), 1, 24), 'vd_' || substr(md5('v' || i), 1, 24), t, t
       FROM (SELECT i, {QUARTER} AS t FROM generate_series(1, %(n)s) i) s""",
    """INSERT INTO refundops_gatewayattempt (id, idempotency_key, worker, outcome, started_at, lease_until,
              finished_at, processor_refund_id, error_code, error_message, refund_id)
       SELECT 'ga_' || substr(r.id, 4), 'refundops:' || r.id, 'bench', 'succeeded', r.submitted_at,
              r.submitted_at + interval '5 minutes', r.submitted_at, r.processor_refund_id, '', '', r.id
       FROM refundops_refund r WHERE r.submitted_at IS NOT NULL""",
]


def _django(db: str = DB_NAME) -> None:
    os.environ.update(DATABASE_URL=f"{PG}/{db}", DJANGO_SETTINGS_MODULE="refundops.settings")
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()


def seed(n: int, processes: int = 2) -> None:
    _django()
    from bench.admin_scale import fresh_database

    fresh_database(DB_NAME)
    from refundops.models import Agent, Capability, RefundLimits

    before = START - timedelta(days=30)
    RefundLimits.objects.filter(currency="USD").delete()
    limits = RefundLimits.objects.create(
        currency="USD", version=1, approval_threshold_minor=50_000, allowed_reasons=["customer_request"],
        customer_daily_count=10, customer_daily_amount_minor=10**7, customer_30d_count=100,
        customer_30d_amount_minor=10**8, agent_hourly_amount_minor=10**8, agent_daily_amount_minor=10**9,
        session_amount_minor=10**7, global_daily_amount_minor=10**10, created_by="bench")
    RefundLimits.objects.filter(pk=limits.pk).update(created_at=before)
    agent = Agent.objects.create(name="support-bot", capabilities=[Capability.PAYMENTS_READ, Capability.REFUNDS_CREATE])
    Agent.history.filter(id=agent.pk).update(history_date=before)
    with psycopg.connect(f"{PG}/{DB_NAME}") as conn:
        conn.execute("SET synchronous_commit = off")  # a bench's rows: a crash means seeding again
        # Bench-only: foreign keys and the audit triggers step aside while the rows go in.
        conn.execute("SET session_replication_role = replica")
        for sql in SEED:
            started = time.perf_counter()
            conn.execute(sql, {"n": n, "agent": agent.pk})
            conn.commit()
            print(f"  seeded {sql.split()[2]:<28} {time.perf_counter() - started:6.1f} s", flush=True)
    started = time.perf_counter()
    from audit.chain import seal

    seal()  # what the setup above wrote (the agent's creation, if audited), before the seeded chain
    from bench.fast_chain import COVER, write_chain

    tasks = [(entries_of, (lo, min(lo + COVER - 1, n), n)) for lo in range(1, n + 1, COVER)]
    written = write_chain(f"{PG}/{DB_NAME}", tasks, processes=processes)
    print(f"  seeded audit_auditentry: {written:,} sealed (MACs in {processes} processes, COPY) "
          f"{time.perf_counter() - started:6.1f} s", flush=True)
    started = time.perf_counter()
    with psycopg.connect(f"{PG}/{DB_NAME}", autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE")
    print(f"  VACUUM ANALYZE {time.perf_counter() - started:6.1f} s", flush=True)


def entries_of(lo: int, hi: int, n: int) -> list:
    """The entries of refunds lo..hi (one each, its decision), then the sealer's verdicts.chained entry
    for their verdicts (verdict i is refund i's; the SQL marked them with this batch's uid)."""
    from bench.fast_chain import COVER, cover_entry

    span = END - START - timedelta(seconds=1)
    entries = []
    for i in range(lo, hi + 1):
        refund = "rf_" + hashlib.md5(f"r{i}".encode()).hexdigest()[:24]
        entries.append((uuid.UUID(hashlib.md5(f"e{i}".encode()).hexdigest()), START + span * (i / n),
                        "agent:support-bot", "refund.approved" if i % 20 else "refund.denied", "refund", refund,
                        {"amount_minor": 500 + i % 500, "currency": "USD"}, []))
    verdicts = ["vd_" + hashlib.md5(f"v{i}".encode()).hexdigest()[:24] for i in range(lo, hi + 1)]
    entries.append(cover_entry((lo - 1) // COVER, verdicts))
    return entries


def floor(n: int) -> None:
    """The same rows, streamed once each into CSV in a deflated ZIP: what reading them costs at least."""
    queries = {
        "verdicts": "SELECT * FROM audit_verdict WHERE created_at >= %s AND created_at < %s ORDER BY created_at, id",
        "refunds": "SELECT * FROM refundops_refund WHERE created_at >= %s AND created_at < %s ORDER BY created_at, id",
        "attempts": "SELECT * FROM refundops_gatewayattempt WHERE started_at >= %s AND started_at < %s "
                    "ORDER BY started_at, id",
        "audit": "SELECT * FROM audit_auditentry WHERE created_at >= %s AND created_at < %s ORDER BY seq",
    }
    rows = 0
    with psycopg.connect(f"{PG}/{DB_NAME}") as conn, zipfile.ZipFile(
            "/tmp/bench_evidence_floor.zip", "w", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, sql in queries.items():
            with archive.open(f"{name}.csv", "w", force_zip64=True) as member, conn.cursor(name=name) as cursor:
                text = io.TextIOWrapper(member, encoding="utf-8", newline="")
                writer = csv.writer(text)
                cursor.itersize = 2_000
                cursor.execute(sql, (START, END))
                for row in cursor:
                    writer.writerow(row)
                    rows += 1
                text.flush()
                text.detach()
    print(f"rows {rows}")


def pack(n: int) -> None:
    _django()
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from audit.evidence import CONTROLS, build_pack

    from tqdm import tqdm

    # One tick per control (and the chain's segment, and summary.pdf); tqdm's clock says where time goes.
    bar = tqdm(total=len(CONTROLS) + 2, unit="step", file=sys.stderr, mininterval=0, ncols=100,
               bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} [{elapsed}] {postfix}")
    seen: list[str] = []

    def progress(title: str) -> None:
        if seen:
            bar.update(1)
        seen.append(title)
        bar.set_postfix_str(title, refresh=True)

    result = build_pack(start=START, end=END, out="/tmp/bench_evidence_pack.zip",
                        signing_key=Ed25519PrivateKey.generate(), progress=progress)
    bar.update(1)
    bar.close()
    rows = sum(c.rows for c in result.controls)
    print(f"rows {rows}")
    print("exceptions " + json.dumps({c.slug: c.exception_count for c in result.controls if c.exception_count}))


def measured(phase: str, n: int) -> tuple[float, float, str]:
    """Run one phase in a fresh process; its wall time, its own peak RSS (MiB), and what it printed."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, __file__, "--phase", phase, "--refunds", str(n)], stdout=subprocess.PIPE,
                          text=True, check=True)
    wall = time.perf_counter() - started
    peak = float(done.stdout.rsplit("peak_kib ", 1)[1].split()[0]) / 1024
    return wall, peak, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--refunds", type=int, default=200_000)
    parser.add_argument("--reuse", action="store_true", help="build on the database already seeded")
    parser.add_argument("--seed-only", action="store_true", help="seed the database, measure nothing")
    parser.add_argument("--seed-processes", type=int, default=2, help="processes computing the chain's MACs")
    parser.add_argument("--phase", choices=("floor", "pack"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        (floor if args.phase == "floor" else pack)(args.refunds)
        # VmHWM, not getrusage's ru_maxrss: Linux carries that one across exec from the parent.
        hwm = next(line for line in Path("/proc/self/status").read_text().splitlines() if line.startswith("VmHWM"))
        print(f"peak_kib {hwm.split()[1]}")
        return
    if not args.reuse:
        started = time.perf_counter()
        seed(args.refunds, args.seed_processes)
        print(f"seeded {args.refunds:,} refunds in the quarter in {time.perf_counter() - started:.0f} s "
              f"(load {os.getloadavg()[0]:.1f})", flush=True)
    if args.seed_only:
        return
    floor_s, floor_mib, floor_out = measured("floor", args.refunds)
    pack_s, pack_mib, pack_out = measured("pack", args.refunds)
    print(pack_out.strip())
    size = Path("/tmp/bench_evidence_pack.zip").stat().st_size / 2**20
    print(f"{'quarter of ' + format(args.refunds, ',') + ' refunds':<36} {'wall s':>8} {'peak MiB':>9}")
    print(f"{'floor: one streaming read to CSV/ZIP':<36} {floor_s:8.1f} {floor_mib:9.0f}   "
          f"({floor_out.split('rows ')[1].split()[0]} rows)")
    print(f"{'evidence pack (every check)':<36} {pack_s:8.1f} {pack_mib:9.0f}   ({size:.0f} MiB ZIP; "
          f"{pack_s / floor_s:.1f}x the floor)")


if __name__ == "__main__":
    main()
