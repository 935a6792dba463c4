"""Shared fixtures. Tests run on the real PostgreSQL and Redis (scripts/test sets the URLs)."""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import hypothesis
import pytest
import uvicorn
from django.conf import settings
from django.db import connection
from django.utils import timezone
from rest_framework.test import APIClient

from processors import sandbox
from processors.money import Money
from refundops.access import generate_key
from refundops.models import (
    DEFAULT_MERCHANT_ID,
    Agent,
    AgentKey,
    Capability,
    Customer,
    HoldRules,
    Merchant,
    Payment,
    RefundLimits,
)

from tests.slots import big_race_slot

pytest_plugins = ["tests.fakes.fixtures"]  # fake gateways and a real Celery worker, for any test

_seq = itertools.count(1)


# CI runs every property test and fuzzer on the same examples each time (a red CI is a finding that
# replays, never a roll of the dice); a developer's run and scripts/fuzz N draw new ones.
hypothesis.settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    hypothesis.settings.load_profile("ci")


def pytest_configure(config):
    _a_redis_prefix_per_worker()
    settings.CELERY_TASK_ALWAYS_EAGER = True
    # Merchant receivers in tests listen on 127.0.0.1; tests/test_merchant_calls.py turns this off.
    settings.MERCHANT_WEBHOOK_ALLOW_PRIVATE = True
    # No test here proves the password hasher: Django's PBKDF2 (10^6 rounds, ~0.2 s of a core)
    # ran for every user made with a password and every sign-in. Subprocesses keep the real one.
    settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]
    _flush_past_the_audit_triggers()
    config.pluginmanager.register(SlowProofsOutsideTheDatabaseFirst(), "slow-proofs-outside-the-database-first")


# The slow proofs: a size, a whole stack in subprocesses, a browser or a fuzzer's budget. Every run of
# scripts/test (and CI) runs them; `scripts/test --fast` (-m "not slow") leaves them out. Listed here
# rather than marked in each file so that the list is one place to read and keep short.
SLOW_MODULES = {
    "test_admin_browser", "test_roles_browser", "test_scripts_run", "test_chaos", "test_drain",
    "test_bench_locks", "test_bench_day_volume", "test_fuzz_http", "test_fuzz_mcp", "test_fuzz_admin",
    "test_example_agent", "test_embedded_worker", "test_bench_fast_chain",
}
SLOW_TESTS = {
    "test_csv_export.py::test_exporting_a_hundred_thousand_rows_streams_in_constant_memory",
    "test_csv_export.py::test_under_the_asgi_server_the_export_streams_too",
    "test_openapi.py::test_refund_operations_never_answer_a_server_error",
    "test_mcp_http.py::test_manage_py_mcp_refuses_to_start_without_a_live_key",
    "test_mcp_http.py::test_manage_py_mcp_serves_the_tools_of_its_key_over_stdio",
    "test_dst_windows.py::test_every_window_sums_what_the_refunds_instants_say_across_both_transitions",
    "test_operator_traps.py::test_djangos_standard_gunicorn_command_serves_from_the_repository_root",
    "test_operator_traps.py::test_a_configuration_error_is_one_line_saying_what_to_set",
    "test_readme_and_docs.py::test_the_postgresql_command_creates_its_database",
    "test_model.py::test_the_model_holds",
    "test_evidence_pack.py::test_the_packs_verify_audit_runs_in_processes_and_says_what_one_process_says",
    "test_audit_parallel.py::test_a_tampered_chain_is_named_by_several_processes_exactly_as_by_one",
    # Subprocess stacks, pooler and sender lifecycles: each has a cheaper sibling left in the fast tier
    # (test_pgbouncer's refusal, test_outbox_sender's producer, test_connection_reuse's wsgi/celery,
    # test_serving's wsgi, test_plain_worker's queues, test_logs' worker).
    "test_pgbouncer.py::test_160_refunds_from_4_threads_through_pgbouncer_in_transaction_mode_all_answer",
    "test_pgbouncer.py::test_prepared_statements_are_on_by_default_only_where_the_pooler_is_known_to_keep_them",
    "test_outbox_sender.py::test_under_the_pool_the_sender_gives_its_connection_back_after_each_batch",
    "test_outbox_sender.py::test_a_trip_counted_by_the_sender_at_exit_sends_its_mail_before_the_process_ends",
    "test_outbox_sender.py::test_a_process_that_exits_right_after_its_commit_sends_what_its_sender_held",
    "test_outbox.py::test_a_broker_outage_at_commit_delays_the_merchant_webhooks_and_loses_none",
    "test_connection_reuse.py::test_the_pool_and_the_age_can_still_be_chosen",
    "test_connection_reuse.py::test_each_request_the_deployed_app_serves_checks_one_connection_out_of_the_pool_and_back",
    "test_connection_reuse.py::test_six_asgi_requests_each_in_a_thread_of_its_own_share_the_pools_connections",
    "test_connection_reuse.py::test_processes_that_run_each_request_in_its_own_thread_pool_their_connections",
    "test_mcp_http.py::test_mcp_calls_over_http_leave_no_database_connection_open",
    "test_production_mode.py::test_a_forged_sandbox_dispute_signed_with_the_published_secret_is_refused_in_production_mode",
    "test_plain_worker.py::test_a_plain_worker_settles_a_refund",
    "test_serving.py::test_what_the_server_loads_is_out_of_the_collectors_full_passes[refundops.asgi]",
    # The big races (64 threads, 64 connections): the fast tier keeps a smaller race on each invariant
    # (test_policy_concurrency on the customer's and the global totals, test_refund_concurrency's 32
    # partial refunds and 32 idempotent requests, test_scope_locks' and test_scope_lock_attacks' others).
    "test_refund_concurrency.py::test_64_agents_racing_on_one_customers_daily_amount_pass_it_by_not_one_refund",
    "test_refund_concurrency.py::test_64_agents_racing_on_the_global_daily_amount_pass_it_by_not_one_refund",
    "test_refund_concurrency.py::test_64_requests_of_one_agent_through_many_keys_pass_its_hourly_amount_by_not_one_refund",
    "test_scope_locks.py::test_the_global_daily_limit_holds_exactly_across_the_fast_path_and_the_exclusive_one",
    "test_scope_lock_attacks.py::test_every_writer_of_the_day_total_racing_on_shared_customers_and_agents_deadlocks_none_and_keeps_the_limit",
    # Random and property sequences: one seed, one property left in the fast tier.
    "test_refund_totals.py::test_random_refunds_changes_and_folds_read_alike_by_the_sql_and_the_orm[1]",
    "test_refund_totals.py::test_random_refunds_changes_and_folds_read_alike_by_the_sql_and_the_orm[2]",
    "test_refund_totals.py::test_random_refunds_changes_and_folds_read_alike_by_the_sql_and_the_orm[3]",
    "test_policy_properties.py::test_the_policy_never_lets_a_sequence_past_a_bound",
    "test_gateway_outage.py::test_every_refund_is_paid_exactly_once_after_an_outage[unreachable]",
    # Whole-app starts in a subprocess (a passing `manage.py check` loads everything): the fast tier
    # keeps the refusals and the production deploy check.
    "test_production_mode.py::test_production_mode_refuses_to_start_without_a_secret_key",
    "test_production_mode.py::test_the_deploy_check_passes_with_secure_settings[]",
    "test_admin_pages.py::test_every_admin_page_answers_for_a_superuser",
}


@pytest.hookimpl(tryfirst=True)  # before pytest-django's own order (below)
def pytest_collection_modifyitems(items):
    for item in items:
        module = item.path.stem
        if (module in SLOW_MODULES or f"{item.path.name}::{item.originalname}" in SLOW_TESTS
                or f"{item.path.name}::{item.name}" in SLOW_TESTS  # one case of a parametrized test
                or item.get_closest_marker("browser")):
            item.add_marker(pytest.mark.slow)
    # The slow proofs first (in their files' order, each file's together), the fast tests after; then
    # pytest-django sorts this list, stably, into its groups (tests in a transaction, transactional
    # tests, tests without the database), so the slow ones lead each group. Never across the groups:
    # a transactional test's flush deletes what the migrations made (hold rules v1), which the
    # tests in a transaction read (test_four_eyes failed so). pytest-xdist's worksteal hands each
    # worker a contiguous half of the list, and an idle worker takes the back half of another's
    # queue: long tests in front of their group start early rather than last in a worker's half.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


DATABASE_FIXTURES = {"db", "transactional_db", "live_server", "django_db_setup"}


def outside_the_test_database(item) -> bool:
    """pytest-django's last group, and not even a subprocess on the test database: its own
    database, SQLite, or none (the fixtures that reach the test database are all named here)."""
    from django.test import TransactionTestCase  # TestCase too: Django's classes use the database

    return (item.get_closest_marker("django_db") is None
            and not issubclass(getattr(item, "cls", None) or object, TransactionTestCase)
            and DATABASE_FIXTURES.isdisjoint(getattr(item, "fixturenames", ())))


class SlowProofsOutsideTheDatabaseFirst:
    """The harness runs (chaos 72 s, drain 31 s, the lock and volume benches) would start last, in
    pytest-django's group without the database, and be the run's tail while the other workers
    idle. They touch no test database, so their place is free: they lead the whole run."""

    @pytest.hookimpl(trylast=True)  # after pytest-django's groups
    def pytest_collection_modifyitems(self, items):
        items.sort(key=lambda item: not (item.get_closest_marker("slow") and outside_the_test_database(item)))


DESELECTED = pytest.StashKey[set]()


def pytest_deselected(items):
    """What a -m or -k left out of this run, by node id: collected all the same (test_suite_hygiene)."""
    if items:
        config = items[0].config
        config.stash.setdefault(DESELECTED, set()).update(item.nodeid for item in items)


def _a_redis_prefix_per_worker() -> None:
    """Under pytest-xdist (scripts/test runs workers) each worker process has a test database of its
    own (pytest-django names it ``…_gw0``, ``…_gw1``) and here a Redis key prefix of its own, under
    the run's: one worker's clean-up (``_clean_redis``), rate-limit windows, breakers and Celery
    queues never touch another's. Subprocesses a test starts inherit it with the environment."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if not worker:
        return
    prefix = f"{settings.REDIS_KEY_PREFIX}{worker}:"
    settings.REDIS_KEY_PREFIX = os.environ["REDIS_KEY_PREFIX"] = prefix
    options = getattr(settings, "CELERY_BROKER_TRANSPORT_OPTIONS", {})
    if "global_keyprefix" in options:  # the same dict Celery's configuration reads: its queues too
        options["global_keyprefix"] = prefix


# A table this large after a transactional test is truncated: deleting its rows one by one would cost
# more, and leave as many dead rows for the next tests to scan until autovacuum comes by.
_TRUNCATE_FROM_BYTES = 8 * 1024 * 1024

_DELETE_OR_TRUNCATE = """DO $flush$ DECLARE t text; big text[] := '{}'; BEGIN
  FOREACH t IN ARRAY %s::text[] LOOP
    IF pg_relation_size(quote_ident(t)::regclass) > %s THEN big := big || t;
    ELSE EXECUTE format('DELETE FROM %%I', t);
    END IF;
  END LOOP;
  IF cardinality(big) > 0 THEN
    EXECUTE 'TRUNCATE ' || (SELECT string_agg(format('%%I', b), ', ') FROM unnest(big) b) || ' CASCADE';
  END IF;
END $flush$"""


def _flush_past_the_audit_triggers() -> None:
    """Transactional tests empty every table after each test, but PostgreSQL refuses TRUNCATE on the
    audit log (audit/migrations/0002): the test run empties it as a superuser may, triggers off.

    Triggers off (session_replication_role = replica), no foreign key is checked either, so each
    table is emptied by a DELETE in any order, in one statement: TRUNCATE of the ~60 tables made a
    new file for each table and index, ~0.6-0.9 s per transactional test on this machine, where
    the DELETEs of a test's few rows take a few milliseconds. The tables end as empty either way,
    and neither resets a sequence (a flush that asks to, or to cascade, still truncates)."""
    from django.db.backends.postgresql.operations import DatabaseOperations

    truncate = DatabaseOperations.sql_flush
    flush = DatabaseOperations.execute_sql_flush

    def sql_flush(self, style, tables, *, reset_sequences=False, allow_cascade=False):
        if reset_sequences or allow_cascade or not tables:
            return truncate(self, style, tables, reset_sequences=reset_sequences, allow_cascade=allow_cascade)
        return [self.compose_sql(_DELETE_OR_TRUNCATE, [list(tables), _TRUNCATE_FROM_BYTES])]

    def execute_sql_flush(self, sql_list):
        from django.db import transaction

        # One transaction, triggers off for it only (SET LOCAL): behind PgBouncer in transaction mode
        # (scripts/test --pgbouncer) the next transaction may run on another server session.
        with transaction.atomic(using=self.connection.alias):
            with self.connection.cursor() as cursor:
                cursor.execute("SET LOCAL session_replication_role = replica")
            flush(self, sql_list)

    DatabaseOperations.sql_flush = sql_flush
    DatabaseOperations.execute_sql_flush = execute_sql_flush


@pytest.fixture(scope="session")
def django_db_modify_db_settings(django_db_modify_db_settings_parallel_suffix, django_db_use_migrations):
    """Each test database (one per xdist worker) is a copy of a migrated template, made by the first
    worker that needs it and kept for later runs while no migration file changes; each copy is still
    migrated (nothing to apply then) and post_migrate still runs (roles synced from the code). Under
    load ``migrate`` takes 8-10 s of a core: once, rather than once per worker and run."""
    db = settings.DATABASES["default"]
    if django_db_use_migrations and db["ENGINE"] == "django.db.backends.postgresql":
        db.setdefault("TEST", {})["TEMPLATE"] = _migrated_template(db)


def _migrated_template(db: dict) -> str:
    import hashlib
    import subprocess
    import sys
    from pathlib import Path
    from urllib.parse import quote

    import psycopg
    from django.apps import apps

    digest = hashlib.sha1()
    for path in sorted(p for app in apps.get_app_configs() for p in Path(app.path, "migrations").glob("*.py")):
        digest.update(str(path).encode() + path.read_bytes())
    prefix = f"test_{db['NAME']}"[:36] + "_tpl_"
    template = prefix + digest.hexdigest()[:16]
    server = {"host": db["HOST"] or "127.0.0.1", "port": db["PORT"] or 5432, "user": db["USER"],
              "password": db["PASSWORD"] or None}
    with psycopg.connect(dbname="postgres", autocommit=True, **server) as admin:
        # The first worker builds it; the others wait here, then copy it.
        admin.execute("SELECT pg_advisory_lock(hashtext(%s))", [prefix])
        if admin.execute("SELECT 1 FROM pg_database WHERE datname = %s", [template]).fetchone():
            return template
        for (old,) in admin.execute("SELECT datname FROM pg_database WHERE datname LIKE %s",
                                    [prefix.replace("_", r"\_") + "%"]).fetchall():
            admin.execute(f'DROP DATABASE "{old}" WITH (FORCE)')  # of migrations since changed
        building = f"{template}_new"
        admin.execute(f'CREATE DATABASE "{building}"')
        url = (f"postgres://{quote(db['USER'] or '')}:{quote(db['PASSWORD'] or '')}@{server['host']}:{server['port']}"
               f"/{building}")
        subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], check=True,
                       cwd=Path(__file__).resolve().parent.parent, env={**os.environ, "DATABASE_URL": url})
        admin.execute(f'ALTER DATABASE "{building}" RENAME TO "{template}"')  # whole, or not at all
    return template


@pytest.fixture(scope="session")
def django_db_setup(django_db_setup, django_db_blocker):
    """``scripts/test --pgbouncer`` (TEST_PGBOUNCER=1): once the test database is made (straight to
    PostgreSQL), every connection reaches it through a PgBouncer in transaction mode that this starts
    (tests/pgbouncer.py), as a deployment behind one does (DATABASE_POOLER=pgbouncer-transaction)."""
    if not os.environ.get("TEST_PGBOUNCER"):
        yield
        return
    from django.db import connections

    from tests.pgbouncer import pgbouncer

    db = settings.DATABASES["default"]
    direct = {key: db[key] for key in ("HOST", "PORT")}
    with pgbouncer(host=db["HOST"] or "127.0.0.1", port=int(db["PORT"] or 5432), user=db["USER"] or "postgres",
                   pool_size=int(os.environ.get("TEST_PGBOUNCER_POOL_SIZE", "4"))) as port:
        for handle in [db, *(c.settings_dict for c in connections.all())]:
            handle.update(HOST="127.0.0.1", PORT=str(port))
        connections.close_all()
        try:
            yield
        finally:
            connections.close_all()
            for handle in [db, *(c.settings_dict for c in connections.all())]:
                handle.update(direct)


@pytest.fixture(autouse=True)
def _real_services(request):
    """Refuse to pass on SQLite: row locks and constraints are what the tests prove."""
    if "django_db_setup" in request.fixturenames or request.node.get_closest_marker("django_db"):
        assert connection.vendor == "postgresql", "set DATABASE_URL to PostgreSQL (scripts/test does)"


@pytest.fixture(autouse=True)
def _default_merchant(request):
    """The migration makes the default merchant; a transactional test's flush deletes it again."""
    if "django_db_setup" in request.fixturenames or request.node.get_closest_marker("django_db"):
        request.getfixturevalue("_django_db_helper")
        Merchant.objects.get_or_create(pk=DEFAULT_MERCHANT_ID, defaults={"name": "Default merchant"})


@pytest.fixture(autouse=True)
def _outbox_sender_stopped(request):
    """A test that publishes for real (not eagerly) hands its commits to the outbox's sender thread:
    what is waiting is sent before the test's database is emptied, and the thread ends with its
    connection (the next test's nudge starts another; the test database is dropped at the end)."""
    if "django_db_setup" in request.fixturenames or request.node.get_closest_marker("django_db"):
        request.getfixturevalue("_django_db_helper")  # so this is torn down before the database is
    yield
    from refundops import outbox

    outbox.stop_sender(timeout=30)


@pytest.fixture(autouse=True)
def _clean_redis():
    import redis

    if settings.REDIS_URL:  # only this run's keys (REDIS_KEY_PREFIX): other runs may share the db
        client = redis.Redis.from_url(settings.REDIS_URL)
        keys = list(client.scan_iter(match=f"{settings.REDIS_KEY_PREFIX}*", count=1000))
        if keys:
            client.delete(*keys)
    yield


@pytest.fixture
def scratch():
    """A table of the test's own, ``scratch_<random> (id, n int >= 0, t text)``, for statements the
    platform does not make (batching, prepared statements); dropped after. Its name is the test's
    own: a statement text one test has run often enough for psycopg to prepare it on the worker's
    connection is then never another test's, which would see it prepared where it counts statements."""
    name = f"scratch_{uuid.uuid4().hex[:8]}"
    with connection.cursor() as cursor:
        cursor.execute(f"CREATE TABLE {name} (id serial PRIMARY KEY, n int NOT NULL CHECK (n >= 0), t text)")
    yield name
    with connection.cursor() as cursor:
        cursor.execute(f"DROP TABLE {name}")


@pytest.fixture
def quiet_breaker(settings):
    """For tests about totals: a burst of this size is the breaker's business elsewhere."""
    settings.BREAKER_MIN_COUNT = 10**6
    settings.BREAKER_MIN_VALUE = 10**9


def race(n: int, work: Callable[[int], Any]) -> list[Any]:
    """Run ``work(i)`` in ``n`` threads released together by a barrier; each closes its own
    database connection. Returns the results; fails on the first exception a thread raised."""
    with big_race_slot(n):
        return _race(n, work)


def _race(n: int, work: Callable[[int], Any]) -> list[Any]:
    barrier = threading.Barrier(n)
    results: list[Any] = [None] * n

    def run(i: int) -> None:
        try:
            barrier.wait()
            results[i] = work(i)
        except BaseException as exc:  # reported by the main thread below
            results[i] = exc
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    errors = [r for r in results if isinstance(r, BaseException)]
    assert not errors, errors[0]
    return results


def wait_until_another_connection_waits_for_a_lock(timeout: float = 10.0) -> None:
    """From inside a transaction holding a lock: return once another connection to this database is
    waiting on a lock (a row, an advisory key), so the interleaving a test means is the one that ran."""
    deadline = time.monotonic() + timeout
    with connection.cursor() as cursor:
        while time.monotonic() < deadline:
            cursor.execute("SELECT pg_stat_clear_snapshot()")  # else the transaction sees its first reading
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                           "AND pid <> pg_backend_pid() AND wait_event_type = 'Lock'")
            if cursor.fetchone()[0]:
                return
            time.sleep(0.01)
    raise AssertionError("no other connection came to wait for the lock")


def make_customer(**fields) -> Customer:
    n = next(_seq)
    return Customer.objects.create(**{"name": f"Customer {n}", "email": f"c{n}@example.com", **fields})


def make_payment(*, amount: int = 10_000, currency: str = "USD", captured: bool = True, customer=None,
                 captured_days_ago: float = 1, **fields) -> Payment:
    reference = sandbox.open_charge(amount=Money(amount, currency), captured=captured)
    return Payment.objects.create(**{
        "customer": customer or make_customer(), "processor": "sandbox", "processor_reference": reference,
        "currency": currency, "amount_authorized_minor": amount,
        "amount_captured_minor": amount if captured else 0,
        "status": Payment.Status.CAPTURED if captured else Payment.Status.AUTHORIZED,
        "method_type": "card", "method_brand": "visa", "method_last4": "4242",
        "captured_at": timezone.now() - timedelta(days=captured_days_ago) if captured else None,
        **fields})


def make_limits(currency: str = "USD", **fields) -> RefundLimits:
    version = (RefundLimits.objects.filter(currency=currency).order_by("-version")
               .values_list("version", flat=True).first() or 0) + 1
    defaults = dict(approval_threshold_minor=50_000, allowed_reasons=["customer_request", "duplicate",
                                                                       "fraudulent", "product_issue"],
                    refund_window_days=90, max_refunds_per_payment=100, customer_daily_count=1_000,
                    customer_daily_amount_minor=10**12, customer_30d_count=10_000,
                    customer_30d_amount_minor=10**12, agent_hourly_amount_minor=10**12,
                    agent_daily_amount_minor=10**12, session_amount_minor=10**12,
                    global_daily_amount_minor=10**12)
    return RefundLimits.objects.create(currency=currency, version=version, **{**defaults, **fields})


def make_rules(**fields) -> HoldRules:
    version = (HoldRules.objects.order_by("-version").values_list("version", flat=True).first() or 0) + 1
    return HoldRules.objects.create(version=version, **{"velocity_max_refunds": 1_000, **fields})


def make_staff(username: str, *, authority_minor: int = 10**12, currencies=("USD", "EUR")):
    """A staff member who may refund alone up to ``authority_minor`` (above it, someone else decides)."""
    from django.contrib.auth import get_user_model

    from approvals.models import ApprovalAuthority

    user = get_user_model().objects.create_user(username, is_staff=True)
    for currency in currencies:
        ApprovalAuthority.objects.create(user=user, currency=currency, max_amount_minor=authority_minor)
    return user


def make_agent_key(*capabilities: str, name: str | None = None,
                   merchant: Merchant | None = None) -> tuple[AgentKey, str]:
    agent = Agent.objects.create(name=name or f"agent-{uuid.uuid4().hex[:8]}",
                                 capabilities=list(capabilities or Capability.values),
                                 merchant_id=merchant.pk if merchant else DEFAULT_MERCHANT_ID)
    raw, prefix, digest = generate_key()
    return AgentKey.objects.create(agent=agent, prefix=prefix, key_hash=digest), raw


@pytest.fixture
def limits(db):
    return make_limits()


@pytest.fixture
def rules(db):
    return make_rules()


@pytest.fixture
def policy(limits, rules):
    """Generous USD limits and every hold rule on, so a test tightens only what it proves."""
    return limits, rules


@pytest.fixture
def agent_key(db):
    return make_agent_key()


@pytest.fixture
def api(agent_key):
    """An API client that speaks as an agent holding every capability."""
    key, raw = agent_key
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Bearer {raw}")
    client.key = key
    return client


def post(client: APIClient, path: str, body, *, key: str | None = None):
    return client.post(path, body, format="json", HTTP_IDEMPOTENCY_KEY=key or uuid.uuid4().hex)


@pytest.fixture(scope="session")
def served(django_db_setup) -> Iterator[str]:
    """``uvicorn refundops.asgi:application`` in a thread, on a free port of 127.0.0.1: one per run,
    since the MCP session manager in the app's lifespan starts once per process."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config("refundops.asgi:application", lifespan="on", log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(timeout=10)
    sock.close()
    # Django's requests ran on threads the app's handler keeps, each with its own connection (no pool
    # in a test process): close them, or the test database cannot be dropped after the run.
    _close_served_threads_connections()


def _close_served_threads_connections() -> None:
    import refundops.asgi
    from django.db import connections

    for executor in refundops.asgi.django_app.threads.idle:
        executor.submit(connections.close_all).result(timeout=10)


@pytest.fixture(autouse=True)
def _served_threads_let_go(request):
    """Also after each test that used ``served``: the connections its requests left on the handler's
    kept threads are closed, so the next test, whichever a worker runs next, starts without them
    (tests/test_mcp_http.py counts the test database's connections after its own calls)."""
    yield
    if "served" in request.fixturenames:
        _close_served_threads_connections()
