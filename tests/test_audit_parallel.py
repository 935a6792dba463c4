"""verify_audit over several processes (audit.parallel, audit.verify_worker): the chain split into
ranges of seq, each checked in a process of its own that reads rows with psycopg, not Django.

What must hold: every tampering is named exactly as one process names it (the same entry, the same
reason, the same count before it), also in the second process's range and at a range's edges; and
each value the workers read (jsonb by orjson where it decodes the same, datetimes and UUIDs
spelled as they are loaded) spells the same canonical bytes as Django's reading of it."""

from __future__ import annotations

import json
import tracemalloc
from datetime import UTC, datetime, timedelta, timezone as fixed_offset
from decimal import Decimal

import pytest
from django.core.management import CommandError
from django.db import connection, transaction
from django.utils import timezone
from hypothesis import HealthCheck, example, given, settings as hsettings, strategies as st

from audit import chain, parallel, verify_worker, walk
from audit.models import AuditEntry, Verdict
from refundops.services.agents import revoke_key
from tests.conftest import make_agent_key
from tests.test_audit_chain import _swap, as_table_owner, head, sql, verify, write, write_sealed


def outcome(*args: str) -> str:
    """What verify_audit says: its first line, or its error."""
    try:
        out, _ = verify(*args)
    except CommandError as failed:
        return f"error: {failed}"
    return out.splitlines()[0]


@pytest.fixture
def ranges(monkeypatch):
    """Parallel verification for any chain length; records how each run went."""
    monkeypatch.setattr(parallel, "MIN_ENTRIES", 0)
    runs: list[dict] = []
    monkeypatch.setattr(parallel, "observe", runs.append)
    return runs


# Ranges of 12 entries in 2 processes: #1-#6 and #7-#12; in 3: #1-#4, #5-#8, #9-#12.
TAMPERS = [
    ("edit", 2), ("edit", 6), ("edit", 7), ("edit", 9), ("edit", 12),
    ("delete", 6), ("delete", 7), ("delete", 12), ("swap", 6), ("swap", 9), ("none", 0),
]


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize(("how", "seq"), TAMPERS)
def test_a_tampered_chain_is_named_by_several_processes_exactly_as_by_one(ranges, how, seq):
    entries = write_sealed(12)
    kept = head()
    with as_table_owner():
        if how == "edit":
            sql("UPDATE audit_auditentry SET actor = 'user:mallory' WHERE seq = %s", [seq])
        elif how == "delete":
            sql("DELETE FROM audit_auditentry WHERE seq = %s", [seq])
        elif how == "swap":
            _swap(entries, seq, seq + 1)
    one = outcome("--processes", "1", "--head", kept, "--chunk-size", "4")
    assert ranges == []  # one process: no ranges
    assert (how == "none") == one.startswith("12 audit entries checked"), one
    for processes in (2, 3):
        ranges.clear()
        assert outcome("--processes", str(processes), "--head", kept, "--chunk-size", "4") == one
        assert ranges[0]["ranges"] == processes


@pytest.mark.django_db(transaction=True)
def test_an_edit_in_the_second_process_range_is_found_by_that_process(ranges):
    write_sealed(12)
    with as_table_owner():
        sql("UPDATE audit_auditentry SET data = '{}' WHERE seq = 9")
    with pytest.raises(CommandError, match=r"audit entry #9 .* entry #9 was altered after it was written; 8 entries "
                                           r"before it verified"):
        verify("--processes", "2")
    assert ranges == [{"ranges": 2, "taken": 2, "checked_here_from": None}]  # named by the second process


@pytest.mark.django_db(transaction=True)
def test_a_deleted_entry_at_a_ranges_edge_is_checked_again_here_and_named_as_by_one_process(ranges):
    """Entry #6 ends the first range: without it the second range's start (#6's hash) is unproven,
    so this process walks on from #5, and names #7 as one process does."""
    write_sealed(12)
    with as_table_owner():
        sql("DELETE FROM audit_auditentry WHERE seq = 6")
    with pytest.raises(CommandError, match=r"audit entry #7 .* entry #7 follows #5: an entry is missing; 5 entries"):
        verify("--processes", "2")
    assert ranges == [{"ranges": 2, "taken": 1, "checked_here_from": 5}]


@pytest.mark.django_db(transaction=True)
def test_a_clean_chain_is_verified_by_every_range_and_counted_once(ranges):
    write_sealed(12)
    out, err = verify("--processes", "2", "--progress-every", "6", "--chunk-size", "3")
    assert out.startswith("12 audit entries checked; the chain verifies.")
    assert ranges == [{"ranges": 2, "taken": 2, "checked_here_from": None}]
    assert [line for line in err.splitlines() if line.startswith("…")] == ["… 6 entries verified",
                                                                           "… 12 entries verified"]


@pytest.mark.django_db(transaction=True)
def test_an_edited_recorded_row_in_the_second_range_is_named_by_its_entry(ranges):
    write(8)
    key, _ = make_agent_key()
    revoke_key(prefix=key.prefix, actor="user:root")
    write(3, start=100)
    chain.seal_pending()
    entry = AuditEntry.objects.get(action="key.revoked")
    assert entry.seq > 6 and entry.records  # in the second of two ranges
    assert outcome("--processes", "2").endswith("the chain verifies.")
    history = key.history.latest()
    type(history).objects.filter(pk=history.pk).update(revoked_at=None)
    one = outcome("--processes", "1")
    assert f"the historical agent key {history.pk} it records was altered" in one
    assert outcome("--processes", "2") == one
    assert ranges[-1] == {"ranges": 2, "taken": 2, "checked_here_from": None}


@pytest.mark.django_db(transaction=True)
def test_a_worker_that_cannot_read_a_record_leaves_its_range_to_this_process(ranges):
    """A record naming its model by another spelling than its label (Django finds it all the same):
    the worker does not guess, so that range is walked here, and says what one process says."""
    write(8)
    verdict = Verdict.objects.create(operation="refund.create", outcome=Verdict.Outcome.APPROVED)
    entry = AuditEntry(created_at=timezone.now(), actor="user:alice", action="refund.approved", subject_type="refund",
                       subject_id="rf_v", records=[{"model": "audit.Verdict", "pk": verdict.pk,
                                                    "digest": chain.row_digest(verdict)}])
    entry.mac = chain.entry_mac(entry)
    entry.save()
    write(3, start=10)
    chain.seal_pending()
    one = outcome("--processes", "1")
    assert one.startswith("12 audit entries checked")
    assert outcome("--processes", "2") == one
    assert ranges[-1] == {"ranges": 2, "taken": 1, "checked_here_from": 6}
    Verdict.objects.filter(pk=verdict.pk).update(amount_minor=1)
    one = outcome("--processes", "1")
    assert (f"audit entry #9 (id {entry.pk}, refund.approved refund:rf_v) does not verify: "
            f"the verdict {verdict.pk}") in one
    assert outcome("--processes", "2") == one


@pytest.mark.django_db
def test_inside_a_transaction_one_process_checks_what_only_it_can_see(ranges):
    """A test's transaction (or any) holds rows other processes cannot see: one process walks."""
    write_sealed(3)
    assert outcome("--processes", "4").startswith("3 audit entries checked")
    assert ranges == []


# Each value read by a worker spells as Django's reading of it does.

# jsonb holds every character but NUL and a lone surrogate (no JSON text does)
TEXT = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"))
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.integers(min_value=-(10**40), max_value=10**40)
    | st.floats(allow_nan=False, allow_infinity=False) | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT.map(lambda t: t[:8]), inner, max_size=4),
    max_leaves=12)


@pytest.mark.django_db
@hsettings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(JSON)
@example(1e-07)
@example(12345678901234567890123)
@example(-9223372036854775809)
@example(18446744073709551616)
@example({"a": 0.1, "é": "\x01\x1f\x7f\u2028\"\\", "b": [1.0, 2.5e-10, 1e16, -0.0, 5e-324]})
def test_jsonb_decoded_by_the_workers_spells_as_djangos_json_loads(value):
    with transaction.atomic(), connection.cursor() as cursor:  # a savepoint: an error is this example's own
        cursor.execute("SELECT %s::jsonb::text", [json.dumps(value)])
        text = cursor.fetchone()[0]  # PostgreSQL's own spelling, as Django and the workers receive it
    djangos = json.loads(text)
    workers = verify_worker.json_loads(text.encode())
    assert walk.canonical(workers) == walk.canonical(djangos)
    assert workers == djangos and type(workers) is type(djangos)


@pytest.mark.django_db(transaction=True)
@hsettings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.datetimes(min_value=datetime(1, 1, 2), max_value=datetime(9999, 12, 30),
                    timezones=st.sampled_from([UTC, fixed_offset(timedelta(hours=5, minutes=30)),
                                               fixed_offset(timedelta(hours=-8))])),
       st.decimals(allow_nan=False, allow_infinity=False, places=4, min_value=-10**12, max_value=10**12),
       st.uuids(), st.binary(max_size=8), st.dates(), st.times())
def test_values_spelled_at_load_by_the_workers_spell_as_djangos(at, amount, uid, raw, day, moment):
    values = [at, amount, uid, raw, day, moment]
    casts = ["timestamptz", "numeric", "uuid", "bytea", "date", "time"]
    query = "SELECT " + ", ".join(f"%s::{cast}" for cast in casts)
    with connection.cursor() as cursor:
        cursor.execute(query, values)
        djangos = cursor.fetchone()
    with verify_worker.connect(parallel.conninfo()) as conn:
        workers = conn.execute(query, values).fetchone()
    assert [walk.canonical(v) for v in workers] == [walk.canonical(v) for v in djangos]
    assert all(type(v) is str for v in workers)  # spelled once, at load


@pytest.mark.django_db(transaction=True)
def test_when_no_process_can_be_started_one_process_walks_the_chain(ranges, monkeypatch):
    write_sealed(12)
    with as_table_owner():
        sql("UPDATE audit_auditentry SET actor = 'user:mallory' WHERE seq = 9")
    one = outcome("--processes", "1")

    def refused(*args, **kwargs):
        raise OSError("Resource temporarily unavailable")

    monkeypatch.setattr(parallel.subprocess, "Popen", refused)
    assert outcome("--processes", "2") == one and "entry #9 was altered" in one
    assert ranges == []  # no range was started


class _Counting:
    """A worker's connection that notes how many primary keys each records query asks for."""

    def __init__(self, conn):
        self.conn, self.sizes = conn, []

    def execute(self, query, params):
        self.sizes.append(len(params[0]))
        return self.conn.execute(query, params)


@pytest.mark.django_db(transaction=True)
def test_an_entry_recording_more_rows_than_one_query_reads_is_checked_in_batches_by_both_walks(monkeypatch):
    """A verdicts.chained entry records up to a sealer batch of verdicts, and a chunk of entries may hold
    hundreds of them (at 3 M entries, 212 entries of 5,000 verdicts: 1.06 M rows read in one query, 900 MB).
    The rows are read RECORDS_BATCH at a time by both walks, and an edit in a later batch is still found."""
    from django.test.utils import CaptureQueriesContext

    monkeypatch.setattr(walk, "RECORDS_BATCH", 4, raising=False)
    for i in range(10):
        Verdict.objects.create(operation="refund.check", outcome="approved", idempotency_key=f"batch-{i}")
    chain.seal()
    chunk = list(AuditEntry.objects.filter(action=chain.VERDICTS_CHAINED).values_list(*walk.ENTRY_COLUMNS))
    assert len(chunk) == 1 and len(chunk[0][walk.RECORDS]) == 10
    with CaptureQueriesContext(connection) as queries:
        assert chain._records_fault(chunk) is None
    read = [q["sql"] for q in queries.captured_queries if 'FROM "audit_verdict"' in q["sql"]]
    assert len(read) == 3  # 4 + 4 + 2
    with verify_worker.connect(parallel.conninfo()) as conn:
        counting = _Counting(conn)
        assert verify_worker._records_fault(counting, chunk, parallel._models()) is None
        assert counting.sizes == [4, 4, 2]
        last = chunk[0][walk.RECORDS][-1]["pk"]
        with as_table_owner():
            sql("UPDATE audit_verdict SET message = 'edited' WHERE id = %s", [last])
        found = verify_worker._records_fault(conn, chunk, parallel._models())
    assert found is not None and found[0] == 0 and found[1].endswith(f"{last} it records was altered")
    assert chain._records_fault(chunk) == found


def _chained(entries: int, each: int, tag: str) -> None:
    """``entries`` verdicts.chained entries in a row, each recording ``each`` verdicts."""
    Verdict.objects.bulk_create([Verdict(operation="refund.check", outcome="approved", idempotency_key=f"{tag}-{i}")
                                 for i in range(entries * each)])
    chain.seal(batch_size=each)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("walker", ["django", "worker"])
def test_memory_of_a_chunk_is_bounded_by_the_rows_its_entries_record(monkeypatch, walker):
    """A chunk of entries holds their records and the digests of the rows they record: at 3 M entries
    the bench's 212 verdicts.chained entries of 5,000 verdicts sat in one chunk (1.06 M records,
    738 MB). A chunk is cut where its rows recorded reach RECORDS_BATCH, in both walks: ten times the
    recorded rows in a row, not ten times the memory."""
    monkeypatch.setattr(walk, "RECORDS_BATCH", 300)

    def peak() -> int:
        tracemalloc.start()
        try:
            if walker == "django":
                assert list(chain.verify_chain(batch_size=50, progress_every=1_000_000))[-1][2] == "ok"
            else:
                job = {**parallel._job(batch_size=50, head=None), "lo": None, "hi": None}
                done = verify_worker.check_range(job, lambda verified: None)
                assert done["fault"] is None and done["verified"] == AuditEntry.objects.count()
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    _chained(2, 300, "small")
    peak(); small = peak()  # the first run warms caches
    _chained(18, 300, "large")
    assert AuditEntry.objects.filter(action=chain.VERDICTS_CHAINED).count() == 20
    large = peak()
    assert large < 2 * small, (small, large)


@pytest.mark.django_db(transaction=True)
@pytest.mark.parametrize("tamper", ["edit", "object", "null", "scalar", "none"])
def test_chunks_cut_by_their_records_name_what_whole_chunks_name(ranges, monkeypatch, tamper):
    """Chunks cut where their rows recorded reach RECORDS_BATCH verify what whole chunks did, in one
    process and in several: an entry whose records are no longer an array (the cut counts none for it)
    is named altered, not a database error."""
    monkeypatch.setattr(walk, "RECORDS_BATCH", 4)
    write(3)
    _chained(3, 3, "cut")
    write(3, start=4)
    _chained(2, 5, "cut-more")
    chain.seal()
    seq = AuditEntry.objects.filter(action=chain.VERDICTS_CHAINED).order_by("seq")[2].seq
    value = {"edit": "'[]'", "object": "'{}'", "null": "'null'", "scalar": "'5'"}.get(tamper)
    if value:
        with as_table_owner():
            sql(f"UPDATE audit_auditentry SET records = {value}::jsonb WHERE seq = %s", [seq])
    kept = head()
    one = outcome("--processes", "1", "--chunk-size", "2", "--head", kept)
    several = outcome("--processes", "2", "--chunk-size", "2", "--head", kept)
    if tamper == "none":
        assert one == "11 audit entries checked; the chain verifies.", one
    else:
        assert f"entry #{seq} was altered after it was written" in one, one
    assert several == one
    assert ranges and ranges[-1]["checked_here_from"] is None  # the workers read every range themselves
