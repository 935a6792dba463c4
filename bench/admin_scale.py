"""Benchmark: finance's and auditors' admin pages when the tables are large (issue 31, section 2).

    .venv/bin/python bench/admin_scale.py [--refunds 1000000] [--runs 5] [--reuse]

Recreates the database ``refundops_bench_admin`` (PostgreSQL on 127.0.0.1), migrates it and seeds
it with set-based SQL (``INSERT … SELECT … FROM generate_series``), spread over the last year, in
the proportions of the database measured in issue 31: per refund one payment, 1.06 verdicts, 3.9
refund history rows, 2.9 audit entries, 1.9 agent reads and an idempotency record; a customer for
every ten payments. The tables' indexes and keys are set aside while the rows go in and built once
after (``indexes_set_aside``): a million refunds seed in a few minutes.
``--reuse`` keeps an already seeded database (same size) and only times the pages.

Then it opens each page as the demo roles would (a finance approver, an auditor) through Django's
test client, in this process: the median of ``--runs`` warm runs after one cold one, and of this
process's CPU in the warm runs, beside a floor (the admin index, timed the same way in the same
run). ``--queries`` also prints each page's slowest statements, to EXPLAIN ANALYZE. A million refunds takes several minutes to
seed and about 6 GB; the machine is shared, so read the figures beside their floor.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import psycopg

ROOT = Path(__file__).resolve().parent.parent
DB_NAME = "refundops_bench_admin"
PG = "postgres://postgres@127.0.0.1:5432"

# One statement per table, each a set: :n is the number of refunds (and payments), ids are
# deterministic (md5 of the row number), so the pages below can search for a known row.
SEED = [
    """INSERT INTO refundops_customer (id, name, email, address, created_at, merchant_id)
       SELECT 'cus_' || substr(md5('c' || i), 1, 24), 'Customer ' || i, 'customer' || i || '@example.com', '',
              now() - interval '400 days', 'mer_default'
       FROM generate_series(1, greatest(%(n)s / 10, 1)) i""",
    """INSERT INTO refundops_payment (id, processor, processor_account, processor_reference,
              authorization_reference, status, currency, amount_authorized_minor, amount_captured_minor,
              amount_refunded_minor, amount_reserved_minor, method_type, method_brand, method_last4,
              order_reference, order_amount_minor, amount_owed_minor, dispute_status, dispute_reference,
              fraud_flags, paid_twice, captured_at, created_at, customer_id, merchant_id)
       SELECT 'txn_' || substr(md5('p' || i), 1, 24), 'sandbox', '', 'ch_' || substr(md5('pr' || i), 1, 20), '',
              'captured', CASE WHEN i %% 5 = 0 THEN 'EUR' ELSE 'USD' END, 1000 + i %% 90000, 1000 + i %% 90000,
              CASE WHEN i %% 10 < 7 THEN 500 + i %% 500 ELSE 0 END, 0, 'card', 'visa', lpad((i %% 10000)::text, 4, '0'),
              'order-' || i, NULL, 0, 'none', '', '[]', false, t, t,
              'cus_' || substr(md5('c' || (1 + i %% greatest(%(n)s / 10, 1))), 1, 24), 'mer_default'
       FROM (SELECT i, now() - (i::float / %(n)s) * interval '365 days' - interval '1 hour' AS t
             FROM generate_series(1, %(n)s) i) s""",
    """INSERT INTO audit_verdict (id, created_at, operation, dry_run, deduplicated, outcome, code, message,
              agent_id, agent_name, key_prefix, staff_username, idempotency_key, payment_id, refund_id,
              amount_minor, currency, request, checks, totals, hold_reasons, policy_version, gateway_response,
              policy_input, shadow)
       SELECT 'vd_' || substr(md5('v' || i), 1, 24), now() - (i::float / %(n)s) * interval '365 days',
              'refund.create', false, false,
              CASE WHEN i %% 20 = 0 THEN 'denied' WHEN i %% 20 = 1 THEN 'held' ELSE 'approved' END,
              CASE WHEN i %% 20 = 0 THEN 'limit_exceeded' ELSE '' END, '',
              'agt_bench', 'support-bot', 'rk_bench', '', 'idem-' || i,
              'txn_' || substr(md5('p' || (1 + (i - 1) %% %(n)s)), 1, 24),
              CASE WHEN i <= %(n)s THEN 'rf_' || substr(md5('r' || i), 1, 24) ELSE '' END,
              500 + i %% 500, 'USD', '{}',
              '[{"name": "amount", "result": "pass"}, {"name": "reason", "result": "pass"}]', '{}', '[]', 'v1',
              '{}', '{}', '{}'
       FROM generate_series(1, (%(n)s * 106) / 100) i""",
    """INSERT INTO refundops_refund (id, amount_minor, currency, reason, note, status, origin, agent_session_id,
              agent_model, agent_reasoning, conversation_context, idempotency_key, hold_reasons,
              processor_refund_id, failure_code, failure_message, submit_attempts, created_at, updated_at,
              submitted_at, settled_at, agent_id, payment_id, verdict_id, counted_at, synced_at)
       SELECT 'rf_' || substr(md5('r' || i), 1, 24), 500 + i %% 500, 'USD', 'customer_request', '',
              CASE WHEN i %% 20 = 0 THEN 'denied' WHEN i %% 20 = 1 AND i < %(n)s / 100 THEN 'held'
                   WHEN i %% 20 = 1 THEN 'expired' WHEN i %% 50 = 2 THEN 'failed' ELSE 'settled' END,
              'agent', 'sess-' || (i / 3), 'bench-model', 'the customer asked', '', 'idem-' || i,
              CASE WHEN i %% 20 = 1 THEN '["amount_above_threshold"]' ELSE '[]' END::jsonb,
              're_' || substr(md5('pr' || i), 1, 20), '', '', 1, t, t, t, t, NULL,
              'txn_' || substr(md5('p' || i), 1, 24), 'vd_' || substr(md5('v' || i), 1, 24), t, t
       FROM (SELECT i, now() - (i::float / %(n)s) * interval '365 days' AS t FROM generate_series(1, %(n)s) i) s""",
    """INSERT INTO refundops_historicalrefund (id, amount_minor, currency, reason, note, status, origin,
              agent_session_id, agent_model, agent_reasoning, conversation_context, idempotency_key, hold_reasons,
              processor_refund_id, failure_code, failure_message, submit_attempts, created_at, updated_at,
              history_date, history_change_reason, history_type, agent_id, payment_id, verdict_id,
              counted_at)
       SELECT r.id, r.amount_minor, r.currency, r.reason, '', s.status, r.origin, r.agent_session_id, '', '', '',
              r.idempotency_key, r.hold_reasons, '', '', '', 0, r.created_at, r.created_at,
              r.created_at + s.k * interval '1 minute', 'bench', CASE WHEN s.k = 0 THEN '+' ELSE '~' END,
              r.agent_id, r.payment_id, r.verdict_id, r.counted_at
       FROM refundops_refund r
       CROSS JOIN LATERAL (VALUES (0, 'requested'), (1, 'approved'), (2, 'submitted'), (3, r.status)) s(k, status)
       WHERE s.k < 3 OR r.status <> 'submitted'""",
    """INSERT INTO audit_auditentry (seq, created_at, actor, action, subject_type, subject_id, data, prev_hash,
              hash, uid, records, mac)
       SELECT i, now() - (1 - i::float / (%(n)s * 29 / 10)) * interval '365 days', 'agent:support-bot',
              (ARRAY['refund.requested', 'refund.approved', 'refund.settled'])[1 + i %% 3], 'refund',
              'rf_' || substr(md5('r' || (1 + i %% %(n)s)), 1, 24),
              jsonb_build_object('payment_id', 'txn_' || substr(md5('p' || (1 + i %% %(n)s)), 1, 24),
                                 'amount', 500 + i %% 500, 'currency', 'USD'),
              '', md5('h' || i), md5('u' || i)::uuid, '[]', ''
       FROM generate_series(1, %(n)s * 29 / 10) i""",
    """INSERT INTO refundops_agentread (agent_id, key_prefix, operation, payment_id, refund_id, read_at)
       SELECT 'agt_bench', 'rk_bench', 'payment.get', 'txn_' || substr(md5('p' || (1 + i %% %(n)s)), 1, 24), '',
              now() - (i::float / (%(n)s * 19 / 10)) * interval '365 days'
       FROM generate_series(1, %(n)s * 19 / 10) i""",
    # The first answer to each refund request's key (kept, never purged): one a refund.
    """INSERT INTO refundops_idempotencyrecord (scope, key, operation, request_hash, response_status, response_body,
              created_at)
       SELECT 'agt_bench', 'idem-' || i, CASE WHEN i %% 10 = 0 THEN 'payment.capture' ELSE 'refund.create' END,
              md5('q' || i) || md5('Q' || i), CASE WHEN i %% 20 = 0 THEN 422 ELSE 201 END,
              jsonb_build_object('id', 'rf_' || substr(md5('r' || i), 1, 24), 'status', 'settled'),
              now() - (i::float / %(n)s) * interval '365 days'
       FROM generate_series(1, %(n)s) i""",
]


def fresh_database(name: str) -> None:
    """A bench's database, dropped, created and migrated (Django already points at it)."""
    with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        conn.execute(f"CREATE DATABASE {name}")
    from django.core.management import call_command

    call_command("migrate", verbosity=0)


@contextmanager
def indexes_set_aside(conn: psycopg.Connection, tables: list[str]):
    """Drop the tables' indexes and key constraints (and the foreign keys into them) while a bulk load
    runs, then build each again from its own definition, read from the catalog before dropping.

    A million rows into tables whose md5-keyed indexes are maintained row by row took 170 s for the
    payments alone; one sort per index afterwards is a fraction of that. Foreign keys come back
    NOT VALID: the seed never satisfied them (no agent rows; the load ran with triggers aside), and
    they are enforced again for every row written after."""
    regclasses = [f"public.{t}" for t in tables]
    constraints = conn.execute(
        """SELECT conrelid::regclass::text, conname, contype, pg_get_constraintdef(oid) FROM pg_constraint
           WHERE contype IN ('p', 'u', 'x', 'f')
             AND (conrelid = ANY(%(t)s::regclass[]) OR confrelid = ANY(%(t)s::regclass[]))
           ORDER BY contype = 'f' DESC, conname""", {"t": regclasses}).fetchall()
    indexes = conn.execute(
        """SELECT i.indexrelid::regclass::text, pg_get_indexdef(i.indexrelid) FROM pg_index i
           WHERE i.indrelid = ANY(%(t)s::regclass[])
             AND NOT EXISTS (SELECT 1 FROM pg_constraint c WHERE c.conindid = i.indexrelid
                             AND c.contype IN ('p', 'u', 'x'))""", {"t": regclasses}).fetchall()
    for table, name, _, _ in constraints:  # foreign keys first: a key's index cannot go while one points at it
        conn.execute(f'ALTER TABLE {table} DROP CONSTRAINT "{name}"')
    for name, _ in indexes:
        conn.execute(f"DROP INDEX {name}")
    conn.commit()
    yield
    conn.execute("SET maintenance_work_mem = '1GB'")  # each index one sort in memory, not merged on disk
    started = time.perf_counter()
    for table, name, kind, definition in reversed(constraints):  # keys, then indexes, then foreign keys
        if kind != "f":
            conn.execute(f'ALTER TABLE {table} ADD CONSTRAINT "{name}" {definition}')
    for _, definition in indexes:
        conn.execute(definition)
    for table, name, kind, definition in constraints:
        if kind == "f":
            conn.execute(f'ALTER TABLE {table} ADD CONSTRAINT "{name}" {definition} NOT VALID')
    conn.commit()
    print(f"  rebuilt {len(constraints)} constraints and {len(indexes)} indexes in "
          f"{time.perf_counter() - started:.1f} s", flush=True)


def bulk_session(conn: psycopg.Connection) -> None:
    """Bench-only settings for a load: foreign keys and the audit triggers (append-only, hash chain)
    step aside while the rows go in (the pages read them, they do not verify them), and no commit
    waits for its WAL to reach the disk."""
    conn.execute("SET session_replication_role = replica")
    conn.execute("SET synchronous_commit = off")
    conn.execute("SET work_mem = '256MB'")


def seeded_tables(statements: list[str]) -> list[str]:
    return [sql.split()[2] for sql in statements]


def seed(n: int) -> None:
    fresh_database(DB_NAME)
    with psycopg.connect(f"{PG}/{DB_NAME}") as conn:
        bulk_session(conn)
        with indexes_set_aside(conn, seeded_tables(SEED)):
            for sql in SEED:
                started = time.perf_counter()
                table = sql.split()[2]
                conn.execute(sql, {"n": n})
                conn.commit()
                print(f"  seeded {table:<28} {time.perf_counter() - started:6.1f} s", flush=True)
        conn.execute("SELECT setval(pg_get_serial_sequence('audit_auditentry', 'id'), "
                     "(SELECT max(id) FROM audit_auditentry))")
    started = time.perf_counter()
    with psycopg.connect(f"{PG}/{DB_NAME}", autocommit=True) as conn:
        conn.execute("SET maintenance_work_mem = '1GB'")
        conn.execute("VACUUM ANALYZE")
    print(f"  vacuumed and analyzed in {time.perf_counter() - started:.1f} s", flush=True)


def pages(n: int) -> list[tuple[str, str, str]]:
    """(role, what, url): the rows of issue 31's table that are admin pages."""
    from urllib.parse import urlencode

    from django.urls import reverse
    from django.utils import timezone

    mid = n // 2
    month_ago = (timezone.now() - datetime.timedelta(days=30)).isoformat()
    import hashlib

    def hexid(prefix: str, salt: str, i: int, size: int = 24) -> str:
        return f"{prefix}_{hashlib.md5(f'{salt}{i}'.encode()).hexdigest()[:size]}"

    refunds = reverse("admin:refundops_refund_changelist")
    audit = reverse("admin:audit_auditentry_changelist")
    verdicts = reverse("admin:audit_verdict_changelist")
    payment = hexid("txn", "p", mid)
    customer_n = 1 + mid % max(n // 10, 1)
    refund = hexid("rf", "r", mid)
    return [
        ("finance", "refunds searched by customer email", f"{refunds}?q=customer{customer_n}@example.com"),
        ("finance", "refunds searched by payment id", f"{refunds}?q={payment}"),
        ("finance", "refunds searched by customer id", f"{refunds}?q={hexid('cus', 'c', customer_n)}"),
        ("auditor", "audit log searched by payment id", f"{audit}?q={payment}"),
        ("auditor", "audit log list", audit),
        ("auditor", "audit log filtered by action", f"{audit}?action=refund.settled"),
        ("auditor", "verdict list", verdicts),
        ("auditor", "verdicts denied", f"{verdicts}?outcome__exact=denied"),
        ("finance", "finance dashboard", reverse("admin:refundops_dashboard")),
        ("finance", "payments list", reverse("admin:refundops_payment_changelist")),
        ("finance", "refunds page 500", f"{refunds}?p=500"),
        ("finance", "refunds unfiltered", refunds),
        ("finance", "refunds sorted by amount", f"{refunds}?o=2"),
        ("finance", "held queue", reverse("admin:refundops_refund_held")),
        ("finance", "a refund's page", reverse("admin:refundops_refund_change", args=[refund])),
        ("auditor", "idempotency records", reverse("admin:refundops_idempotencyrecord_changelist")),
        ("auditor", "idempotency records searched by key",
         f"{reverse('admin:refundops_idempotencyrecord_changelist')}?q=idem-{mid}"),
        ("auditor", "CSV export of a month: first byte",
         f"{reverse('admin:refundops_refund_export_csv')}?{urlencode({'created_at__gte': month_ago})}"),
    ]


def slowest_queries(client, url: str, top: int = 3) -> list[tuple[float, str]]:
    """The page's slowest statements (seconds, SQL), warm: where to point EXPLAIN ANALYZE."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext

    with CaptureQueriesContext(connection) as captured:
        client.get(url)
    timed = sorted(((float(q["time"]), q["sql"]) for q in captured.captured_queries), reverse=True)
    return timed[:top]


def time_page(client, url: str, runs: int) -> tuple[float, float, float, int]:
    """Cold and warm median wall time, and the warm median of this process's CPU (Django's own
    work: the database's is not in it), which the machine's load moves less than the wall time."""
    def first_byte(url: str) -> int:
        """The response, or a streamed one's first chunk (an export: its first byte, not its whole)."""
        response = client.get(url)
        if response.streaming:
            next(iter(response.streaming_content), b"")
            response.close()
        return response.status_code

    started = time.perf_counter()
    status = first_byte(url)
    cold = time.perf_counter() - started
    warm, cpu = [], []
    for _ in range(runs):
        started, started_cpu = time.perf_counter(), time.process_time()
        first_byte(url)
        warm.append(time.perf_counter() - started)
        cpu.append(time.process_time() - started_cpu)
    return cold, statistics.median(warm), statistics.median(cpu), status


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--refunds", type=int, default=1_000_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--reuse", action="store_true", help="time the pages on the database already seeded")
    parser.add_argument("--queries", action="store_true", help="also print each page's slowest statements")
    parser.add_argument("--only", default="", help="time only the pages whose name contains this")
    args = parser.parse_args()

    os.environ.update(DATABASE_URL=f"{PG}/{DB_NAME}", DJANGO_SETTINGS_MODULE="refundops.settings")
    sys.path.insert(0, str(ROOT))
    import django

    django.setup()
    logging.getLogger("refundops.request").setLevel(logging.WARNING)  # one line a request drowns the table
    if not args.reuse:
        started = time.perf_counter()
        seed(args.refunds)
        print(f"seeded {args.refunds:,} refunds in {time.perf_counter() - started:.0f} s")
    else:
        from django.core.management import call_command

        call_command("migrate", verbosity=0)  # a branch's new indexes, on the rows already there

    from django.contrib.auth.models import Group, User
    from django.test import Client

    from approvals.models import ApprovalAuthority

    clients = {}
    for role, group in (("finance", "Finance approvers"), ("auditor", "Auditors")):
        user, _ = User.objects.get_or_create(username=f"bench-{role}", defaults={"is_staff": True})
        user.groups.add(Group.objects.get(name=group))
        if role == "finance":
            ApprovalAuthority.objects.get_or_create(user=user, currency="USD",
                                                    defaults={"max_amount_minor": 100_000})
        clients[role] = Client()
        clients[role].force_login(user)

    from django.urls import reverse

    floor = {role: time_page(c, reverse("admin:index"), args.runs) for role, c in clients.items()}
    print(f"{'page (' + format(args.refunds, ',') + ' refunds)':<42} {'cold s':>8} {'warm s':>8} {'floor s':>8}"
          f" {'cpu s':>8} {'floor cpu':>9}")
    for role, what, url in pages(args.refunds):
        if args.only not in what:
            continue
        cold, warm, cpu, status = time_page(clients[role], url, args.runs)
        note = "" if status == 200 else f"  (HTTP {status})"
        print(f"{what:<42} {cold:8.3f} {warm:8.3f} {floor[role][1]:8.3f} {cpu:8.3f} {floor[role][2]:9.3f}{note}",
              flush=True)
        if args.queries:
            for seconds, sql in slowest_queries(clients[role], url):
                print(f"    {seconds:6.3f} s  {sql[:400]}", flush=True)


if __name__ == "__main__":
    main()
