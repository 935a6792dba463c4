"""The day's totals kept as refunds change (refundops/models/totals.py, migration 0016): a trigger
appends signed rows per currency and agent, a fold sums them; the running totals read the day's
buckets instead of the day's refunds (issue 11, bench/day_volume.py)."""

from __future__ import annotations

import importlib
import io
import json
import random
import threading
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from django.db import connection, transaction
from django.utils import timezone

from refundops.models import COUNTING_STATES, Refund, RefundState, RefundTotalDelta
from refundops.selectors import first_bucket_from, running_totals, start_of_day
from refundops.services.totals import fold_totals
from tests.conftest import make_agent_key, make_payment, race, wait_until_another_connection_waits_for_a_lock

BUCKETS = "SELECT currency, agent_id, SUM(amount_minor) FROM refundops_refundtotaldelta GROUP BY 1, 2 HAVING SUM(amount_minor) <> 0 ORDER BY 1, 2"
SCANNED = """
SELECT currency, scope, SUM(amount_minor) FROM refundops_refund, unnest(ARRAY['', agent_id]) scope
 WHERE status = ANY(%s) AND scope IS NOT NULL GROUP BY 1, 2 HAVING SUM(amount_minor) <> 0 ORDER BY 1, 2"""


def kept_and_scanned() -> tuple[list, list]:
    with connection.cursor() as cursor:
        cursor.execute(BUCKETS)
        kept = cursor.fetchall()
        cursor.execute(SCANNED, [[str(s) for s in COUNTING_STATES]])
        return kept, cursor.fetchall()


def rows_read(cursor, table: str) -> int:
    cursor.execute(f"SELECT pg_stat_get_xact_tuples_returned('{table}'::regclass)"
                   f" + pg_stat_get_xact_tuples_fetched('{table}'::regclass)")
    return cursor.fetchone()[0]


def test_the_trigger_counts_the_states_the_code_counts(db):
    """The trigger's states are spelled in migration 0016; a change of COUNTING_STATES needs a
    migration that replaces the function."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT prosrc FROM pg_proc WHERE proname = 'refundops_refund_totals'")
        source = cursor.fetchone()[0]
    spelled = source.split("counting CONSTANT text[] := '{", 1)[1].split("}'", 1)[0].split(",")
    assert sorted(spelled) == sorted(str(s) for s in COUNTING_STATES)


def test_every_kind_of_change_keeps_the_totals_equal_to_the_refunds(db):
    key, _ = make_agent_key()
    other, _ = make_agent_key()
    usd, eur = make_payment(amount=10**7), make_payment(amount=10**7, currency="EUR")
    refunds = [Refund.objects.create(payment=p, amount_minor=100 + i, currency=p.currency, reason="duplicate",
                                     agent=a, status=RefundState.APPROVED)
               for i, (p, a) in enumerate([(usd, key.agent), (usd, None), (eur, key.agent), (usd, other.agent)])]
    assert kept_and_scanned()[0] == kept_and_scanned()[1] != []
    Refund.objects.filter(pk=refunds[0].pk).update(status=RefundState.FAILED)  # stops counting
    Refund.objects.filter(pk=refunds[1].pk).update(amount_minor=999)
    Refund.objects.filter(pk=refunds[2].pk).update(counted_at=timezone.now() - timedelta(hours=30))
    Refund.objects.filter(pk=refunds[3].pk).update(agent=key.agent)
    Refund.objects.filter(pk=refunds[0].pk).update(status=RefundState.SETTLED)  # counts again
    kept, scanned = kept_and_scanned()
    assert kept == scanned
    Refund.objects.filter(pk=refunds[1].pk).update(updated_at=timezone.now())  # counted as before: no row
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM refundops_refundtotaldelta")
        before = cursor.fetchone()[0]
        Refund.objects.filter(pk=refunds[1].pk).update(reason="other")
        cursor.execute("SELECT count(*) FROM refundops_refundtotaldelta")
        assert cursor.fetchone()[0] == before
    Refund.objects.filter(pk=refunds[3].pk).delete()
    assert fold_totals() > 0
    kept, scanned = kept_and_scanned()
    assert kept == scanned


def test_the_migration_counts_the_refunds_made_before_it(db):
    key, _ = make_agent_key()
    payment = make_payment(amount=10**7)
    for amount in (100, 250, 400):
        Refund.objects.create(payment=payment, amount_minor=amount, currency="USD", reason="duplicate",
                              agent=key.agent, status=RefundState.APPROVED)
    migration = importlib.import_module("refundops.migrations.0016_refund_totals")
    RefundTotalDelta.objects.all().delete()
    with connection.cursor() as cursor:
        cursor.execute(migration.BACKFILL)
    assert kept_and_scanned()[0] == kept_and_scanned()[1] == [("USD", "", 750), ("USD", key.agent_id, 750)]


@pytest.mark.parametrize("zone", ["UTC", "Asia/Kathmandu", "America/St_Johns", "Australia/Eucla"])
def test_the_days_first_bucket_is_its_midnight_in_every_offset_in_use(zone):
    """Every offset in use is whole quarter hours, so the day's buckets start at its midnight and no
    refund is summed from the refunds themselves; a midnight that were not would be (and exact)."""
    midnight = datetime(2026, 12, 1, tzinfo=ZoneInfo(zone))
    assert first_bucket_from(midnight) == midnight
    odd = midnight + timedelta(minutes=7, microseconds=3)
    assert first_bucket_from(odd) == midnight + timedelta(minutes=15)


def _agent_with_1500_refunds_at(counted_at: datetime):
    """An agent with one refund (100) in session "s1" on a payment of its own, and 1,500 (7 each,
    a session each) counted at ``counted_at`` on another customer's; the totals folded."""
    key, _ = make_agent_key()
    payment, elsewhere = make_payment(amount=10**7), make_payment(amount=10**7)
    Refund.objects.create(payment=payment, amount_minor=100, currency="USD", reason="duplicate",
                          agent=key.agent, agent_session_id="s1", status=RefundState.APPROVED)
    source = Refund.objects.create(payment=elsewhere, amount_minor=7, currency="USD", reason="duplicate",
                                   agent=key.agent, agent_session_id="other", status=RefundState.APPROVED,
                                   counted_at=counted_at)
    with connection.cursor() as cursor:
        cursor.execute("""
            INSERT INTO refundops_refund
            SELECT (jsonb_populate_record(r, jsonb_build_object('id', 'rf_copy' || g,
                       'agent_session_id', 'copy' || g))).*
              FROM refundops_refund r, generate_series(1, 1499) g WHERE r.id = %s""", [source.pk])
        cursor.execute("ANALYZE refundops_refund")
        fold_totals()
        cursor.execute("ANALYZE refundops_refundtotaldelta")
    return key, payment


def _totals_and_refunds_read(payment, key, now):
    with connection.cursor() as cursor:
        before = rows_read(cursor, "refundops_refund")
        totals = running_totals(payment=payment, agent_id=key.agent_id, session_id="s1", now=now)
        return totals, rows_read(cursor, "refundops_refund") - before


@pytest.mark.django_db
@pytest.mark.parametrize("in_last_hour", [False, True])
def test_the_days_and_hours_totals_read_their_buckets_not_their_refunds(policy, in_last_hour):
    """Fails before (the totals summed the refunds): with 1,500 of the agent's refunds today on
    another customer's payment, one decision read 3,000 refund rows (the currency's day and the
    agent's day), and 1,500 more when they were in the last hour. Now it reads the few of the
    session and of the last hour's first minutes (before its first quarter hour), and the folded
    buckets."""
    now = timezone.now()
    copies_at = first_bucket_from(now - timedelta(hours=1)) + timedelta(minutes=1) if in_last_hour \
        else now - timedelta(hours=2)
    key, payment = _agent_with_1500_refunds_at(copies_at)
    totals, refunds_read = _totals_and_refunds_read(payment, key, now)
    day = 100 + 7 * 1500 if start_of_day(now) <= copies_at else 100
    assert totals.global_day_minor == day and totals.agent_day_minor == day
    assert totals.agent_hour_minor == (100 + 7 * 1500 if in_last_hour else 100) and totals.session_minor == 100
    assert refunds_read < 50, f"one decision's totals read {refunds_read} refunds"
    # What the day's totals read instead: a row a quarter hour and scope, once folded (the copies
    # share one quarter hour; the refund in the session has its own, or the same).
    assert RefundTotalDelta.objects.filter(agent_id="").count() <= 2
    assert RefundTotalDelta.objects.filter(agent_id=key.agent_id).count() <= 2


@pytest.mark.django_db(transaction=True)
def test_folds_racing_writers_and_each_other_lose_and_double_nothing():
    """Four threads write, change and delete refunds while two fold again and again (one at a time:
    the other finds the lock taken and returns): at the end the
    kept totals are the refunds' (no row folded twice, none lost to a fold that did not see it)."""
    key, _ = make_agent_key()
    payments = [make_payment(amount=10**8) for _ in range(4)]
    stop, done, lock = threading.Event(), [0], threading.Lock()
    states = [RefundState.APPROVED, RefundState.FAILED, RefundState.SETTLED, RefundState.HELD]

    def work(i: int) -> int:
        if i >= 4:
            folds = 0
            while not stop.is_set():
                fold_totals()
                folds += 1
            return folds
        rng = random.Random(i)
        made = []
        for n in range(120):
            choice = rng.random()
            if not made or choice < 0.5:
                made.append(Refund.objects.create(
                    payment=payments[i], amount_minor=rng.randint(1, 500), currency="USD", reason="duplicate",
                    agent=key.agent if rng.random() < 0.7 else None, status=rng.choice(states)).pk)
            elif choice < 0.9:
                Refund.objects.filter(pk=rng.choice(made)).update(status=rng.choice(states),
                                                                  amount_minor=rng.randint(1, 500))
            else:
                Refund.objects.filter(pk=made.pop(rng.randrange(len(made)))).delete()
        with lock:
            done[0] += 1
            if done[0] == 4:  # the last writer done: the folders stop
                stop.set()
        return len(made)

    results = race(6, work)
    assert results[4] > 0 and results[5] > 0
    fold_totals()
    kept, scanned = kept_and_scanned()
    assert kept == scanned and scanned != []


# ---- review findings -------------------------------------------------------------------------------


@pytest.mark.parametrize("table", ["refundops_refund", "refundops_payment"])
def test_a_truncate_of_the_refunds_takes_their_totals_with_it(db, table):
    """TRUNCATE fires no row trigger: emptying the refunds (by hand, a reset, or a TRUNCATE of the
    payments CASCADE) left every delta behind, and the day's totals counted refunds that no longer
    exist (too high: good refunds refused) until the buckets aged out three days later."""
    key, _ = make_agent_key()
    payment = make_payment(amount=10**7)
    Refund.objects.create(payment=payment, amount_minor=400, currency="USD", reason="duplicate",
                          agent=key.agent, status=RefundState.APPROVED)
    with connection.cursor() as cursor:
        cursor.execute("SET CONSTRAINTS ALL IMMEDIATE")  # no pending FK checks: TRUNCATE may run
        cursor.execute(f"TRUNCATE {table} CASCADE")
    kept, scanned = kept_and_scanned()
    assert kept == scanned == []
    totals = running_totals(payment=payment, agent_id=key.agent_id, session_id="", now=timezone.now())
    assert totals.global_day_minor == 0 and totals.agent_day_minor == 0


def _orm_totals(payment, agent_id, now, exclude=""):
    from refundops import selectors
    return selectors._running_totals_orm({
        "exclude": exclude, "payment": payment.pk, "customer": payment.customer_id, "currency": payment.currency,
        "agent": agent_id, "session": "", "states": [str(s) for s in COUNTING_STATES],
        "day": start_of_day(now), "day_end": selectors.limit_windows(now).day_end,
        "hour": now - timedelta(hours=1), "month": now - timedelta(days=30),
        "velocity": now - timedelta(hours=24), "cumulative": now - timedelta(hours=24), "agent_origin": "agent"})


@pytest.mark.parametrize("zone, now", [
    ("Asia/Kathmandu", datetime(1900, 6, 1, 12, tzinfo=UTC)),  # LMT +5:41:16: midnight is no boundary
    ("America/St_Johns", datetime(2026, 11, 1, 15, tzinfo=UTC)),  # -2:30 -> -3:30 that day
    ("Australia/Lord_Howe", datetime(2026, 10, 4, 9, tzinfo=UTC)),  # +10:30 -> +11 that day
    ("Pacific/Chatham", datetime(2026, 12, 1, 23, 50, tzinfo=UTC)),
    ("UTC", datetime(2026, 12, 2, 0, 37, 12, 345678, tzinfo=UTC)),  # the last hour began yesterday
])
def test_the_kept_totals_agree_with_the_refunds_at_the_days_and_hours_edges_with_a_refund_excluded(db, zone, now):
    """Review: refunds either side of midnight and of the day's first bucket, of the last hour's start
    and of its first bucket, and after now, some counting, one excluded at a time (the
    resubmission's exclude_refund_id, for a refund that counts or not): the statement reading the
    buckets agrees with the ORM's sum of the refunds."""
    from django.test import override_settings

    with override_settings(TIME_ZONE=zone):
        key, _ = make_agent_key()
        payment = make_payment(amount=10**8)
        day = start_of_day(now)
        offsets = [-timedelta(minutes=1), timedelta(0), timedelta(seconds=1), timedelta(minutes=7),
                   first_bucket_from(day) - day - timedelta(microseconds=1), first_bucket_from(day) - day,
                   timedelta(minutes=15), timedelta(hours=3), now - day]
        hour = now - timedelta(hours=1)
        offsets += [edge - day + step for edge in (hour, first_bucket_from(hour))
                    for step in (-timedelta(microseconds=1), timedelta(0), timedelta(seconds=1))]
        offsets += [now - day + timedelta(minutes=20)]  # counted after now (a clock ahead): counts, as before
        made = []
        for i, offset in enumerate(offsets):
            for agent in (key.agent, None):
                status = [RefundState.APPROVED, RefundState.FAILED, RefundState.HELD][(i + bool(agent)) % 3]
                refund = Refund.objects.create(payment=payment, amount_minor=10 + i, currency="USD",
                                               reason="duplicate", agent=agent, status=status,
                                               counted_at=day + offset)
                made.append(refund.pk)
        for exclude in ["", *made]:
            for agent_id in (key.agent_id, None):
                sql = running_totals(payment=payment, agent_id=agent_id, session_id="", now=now,
                                     exclude_refund_id=exclude)
                assert sql == _orm_totals(payment, agent_id, now, exclude), (exclude, agent_id)


def test_an_empty_agent_id_reads_no_agents_day_not_the_currencys(db):
    """Review: the currency's buckets are kept under agent_id "", so running_totals(agent_id="")
    (the signature takes a str; the ORM reading and the old statement gave 0) read the whole
    currency's day as the agent's."""
    payment = make_payment(amount=10**7)
    Refund.objects.create(payment=payment, amount_minor=500, currency="USD", reason="duplicate",
                          status=RefundState.APPROVED)
    now = timezone.now()
    assert running_totals(payment=payment, agent_id="", session_id="", now=now).agent_day_minor == 0


@pytest.mark.django_db(transaction=True)
def test_a_reader_during_folds_and_writes_sees_the_refunds_sum_in_every_statement():
    """Review: not only at the end: each reading statement (one snapshot, as the decision's) sees the
    currency's and the agent's kept totals equal to the refunds' sum while writers change refunds
    and a fold runs again and again."""
    key, _ = make_agent_key()
    payments = [make_payment(amount=10**8) for _ in range(2)]
    stop, done, lock, mismatches = threading.Event(), [0], threading.Lock(), []
    states = [RefundState.APPROVED, RefundState.FAILED, RefundState.SETTLED, RefundState.HELD]
    check = """
        SELECT (SELECT COALESCE(SUM(amount_minor), 0) FROM refundops_refundtotaldelta WHERE currency = 'USD' AND agent_id = ''),
               (SELECT COALESCE(SUM(amount_minor), 0) FROM refundops_refund WHERE currency = 'USD' AND status = ANY(%(s)s)),
               (SELECT COALESCE(SUM(amount_minor), 0) FROM refundops_refundtotaldelta WHERE currency = 'USD' AND agent_id = %(a)s),
               (SELECT COALESCE(SUM(amount_minor), 0) FROM refundops_refund WHERE currency = 'USD' AND status = ANY(%(s)s)
                   AND agent_id = %(a)s)"""

    def work(i: int) -> int:
        n = 0
        if i == 2:
            while not stop.is_set():
                fold_totals()
                n += 1
            return n
        if i == 3:
            with connection.cursor() as cursor:
                while not stop.is_set():
                    cursor.execute(check, {"s": [str(s) for s in COUNTING_STATES], "a": key.agent_id})
                    row = cursor.fetchone()
                    if row[0] != row[1] or row[2] != row[3]:
                        mismatches.append(row)
                    n += 1
            return n
        rng, made = random.Random(i), []
        for _ in range(80):
            if not made or rng.random() < 0.5:
                made.append(Refund.objects.create(
                    payment=payments[i], amount_minor=rng.randint(1, 500), currency="USD", reason="duplicate",
                    agent=key.agent if rng.random() < 0.7 else None, status=rng.choice(states),
                    counted_at=timezone.now() - timedelta(minutes=rng.randint(0, 120))).pk)
            else:
                Refund.objects.filter(pk=rng.choice(made)).update(status=rng.choice(states),
                                                                  amount_minor=rng.randint(1, 500))
        with lock:
            done[0] += 1
            if done[0] == 2:
                stop.set()
        return len(made)

    results = race(4, work)
    assert results[2] > 0 and results[3] > 0
    assert mismatches == []


def test_the_buckets_of_the_database_are_the_buckets_of_the_code(db):
    """Review (a guard, holds): refundops_total_bucket (migration 0016, 900 spelled in SQL) cuts where
    BUCKET_SECONDS does: a change of one without the other would count a refund on the wrong side of
    the day's first bucket."""
    from refundops.models import BUCKET_SECONDS

    at = datetime(2026, 12, 1, 18, 15, tzinfo=UTC)
    assert first_bucket_from(at) == at
    with connection.cursor() as cursor:
        for delta, bucket in [(timedelta(0), at), (timedelta(microseconds=-1), at - timedelta(seconds=BUCKET_SECONDS)),
                              (timedelta(seconds=BUCKET_SECONDS) - timedelta(microseconds=1), at)]:
            cursor.execute("SELECT refundops_total_bucket(%s)", [at + delta])
            assert cursor.fetchone()[0] == bucket


def test_a_dump_loaded_again_counts_each_refund_once(db, tmp_path):
    """Review: ``dumpdata`` dumps the kept deltas with the refunds; ``loaddata`` inserts the refunds
    (the trigger appends their deltas) and the dumped deltas too: every refund counted twice (too
    high: good refunds refused) until a loaded delta was dropped (services/totals.py)."""
    from django.core.management import call_command

    key, _ = make_agent_key()
    payment = make_payment(amount=10**7)
    Refund.objects.create(payment=payment, amount_minor=300, currency="USD", reason="duplicate",
                          agent=key.agent, status=RefundState.APPROVED)
    dump = tmp_path / "refunds.json"
    call_command("dumpdata", "refundops.refund", "refundops.refundtotaldelta", output=str(dump), verbosity=0)
    Refund.objects.all().delete()
    RefundTotalDelta.objects.all().delete()
    call_command("loaddata", str(dump), verbosity=0)
    kept, scanned = kept_and_scanned()
    assert kept == scanned == [("USD", "", 300), ("USD", key.agent_id, 300)]


def test_a_load_that_bypassed_the_trigger_is_counted_again_by_the_rebuild_command(db):
    """A restore with triggers off leaves refunds the totals do not count (too low: a limit let
    through); ``manage.py rebuild_refund_totals`` counts the days a total reads again, the same rows
    the migration's backfill writes, and nothing older (never read, folded away)."""
    from django.core.management import call_command

    key, _ = make_agent_key()
    payment = make_payment(amount=10**7)
    Refund.objects.create(payment=payment, amount_minor=100, currency="USD", reason="duplicate",
                          agent=key.agent, status=RefundState.APPROVED)
    Refund.objects.create(payment=payment, amount_minor=9_000, currency="USD", reason="duplicate",
                          status=RefundState.SETTLED, counted_at=timezone.now() - timedelta(days=5))
    with connection.cursor() as cursor:
        cursor.execute("SET session_replication_role = replica")  # what pg_restore --disable-triggers does
        try:
            Refund.objects.create(payment=payment, amount_minor=20, currency="USD", reason="duplicate",
                                  agent=key.agent, status=RefundState.HELD)
        finally:
            cursor.execute("SET session_replication_role = origin")
    recent = ("SELECT currency, agent_id, SUM(amount_minor) FROM refundops_refundtotaldelta"
              " WHERE bucket >= now() - interval '3 days' GROUP BY 1, 2 ORDER BY 1, 2")
    with connection.cursor() as cursor:
        cursor.execute(recent)
        assert cursor.fetchall() == [("USD", "", 100), ("USD", key.agent_id, 100)]  # the load is missed

    call_command("rebuild_refund_totals", stdout=io.StringIO())
    with connection.cursor() as cursor:
        cursor.execute(recent)
        rebuilt = cursor.fetchall()
        cursor.execute("SELECT count(*), min(bucket) FROM refundops_refundtotaldelta")
        rows, oldest = cursor.fetchone()
        cursor.execute("DELETE FROM refundops_refundtotaldelta")
        cursor.execute(importlib.import_module("refundops.migrations.0016_refund_totals").BACKFILL)
        cursor.execute("SELECT currency, agent_id, bucket, amount_minor FROM refundops_refundtotaldelta ORDER BY 1, 2, 3")
        backfilled = cursor.fetchall()
    assert rebuilt == [("USD", "", 120), ("USD", key.agent_id, 120)]
    assert rows == 2 and oldest > timezone.now() - timedelta(days=3)  # the 5-day-old refund: not kept
    assert [(c, a, m) for c, a, _, m in backfilled] == [("USD", "", 120), ("USD", key.agent_id, 120)]


def test_a_loaded_delta_whose_id_is_a_live_rows_leaves_the_live_row_alone(db, tmp_path):
    """A dump from another database: its delta ids may be this one's live rows. Loading one must not
    overwrite (then drop) a row that counts a refund here."""
    from django.core.management import call_command

    payment = make_payment(amount=10**7)
    Refund.objects.create(payment=payment, amount_minor=100, currency="USD", reason="duplicate",
                          status=RefundState.APPROVED)
    live = RefundTotalDelta.objects.get()
    fixture = tmp_path / "other.json"
    fixture.write_text(json.dumps([{"model": "refundops.refundtotaldelta", "pk": live.pk, "fields": {
        "currency": "USD", "agent_id": "", "bucket": live.bucket.isoformat(), "amount_minor": 999}}]))
    call_command("loaddata", str(fixture), verbosity=0)
    kept, scanned = kept_and_scanned()
    assert kept == scanned == [("USD", "", 100)]
    assert list(RefundTotalDelta.objects.values_list("pk", "amount_minor")) == [(live.pk, 100)]


@pytest.mark.django_db(transaction=True)
def test_a_fold_while_another_folds_leaves_the_rows_to_it():
    """Two folds could lock a bucket's rows in other orders and deadlock: the second one finds the
    first one's lock and returns, folding nothing."""
    from refundops.services.totals import FOLD_LOCK_KEY

    payment = make_payment(amount=10**7)
    for amount in (100, 200):
        Refund.objects.create(payment=payment, amount_minor=amount, currency="USD", reason="duplicate",
                              status=RefundState.APPROVED)
    holding, release = threading.Event(), threading.Event()

    def work(i: int) -> int:
        if i == 0:
            with transaction.atomic(), connection.cursor() as cursor:
                cursor.execute("SELECT pg_advisory_xact_lock(%s)", [FOLD_LOCK_KEY])  # a fold under way
                holding.set()
                release.wait(10)
            return -1
        holding.wait(10)
        try:
            return fold_totals()
        finally:
            release.set()

    assert race(2, work)[1] == 0
    assert RefundTotalDelta.objects.count() == 2
    assert fold_totals() == 1 and RefundTotalDelta.objects.get().amount_minor == 300


# ---- second review (b3f8ddf, aa53987, 55bc120) ----------------------------------------------------


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("first", ["fold", "rebuild"])
def test_a_rebuild_while_a_fold_or_another_rebuild_commits_counts_each_refund_once(first):
    """Review 2: ``rebuild_totals`` locked the refunds (SHARE: writers wait) but not the deltas'
    other writers. A fold (or a second rebuild: SHARE does not conflict with SHARE) under way deletes
    rows and inserts their sum; the rebuild's DELETE waits on the deleted rows, skips them once the
    other commits, and never sees the inserted sum (not in its snapshot): it stays, next to the
    rebuilt rows, and every refund of the bucket counts twice (too high: good refunds refused)."""
    from refundops.services.totals import rebuild_totals

    payment = make_payment(amount=10**7)
    for amount in (100, 200):
        Refund.objects.create(payment=payment, amount_minor=amount, currency="USD", reason="duplicate",
                              status=RefundState.APPROVED)
    under_way, started = threading.Event(), threading.Event()

    def work(i: int):
        if i == 0:
            with transaction.atomic():
                done = fold_totals() if first == "fold" else rebuild_totals()
                under_way.set()
                started.wait(10)
                threading.Event().wait(1.5)  # the rebuild is waiting (on rows or on the lock) by now
            return done
        under_way.wait(10)
        started.set()
        return rebuild_totals()

    race(2, work)
    kept, scanned = kept_and_scanned()
    assert kept == scanned == [("USD", "", 300)]


@pytest.mark.django_db
@pytest.mark.parametrize("hours_ago", [2, 20])
def test_the_agents_older_refunds_are_not_read_under_a_generic_plan(policy, hours_ago):
    """Review 2: a prepared statement is planned once (generic plan after five executions). With
    1,500 of the agent's refunds older than an hour, the agent's subquery must still read only the
    hour's first minutes, the day's edge and the session, not every refund of the agent."""
    now = timezone.now()
    key, payment = _agent_with_1500_refunds_at(now - timedelta(hours=hours_ago))
    with connection.cursor() as cursor:
        cursor.execute("SET plan_cache_mode = force_generic_plan")
        try:
            totals, refunds_read = _totals_and_refunds_read(payment, key, now)
        finally:
            cursor.execute("RESET plan_cache_mode")
    day = 100 + 7 * 1500 if start_of_day(now) <= now - timedelta(hours=hours_ago) else 100
    assert totals.agent_day_minor == day and totals.agent_hour_minor == 100 and totals.session_minor == 100
    assert refunds_read < 50, f"one decision's totals read {refunds_read} refunds"


@pytest.mark.parametrize("zone", ["Pacific/Kiritimati", "Pacific/Pago_Pago", "Asia/Kathmandu"])
def test_a_refund_older_than_the_kept_days_moved_to_today_after_a_rebuild_counts_once(db, zone):
    """Review 2 (held): the rebuild (and the backfill) keep only the last 3 days; a refund counted
    5 days ago, then counted again today (a resubmission), is taken back from a bucket no longer
    kept and added to today's: the day's and hour's totals (+14:00, -11:00, +5:45) are the refunds'."""
    from django.test import override_settings

    from refundops.services.totals import rebuild_totals

    with override_settings(TIME_ZONE=zone):
        key, _ = make_agent_key()
        payment = make_payment(amount=10**7)
        now = timezone.now()
        old = Refund.objects.create(payment=payment, amount_minor=500, currency="USD", reason="duplicate",
                                    agent=key.agent, status=RefundState.APPROVED, counted_at=now - timedelta(days=5))
        Refund.objects.create(payment=payment, amount_minor=40, currency="USD", reason="duplicate",
                              agent=key.agent, status=RefundState.APPROVED, counted_at=start_of_day(now))
        rebuild_totals()
        Refund.objects.filter(pk=old.pk).update(counted_at=now - timedelta(minutes=1))
        fold_totals()
        for exclude in ("", old.pk):
            sql = running_totals(payment=payment, agent_id=key.agent_id, session_id="", now=now,
                                 exclude_refund_id=exclude)
            assert sql == _orm_totals(payment, key.agent_id, now, exclude)
            assert sql.agent_day_minor == sql.global_day_minor == (540 if not exclude else 40)


def _rebuild_behind_a_long_refund_transaction(lock_timeout: str) -> str:
    """``manage.py rebuild_refund_totals --lock-timeout`` while another transaction, which waits
    5 s before it commits, has written a refund: the command's error, or "rebuilt"."""
    from django.core.management import CommandError, call_command

    payment = make_payment(amount=10**7)
    Refund.objects.create(payment=payment, amount_minor=100, currency="USD", reason="duplicate",
                          status=RefundState.APPROVED)
    writing, release = threading.Event(), threading.Event()

    def work(i: int) -> str:
        if i == 0:
            with transaction.atomic():
                Refund.objects.create(payment=payment, amount_minor=5, currency="USD", reason="duplicate",
                                      status=RefundState.APPROVED)
                writing.set()
                release.wait(5)
            return ""
        writing.wait(10)
        try:
            call_command("rebuild_refund_totals", "--lock-timeout", lock_timeout, stdout=io.StringIO())
        except CommandError as exc:
            return str(exc)
        finally:
            release.set()
        return "rebuilt"

    return race(2, work)[1]


@pytest.mark.django_db(transaction=True)
def test_a_rebuild_behind_a_long_refund_transaction_gives_up_and_changes_nothing():
    """Its lock queued behind a transaction writing refunds, the rebuild would hold every new refund
    behind it: it waits a bounded time, then fails with a message to act on, the totals untouched."""
    message = _rebuild_behind_a_long_refund_transaction("0.2")
    assert message.startswith("Nothing changed: a transaction writing refunds held its lock for over 0.2 s")
    kept, scanned = kept_and_scanned()
    assert kept == scanned == [("USD", "", 105)]


def test_beat_folds_the_kept_totals_every_few_seconds(db):
    """With no fold the totals stay exact but each decision reads two rows a refund more: beat runs
    the task (on the default queue, which every worker serves) every few seconds."""
    from django.conf import settings

    from refundops.tasks import fold_refund_totals

    schedule = {job["task"]: job["schedule"] for job in settings.CELERY_BEAT_SCHEDULE.values()}
    assert schedule["refundops.tasks.fold_refund_totals"].total_seconds() <= 10
    assert schedule["refundops.tasks.drop_old_refund_totals"].total_seconds() <= 3600
    payment, at = make_payment(amount=10**7), timezone.now()
    for amount in (100, 200, 300):  # one quarter hour: three rows folded into one
        Refund.objects.create(payment=payment, amount_minor=amount, currency="USD", reason="duplicate",
                              status=RefundState.APPROVED, counted_at=at)
    assert fold_refund_totals.apply().get() == 2
    assert list(RefundTotalDelta.objects.values_list("agent_id", "amount_minor")) == [("", 600)]


@pytest.mark.django_db
def test_a_fold_reads_the_buckets_written_to_since_the_last_one_not_every_row_kept(db):
    """Fails before (the fold grouped every row of the last 3 days, every 5 s: with 1,000 agents
    that is 288,000 rows, ~0.3 s of a core each time). Now it finds the buckets to fold through the
    index of unfolded rows, and the old buckets go hourly (``drop_old_totals``)."""
    from refundops.services.totals import drop_old_totals

    now = timezone.now()
    with connection.cursor() as cursor:  # 2,000 buckets already folded: 2 days of 1,000 agents' sums
        cursor.execute("""
            INSERT INTO refundops_refundtotaldelta (currency, agent_id, bucket, amount_minor, folded)
            SELECT 'USD', 'ag_' || (g %% 1000), refundops_total_bucket(%s - make_interval(secs => (g / 1000) * 86400)), 1, true
              FROM generate_series(0, 1999) g""", [now])
        cursor.execute("ANALYZE refundops_refundtotaldelta")
    payment, at = make_payment(amount=10**7), now
    for amount in (100, 200, 300):
        Refund.objects.create(payment=payment, amount_minor=amount, currency="USD", reason="duplicate",
                              status=RefundState.APPROVED, counted_at=at)
    with connection.cursor() as cursor:
        before = rows_read(cursor, "refundops_refundtotaldelta")
        assert fold_totals() == 2
        read = rows_read(cursor, "refundops_refundtotaldelta") - before
    assert read < 50, f"the fold read {read} rows"
    assert RefundTotalDelta.objects.get(agent_id="").amount_minor == 600
    assert RefundTotalDelta.objects.filter(folded=False).count() == 0
    # Old buckets: kept until the hourly drop, which takes those before KEEP_DAYS and nothing else.
    RefundTotalDelta.objects.create(currency="USD", agent_id="ag_old", bucket=now - timedelta(days=3, minutes=15),
                                    amount_minor=5)
    RefundTotalDelta.objects.create(currency="USD", agent_id="ag_old", bucket=now - timedelta(days=2, hours=23),
                                    amount_minor=7)
    assert fold_totals() == 0 and RefundTotalDelta.objects.filter(agent_id="ag_old").count() == 2
    assert drop_old_totals() == 1
    assert list(RefundTotalDelta.objects.filter(agent_id="ag_old").values_list("amount_minor", flat=True)) == [7]
    assert RefundTotalDelta.objects.count() == 2000 + 1 + 1  # the folded sums, the new one, the 7


# ---- third review ----------------------------------------------------------------------------------

def _sql_equals_orm(payment, agent_id, now, excludes=("",)):
    for exclude in excludes:
        for agent in (agent_id, None):
            sql = running_totals(payment=payment, agent_id=agent, session_id="", now=now, exclude_refund_id=exclude)
            assert sql == _orm_totals(payment, agent, now, exclude), (exclude, agent)


def test_a_refund_moving_between_counting_states_while_its_amount_changes_counts_its_new_amount(db):
    """Third review: held -> approved -> submitted -> settled, each with a new amount (and once a new
    counted_at and agent in the same statement): the kept totals follow the amount, never the old one."""
    key, _ = make_agent_key()
    other, _ = make_agent_key()
    payment, now = make_payment(amount=10**7), timezone.now()
    refund = Refund.objects.create(payment=payment, amount_minor=500, currency="USD", reason="duplicate",
                                   agent=key.agent, status=RefundState.HELD, counted_at=now - timedelta(minutes=5))
    steps = [{"status": RefundState.APPROVED, "amount_minor": 400},
             {"status": RefundState.SUBMITTED, "amount_minor": 450, "counted_at": now - timedelta(minutes=50)},
             {"status": RefundState.SETTLED, "amount_minor": 30, "agent": other.agent},
             {"status": RefundState.REQUESTED, "amount_minor": 31, "agent": key.agent, "counted_at": now}]
    for step in steps:
        Refund.objects.filter(pk=refund.pk).update(**step)
        kept, scanned = kept_and_scanned()
        assert kept == scanned
        _sql_equals_orm(payment, key.agent_id, now, ("", refund.pk))
        _sql_equals_orm(payment, other.agent_id, now, ("", refund.pk))
    assert running_totals(payment=payment, agent_id=key.agent_id, session_id="", now=now).agent_hour_minor == 31
    fold_totals()
    assert running_totals(payment=payment, agent_id=key.agent_id, session_id="", now=now).agent_hour_minor == 31


def test_bulk_create_upserts_and_a_delete_of_many_refunds_keep_the_totals(db):
    """Third review: bulk_create (plain, ignore_conflicts, update_conflicts: an upsert that moves a
    counting refund to another counting state and amount) and the ORM's delete() of many rows."""
    key, _ = make_agent_key()
    payment, now = make_payment(amount=10**8), timezone.now()

    def batch(amount, status):
        return [Refund(payment=payment, amount_minor=amount + i, currency="USD", reason="duplicate",
                       agent=key.agent if i % 2 else None, status=status, counted_at=now - timedelta(minutes=i))
                for i in range(150)]

    made = Refund.objects.bulk_create(batch(10, RefundState.APPROVED))
    assert kept_and_scanned()[0] == kept_and_scanned()[1] != []
    again = batch(20, RefundState.SUBMITTED)
    for refund, old in zip(again, made):
        refund.pk = old.pk
    Refund.objects.bulk_create(again[:50], ignore_conflicts=True)  # nothing written
    kept, scanned = kept_and_scanned()
    assert kept == scanned
    Refund.objects.bulk_create(again, update_conflicts=True, unique_fields=["id"],
                               update_fields=["status", "amount_minor", "counted_at"])
    kept, scanned = kept_and_scanned()
    assert kept == scanned
    _sql_equals_orm(payment, key.agent_id, now)
    Refund.objects.filter(pk__in=[r.pk for r in made[:120]]).delete()
    kept, scanned = kept_and_scanned()
    assert kept == scanned
    fold_totals()
    _sql_equals_orm(payment, key.agent_id, now, ("", made[130].pk))


@pytest.mark.parametrize("step", [timedelta(0), timedelta(microseconds=1), -timedelta(microseconds=1)])
def test_the_hours_first_bucket_at_its_start_exactly_counts_each_refund_once(db, step):
    """Third review: now - 1h exactly on a bucket boundary (and a microsecond either side): the refunds
    at the boundary, a microsecond before it and after it, folded or not, excluded or not."""
    key, _ = make_agent_key()
    payment = make_payment(amount=10**8)
    boundary = first_bucket_from(timezone.now() - timedelta(hours=2))
    now = boundary + timedelta(hours=1) + step
    made = [Refund.objects.create(payment=payment, amount_minor=10 + i, currency="USD", reason="duplicate",
                                  agent=key.agent, status=RefundState.APPROVED, counted_at=boundary + offset).pk
            for i, offset in enumerate([-timedelta(microseconds=1), timedelta(0), timedelta(microseconds=1),
                                        timedelta(minutes=15) - timedelta(microseconds=1)])]
    _sql_equals_orm(payment, key.agent_id, now, ("", *made))
    fold_totals()
    _sql_equals_orm(payment, key.agent_id, now, ("", *made))


def _zone_just_past_midnight() -> str:
    hour = timezone.now().astimezone(UTC).hour
    return f"Etc/GMT+{hour}" if hour <= 12 else f"Etc/GMT-{24 - hour}"


def test_a_fold_dropping_the_old_buckets_leaves_the_hour_that_began_yesterday(db):
    """Third review: in a zone where it is just past midnight, the last hour began yesterday; a fold
    (dropping buckets over 3 days old) between reads leaves yesterday's last hour and the day exact."""
    from django.test import override_settings

    with override_settings(TIME_ZONE=_zone_just_past_midnight()):
        key, _ = make_agent_key()
        payment, now = make_payment(amount=10**8), timezone.now()
        day = start_of_day(now)
        assert now - timedelta(hours=1) < day <= now
        offsets = [timedelta(days=-4), timedelta(days=-3, minutes=-1), timedelta(days=-1), now - day - timedelta(hours=1, seconds=1),
                   now - day - timedelta(minutes=59), -timedelta(microseconds=1), timedelta(0), now - day]
        made = [Refund.objects.create(payment=payment, amount_minor=10 + i, currency="USD", reason="duplicate",
                                      agent=key.agent, status=RefundState.APPROVED, counted_at=day + offset).pk
                for i, offset in enumerate(offsets)]
        _sql_equals_orm(payment, key.agent_id, now, ("", *made))
        fold_totals()
        _sql_equals_orm(payment, key.agent_id, now, ("", *made))
        Refund.objects.filter(pk=made[0]).update(counted_at=now)  # 4 days old, moved to now after the fold
        Refund.objects.filter(pk=made[3]).update(status=RefundState.FAILED)
        fold_totals()
        _sql_equals_orm(payment, key.agent_id, now, ("", *made))


def test_a_rebuild_killed_after_its_delete_changes_nothing(db, monkeypatch):
    """Third review: a rebuild that dies between its DELETE and its INSERT (one transaction) leaves the
    kept totals as they were, not empty."""
    from refundops.services import totals

    payment = make_payment(amount=10**7)
    Refund.objects.create(payment=payment, amount_minor=700, currency="USD", reason="duplicate",
                          status=RefundState.APPROVED)
    before = kept_and_scanned()
    monkeypatch.setattr(totals, "_REBUILD_SQL", "SELECT 1 / 0")
    from django.db import DataError

    with pytest.raises(DataError):  # division by zero
        totals.rebuild_totals()
    assert kept_and_scanned() == before and before[0] == before[1] == [("USD", "", 700)]


@pytest.mark.django_db(transaction=True)
def test_a_fold_whose_connection_dies_before_commit_changes_nothing():
    """Third review: the fold's backend killed after its statement ran, before its commit."""
    from django.db import InterfaceError, OperationalError, connections

    payment, at = make_payment(amount=10**7), timezone.now()
    for amount in (100, 200, 300):
        Refund.objects.create(payment=payment, amount_minor=amount, currency="USD", reason="duplicate",
                              status=RefundState.APPROVED, counted_at=at)
    folded, kill = threading.Event(), threading.Event()

    def fold_and_die():
        try:
            with transaction.atomic():
                assert fold_totals() == 2
                with connection.cursor() as cursor:
                    cursor.execute("SELECT pg_backend_pid()")
                    pid[0] = cursor.fetchone()[0]
                folded.set()
                kill.wait(10)
                with connection.cursor() as cursor:
                    cursor.execute("SELECT 1")
        except (OperationalError, InterfaceError) as exc:  # the connection is gone
            errors.append(exc)
        finally:
            connections.close_all()

    pid, errors = [None], []
    thread = threading.Thread(target=fold_and_die)
    thread.start()
    assert folded.wait(10)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_terminate_backend(%s)", [pid[0]])
    kill.set()
    thread.join(10)
    assert errors
    assert RefundTotalDelta.objects.count() == 3
    kept, scanned = kept_and_scanned()
    assert kept == scanned == [("USD", "", 600)]


def test_a_refund_in_another_currency_on_the_payment_is_counted_alike_by_the_sql_and_the_orm(db):
    """Third review (SQL and ORM readings): the payment's refund count and agents' sum. The
    statement counted the payment's refunds in every currency, the ORM (SQLite mode) in the
    payment's only; both now count every one (the stricter; the services write a refund in its
    payment's currency)."""
    key, _ = make_agent_key()
    payment, now = make_payment(amount=10**7), timezone.now()
    Refund.objects.create(payment=payment, amount_minor=100, currency="USD", reason="duplicate",
                          agent=key.agent, status=RefundState.APPROVED, origin=Refund.Origin.AGENT)
    Refund.objects.create(payment=payment, amount_minor=300, currency="EUR", reason="duplicate",
                          agent=key.agent, status=RefundState.APPROVED, origin=Refund.Origin.AGENT)
    _sql_equals_orm(payment, key.agent_id, now)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("seconds", ["0", "0.0004"])
def test_a_rebuild_told_to_wait_no_time_gives_up_at_once_not_never(seconds):
    """Third review: --lock-timeout 0 (or under a millisecond, made 0 ms) set lock_timeout to 0,
    which PostgreSQL reads as no timeout: the rebuild queued behind a long refund transaction for
    as long as it ran (then "rebuilt"), holding every new refund behind it, the very thing the
    timeout is for."""
    assert _rebuild_behind_a_long_refund_transaction(seconds).startswith("Nothing changed:")


@pytest.mark.django_db(transaction=True)
def test_a_decision_behind_the_agents_lock_reads_the_refund_committed_while_it_waited():
    """Third review (READ COMMITTED): a writer holding the agent's and the currency's locks writes a
    refund, a fold runs, the writer commits; the decision that waited for the locks reads, in its one
    statement, the refund in the agent's hour and day and in the currency's day (buckets and refunds
    alike), and then a refund committed after its statement only in its next one."""
    from refundops.locks import lock_scopes

    key, _ = make_agent_key()
    payment = make_payment(amount=10**8)
    Refund.objects.create(payment=payment, amount_minor=40, currency="USD", reason="duplicate",
                          agent=key.agent, status=RefundState.APPROVED)
    locked = threading.Event()
    scopes = {"customer_id": payment.customer_id, "agent_id": key.agent_id, "currency": "USD", "exclusive": True}

    def work(i: int):
        if i == 0:
            with transaction.atomic():
                lock_scopes(**scopes)
                Refund.objects.create(payment=payment, amount_minor=500, currency="USD", reason="duplicate",
                                      agent=key.agent, status=RefundState.SUBMITTED)
                locked.set()
                wait_until_another_connection_waits_for_a_lock()  # the decision waits on our locks
                fold_totals()  # another connection's fold: it does not see the uncommitted rows
            return None
        locked.wait(10)
        with transaction.atomic():
            lock_scopes(**scopes)
            now = timezone.now()
            first = running_totals(payment=payment, agent_id=key.agent_id, session_id="", now=now)
            Refund.objects.create(payment=payment, amount_minor=7, currency="USD", reason="duplicate",
                                  agent=key.agent, status=RefundState.HELD)
            second = running_totals(payment=payment, agent_id=key.agent_id, session_id="", now=now)
        return first, second

    first, second = race(2, work)[1]
    assert (first.agent_hour_minor, first.agent_day_minor, first.global_day_minor) == (540, 540, 540)
    assert (second.agent_hour_minor, second.agent_day_minor, second.global_day_minor) == (547, 547, 547)
    fold_totals()
    kept, scanned = kept_and_scanned()
    assert kept == scanned


@pytest.mark.django_db(transaction=True)
def test_two_updates_of_one_refund_waiting_on_its_row_each_take_back_what_the_other_left():
    """Third review: an update (counting state to counting state, a new amount) waits on the row
    another update holds (amount, agent); the trigger's OLD is the row the other committed, not the
    one the waiting statement first saw: the kept totals end at the refund's last amount, once."""
    from django.db.models import F

    key, _ = make_agent_key()
    payment = make_payment(amount=10**8)
    refund = Refund.objects.create(payment=payment, amount_minor=100, currency="USD", reason="duplicate",
                                   agent=None, status=RefundState.APPROVED)
    holding = threading.Event()

    def work(i: int) -> None:
        if i == 0:
            with transaction.atomic():
                Refund.objects.filter(pk=refund.pk).update(amount_minor=200, agent=key.agent)
                holding.set()
                wait_until_another_connection_waits_for_a_lock()  # the other update waits on our row
            return
        holding.wait(10)
        Refund.objects.filter(pk=refund.pk, status=RefundState.APPROVED).update(
            status=RefundState.SUBMITTED, amount_minor=F("amount_minor") + 1)

    race(2, work)
    assert Refund.objects.get(pk=refund.pk).amount_minor == 201
    kept, scanned = kept_and_scanned()
    assert kept == scanned == [("USD", "", 201), ("USD", key.agent_id, 201)]


@pytest.mark.parametrize("seed", range(4))
def test_random_refunds_changes_and_folds_read_alike_by_the_sql_and_the_orm(db, seed):
    """Third review: refunds of two agents and none, in two currencies, counted around the day's and
    the hour's edges (a now that falls on, just before and just after a bucket boundary), changed in
    state, amount, agent and counted_at, folded now and then: every reading of the statement equals
    the ORM's, each refund excluded in turn."""
    from django.test import override_settings

    rng = random.Random(seed)
    zone = ["UTC", "Asia/Kathmandu", "America/St_Johns", _zone_just_past_midnight()][seed]
    with override_settings(TIME_ZONE=zone):
        agents = [make_agent_key()[0].agent for _ in range(2)]
        usd = make_payment(amount=10**9)
        eur = make_payment(amount=10**9, currency="EUR", customer=usd.customer)
        base = first_bucket_from(timezone.now() - timedelta(hours=2))
        nows = [base + timedelta(hours=1) + timedelta(microseconds=d) for d in (-1, 0, 1)] + [timezone.now()]
        states = list(RefundState)
        made = []
        for n in range(60):
            now = rng.choice(nows)
            anchors = [start_of_day(now), now - timedelta(hours=1), first_bucket_from(now - timedelta(hours=1)), now,
                       now - timedelta(days=3, minutes=1)]
            at = rng.choice(anchors) + timedelta(microseconds=rng.choice([-1, 0, 1, 10**6 * rng.randint(-1200, 1200)]))
            choice = rng.random()
            if not made or choice < 0.5:
                payment = rng.choice([usd, eur])
                made.append(Refund.objects.create(payment=payment, amount_minor=rng.randint(1, 999), currency=payment.currency,
                                                  reason="duplicate", agent=rng.choice([*agents, None]),
                                                  status=rng.choice(states), counted_at=at).pk)
            elif choice < 0.85:
                Refund.objects.filter(pk=rng.choice(made)).update(
                    **rng.choice([{"status": rng.choice(states)}, {"amount_minor": rng.randint(1, 999)},
                                  {"agent": rng.choice([*agents, None])}, {"counted_at": at},
                                  {"status": rng.choice(states), "amount_minor": rng.randint(1, 999), "counted_at": at}]))
            elif choice < 0.95:
                fold_totals()
            else:
                Refund.objects.filter(pk=made.pop(rng.randrange(len(made)))).delete()
            if n % 10 == 9:
                for payment in (usd, eur):
                    for agent in (*agents, None):
                        for exclude in ["", *rng.sample(made, min(4, len(made)))]:
                            sql = running_totals(payment=payment, agent_id=agent and agent.pk, session_id="",
                                                 now=now, exclude_refund_id=exclude)
                            assert sql == _orm_totals(payment, agent and agent.pk, now, exclude), (n, exclude)
