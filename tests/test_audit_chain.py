"""The audit chain: keyed, sealed off the request's lock path, refused edits by PostgreSQL, checked
against a head kept outside the database (``manage.py audit_head`` / ``verify_audit --head``).

An attacker here is a database writer without AUDIT_KEY: one with the table owner's or a superuser's
rights, who can switch the triggers off for a session (``as_table_owner``) and rewrite rows."""

from __future__ import annotations

import contextlib
import io
import secrets
import uuid
import subprocess
import sys
import threading
import tracemalloc
from collections.abc import Iterator
from datetime import timedelta

import pytest
from django.conf import settings
from django.core.management import CommandError, ManagementUtility, call_command
from django.db import DatabaseError, connection, transaction
from django.test import override_settings
from django.test.utils import CaptureQueriesContext

from audit import chain
from audit.models import AuditEntry, Verdict
from audit.services import record_audit
from audit.tasks import seal_audit_log
from refundops.services.agents import revoke_key
from tests.conftest import make_agent_key, make_payment, post, race

pytestmark = pytest.mark.django_db


def write(n: int, *, start: int = 1) -> list[AuditEntry]:
    return [record_audit(actor="user:alice", action="refund.approved", subject_type="refund",
                         subject_id=f"rf_{i}", data={"amount_minor": 100 * i, "currency": "USD"})
            for i in range(start, start + n)]


def write_sealed(n: int) -> list[AuditEntry]:
    entries = write(n)
    assert chain.seal_pending() == n
    return list(AuditEntry.objects.filter(pk__in=[e.pk for e in entries]).order_by("seq"))


def verify(*args: str) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    call_command("verify_audit", *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def head() -> str:
    out = io.StringIO()
    call_command("audit_head", stdout=out)
    return out.getvalue().strip()


@contextlib.contextmanager
def as_table_owner() -> Iterator[None]:
    """What the table's owner or a superuser can do: switch ordinary triggers off for the session."""
    with connection.cursor() as cursor:
        cursor.execute("SET session_replication_role = replica")
    try:
        yield
    finally:
        with connection.cursor() as cursor:
            cursor.execute("SET session_replication_role = DEFAULT")


def sql(statement: str, params: list | None = None) -> None:
    with connection.cursor() as cursor:
        cursor.execute(statement, params or [])


def refused(statement: str, params: list | None = None) -> str:
    """Run ``statement`` in a savepoint; return PostgreSQL's refusal (the test fails if it is accepted)."""
    with pytest.raises(DatabaseError) as caught, transaction.atomic():
        sql(statement, params)
    return str(caught.value)


# The chain as written, sealed and verified

def test_a_clean_chain_verifies_and_says_how_many_entries_it_checked():
    write_sealed(5)
    out, _ = verify()
    assert out.splitlines()[0] == "5 audit entries checked; the chain verifies."


def test_an_empty_log_verifies():
    out, _ = verify()
    assert out.startswith("0 audit entries checked")


def test_long_chains_report_progress_on_stderr():
    write_sealed(7)
    out, err = verify("--progress-every", "3")
    assert [line for line in err.splitlines() if line.startswith("…")] == [
        "… 3 entries verified", "… 6 entries verified"]
    assert out.startswith("7 audit entries checked")


def test_progress_and_the_chunk_read_at_once_are_independent(monkeypatch):
    """--progress-every once also set how many entries were loaded and held at once (2.36 GB at
    250,000 on issue 31's 2.9 M entries): the chunk is its own option, read by keyset on seq."""
    write_sealed(10)
    chunks = []
    checked_records = chain._records_fault
    monkeypatch.setattr(chain, "_records_fault", lambda chunk: chunks.append(len(chunk)) or checked_records(chunk))
    with CaptureQueriesContext(connection) as queries:
        out, err = verify("--progress-every", "1000000", "--chunk-size", "4")
    assert out.startswith("10 audit entries checked") and "…" not in err
    assert chunks == [4, 4, 2]
    reads = [q["sql"] for q in queries if q["sql"].startswith('SELECT "audit_auditentry"."id" AS "pk"')]
    assert len(reads) == 3 and all(sql.endswith("LIMIT 4") for sql in reads)  # one bounded query a chunk
    out, err = verify("--progress-every", "2", "--chunk-size", "5")
    assert [line for line in err.splitlines() if line.startswith("…")] == [
        f"… {n} entries verified" for n in (2, 4, 6, 8, 10)]


def test_memory_held_by_verify_does_not_grow_with_the_chain():
    """The peak Python allocation of a verify is the chunk's, not the chain's: six times the
    entries, not six times the memory."""
    def peak() -> int:
        tracemalloc.start()
        try:
            assert list(chain.verify_chain(batch_size=50, progress_every=1_000_000))[-1][2] == "ok"
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    write_sealed(100)
    peak(); small = peak()  # the first run warms Django's caches
    write(500, start=101)
    assert chain.seal_pending() == 500
    large = peak()
    assert large < 2 * small, (small, large)


def test_an_append_takes_no_lock_and_leaves_the_entry_for_the_sealer():
    entry = record_audit(actor="user:alice", action="key.revoked", subject_type="agent_key", subject_id="rk_1")
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()")
        assert cursor.fetchone()[0] == 0
    entry.refresh_from_db()
    assert entry.seq is None and entry.hash == "" and entry.mac
    assert chain.seal_pending() == 1
    entry.refresh_from_db()
    assert (entry.seq, entry.prev_hash) == (1, chain.GENESIS) and entry.sealed_at is not None


def test_the_sealer_links_each_entry_to_the_one_before_in_the_order_they_were_written():
    first = write_sealed(2)
    later = write(2, start=3)
    assert chain.seal_pending() == 2
    entries = list(AuditEntry.objects.order_by("seq"))
    assert [e.seq for e in entries] == [1, 2, 3, 4]
    assert [e.pk for e in entries] == [first[0].pk, first[1].pk, later[0].pk, later[1].pk]
    assert [e.prev_hash for e in entries[1:]] == [e.hash for e in entries[:-1]]


def test_entries_are_keyed_a_chain_checked_with_another_key_fails():
    write_sealed(2)
    with override_settings(AUDIT_KEY="not the key the chain was sealed with"), \
            pytest.raises(CommandError, match=r"audit entry #1 .* was altered after it was written"):
        verify()


@pytest.mark.django_db(transaction=True)
def test_a_refund_decided_and_paid_records_its_verdict_and_history_and_the_chain_verifies(api, policy):
    payment = make_payment(amount=5_000)
    response = post(api, "/api/v1/refunds", {"transaction_id": payment.pk, "amount": 1_250,
                                             "reason": "customer_request"})
    assert response.status_code == 201  # and paid on commit by the sandbox (Celery is eager in tests)
    refund_id = response.json()["refund"]["id"]
    chain.seal_pending()
    recorded = {(e.action, r["model"]) for e in AuditEntry.objects.filter(subject_id=refund_id) for r in e.records}
    assert ("refund.approved", "audit.verdict") in recorded
    assert ("refund.submitted", "refundops.historicalrefund") in recorded
    assert ("refund.submitted", "audit.verdict") in recorded
    out, _ = verify("--head", head())
    assert "the chain verifies" in out


# Tampering by a database writer without the key

def test_an_entry_altered_with_raw_sql_is_named():
    entries = write_sealed(5)
    with as_table_owner():
        sql("UPDATE audit_auditentry SET data = %s WHERE id = %s",
            ['{"amount_minor": 1, "currency": "USD"}', entries[2].pk])
    with pytest.raises(CommandError, match=r"audit entry #3 \(id \d+, refund.approved refund:rf_3\) does not "
                                           r"verify: entry #3 was altered after it was written; 2 entries"):
        verify()


def test_an_edit_rehashed_forward_without_the_key_is_caught_at_the_edited_entry():
    entries = write_sealed(5)
    forger = override_settings(AUDIT_KEY="the attacker's best guess")
    with as_table_owner(), forger:  # re-mac the edit, then re-link every entry after it
        prev = entries[0].hash
        for entry in AuditEntry.objects.filter(seq__gte=2).order_by("seq"):
            if entry.seq == 2:
                entry.actor = "user:mallory"
                entry.mac = chain.entry_mac(entry)
            entry.prev_hash = prev
            entry.hash = chain.link_hash(entry)
            prev = entry.hash
            sql("UPDATE audit_auditentry SET actor = %s, mac = %s, prev_hash = %s, hash = %s WHERE id = %s",
                [entry.actor, entry.mac, entry.prev_hash, entry.hash, entry.pk])
    with pytest.raises(CommandError, match=r"audit entry #2 .* was altered after it was written"):
        verify()


def test_an_entry_deleted_from_the_middle_is_named_by_the_entry_after_the_gap():
    entries = write_sealed(5)
    with as_table_owner():
        sql("DELETE FROM audit_auditentry WHERE id = %s", [entries[1].pk])
    with pytest.raises(CommandError, match=r"audit entry #3 .* entry #3 follows #1: an entry is missing"):
        verify()


def test_a_deleted_tail_is_caught_against_the_exported_head():
    write_sealed(5)
    kept = head()
    assert kept.startswith("5:")
    with as_table_owner():
        sql("DELETE FROM audit_auditentry WHERE seq > 3")
    verify()  # without the head, a shorter chain looks whole: that is why the head is kept outside
    with pytest.raises(CommandError, match=r"the chain ends at #3 but the head kept outside the database is "
                                           r"#5: entries #4 to #5 are missing"):
        verify("--head", kept)


def test_deleting_every_entry_is_caught_against_the_exported_head():
    write_sealed(3)
    kept = head()
    with as_table_owner():
        sql("TRUNCATE audit_auditentry")
    with pytest.raises(CommandError, match=r"the chain ends at #0 but the head kept outside the database is #3"):
        verify("--head", kept)


def test_reordered_entries_are_caught():
    entries = write_sealed(4)
    with as_table_owner():  # swap #2 and #3, links and all
        sql("UPDATE audit_auditentry SET seq = -seq WHERE id IN (%s, %s)", [entries[1].pk, entries[2].pk])
        sql("UPDATE audit_auditentry SET seq = 3, prev_hash = %s, hash = %s WHERE id = %s",
            [entries[2].hash, entries[3].prev_hash, entries[1].pk])
        sql("UPDATE audit_auditentry SET seq = 2, prev_hash = %s, hash = %s WHERE id = %s",
            [entries[0].hash, entries[1].hash, entries[2].pk])
    with pytest.raises(CommandError, match=r"audit entry #2 \(id \d+, refund.approved refund:rf_3\) does not verify"):
        verify()


def test_an_entry_forged_without_the_key_is_never_sealed_and_is_named():
    write_sealed(1)
    with as_table_owner():
        sql("INSERT INTO audit_auditentry (uid, created_at, actor, action, subject_type, subject_id, data, "
            "records, mac, prev_hash, hash) VALUES (gen_random_uuid(), now(), 'user:mallory', 'refund.approved', "
            "'refund', 'rf_x', '{}', '[]', repeat('0', 64), '', '')")
    write(1, start=2)
    assert chain.seal_pending() == 1  # the genuine one; the forgery stays out of the chain
    assert list(AuditEntry.objects.filter(seq__isnull=False).values_list("seq", "subject_id")) == [
        (2, "rf_2"), (1, "rf_1")]
    with pytest.raises(CommandError, match=r"audit entry \(unsealed, id \d+, refund.approved refund:rf_x\) does "
                                           r"not verify: it was altered or forged before it was sealed"):
        verify()


def test_an_edited_verdict_is_caught_by_the_entry_that_records_it():
    write_sealed(1)
    verdict = Verdict.objects.create(operation="refund.create", outcome=Verdict.Outcome.HELD,
                                     amount_minor=900_000, currency="USD", hold_reasons=["APPROVAL_REQUIRED"])
    entry = record_audit(actor="agent:ag_1", action="refund.held", subject_type="refund", subject_id="rf_9",
                         data={"verdict_id": verdict.id})
    assert entry.records == [{"model": "audit.verdict", "pk": verdict.id, "digest": chain.row_digest(verdict)}]
    chain.seal_pending()
    verify()
    # What the worker writes after the decision is not part of it.
    Verdict.objects.filter(pk=verdict.pk).update(gateway_response={"status": "succeeded"})
    verify()
    Verdict.objects.filter(pk=verdict.pk).update(outcome=Verdict.Outcome.APPROVED, hold_reasons=[])
    with pytest.raises(CommandError, match=rf"audit entry #2 .* does not verify: the verdict {verdict.id} it "
                                           rf"records was altered"):
        verify()
    Verdict.objects.filter(pk=verdict.pk).delete()
    with pytest.raises(CommandError, match=rf"the verdict {verdict.id} it records is missing"):
        verify()


def test_an_edited_history_row_is_caught_by_the_entry_that_records_it():
    key, _ = make_agent_key()
    revoke_key(prefix=key.prefix, actor="user:root")
    entry = AuditEntry.objects.get(action="key.revoked")
    history = key.history.latest()
    assert {"model": "refundops.historicalagentkey", "pk": history.pk,
            "digest": chain.row_digest(history)} in entry.records
    chain.seal_pending()
    verify()
    type(history).objects.filter(pk=history.pk).update(revoked_at=None)
    with pytest.raises(CommandError, match=rf"the historical agent key {history.pk} it records was altered"):
        verify()


def test_an_entry_altered_before_it_was_sealed_is_left_out_and_named():
    entries = write(2)
    with as_table_owner():
        sql("UPDATE audit_auditentry SET actor = 'user:mallory' WHERE id = %s", [entries[0].pk])
    assert chain.seal_pending() == 1
    with pytest.raises(CommandError, match=r"audit entry \(unsealed, id \d+, .*rf_1\) does not verify: it was "
                                           r"altered or forged before it was sealed"):
        verify()


def test_entries_left_unsealed_too_long_fail_verification(settings):
    write_sealed(1)
    write(2, start=2)
    out, _ = verify()
    assert "2 entries wait to be sealed" in out
    settings.AUDIT_SEAL_GRACE_SECONDS = 0
    with pytest.raises(CommandError, match=r"audit entry \(unsealed, id \d+, refund.approved refund:rf_2\) does "
                                           r"not verify: 2 entries not sealed within 0 s of being written"):
        verify()


# PostgreSQL itself refuses

def test_postgresql_refuses_update_delete_and_truncate_on_the_audit_table():
    sealed = write_sealed(1)[0]
    pending = write(1, start=2)[0]
    assert "append-only" in refused("UPDATE audit_auditentry SET actor = 'user:mallory' WHERE id = %s", [sealed.pk])
    assert "append-only" in refused("UPDATE audit_auditentry SET seq = 9, hash = 'x' WHERE id = %s", [sealed.pk])
    assert "append-only" in refused("UPDATE audit_auditentry SET actor = 'user:mallory' WHERE id = %s",
                                    [pending.pk])
    assert "append-only" in refused("DELETE FROM audit_auditentry WHERE id = %s", [pending.pk])
    assert "append-only" in refused("DELETE FROM audit_auditentry")
    assert "append-only" in refused("TRUNCATE audit_auditentry")
    assert AuditEntry.objects.count() == 2
    with pytest.raises(ValueError, match="append-only"):
        sealed.delete()


# Concurrency: many writers, racing sealers, one gapless chain

@pytest.mark.django_db(transaction=True)
def test_concurrent_appends_from_many_threads_seal_into_one_gapless_chain():
    threads, per_thread = 12, 5

    def work(i: int) -> None:
        for j in range(per_thread):
            with transaction.atomic():
                record_audit(actor=f"agent:ag_{i}", action="refund.approved", subject_type="refund",
                             subject_id=f"rf_{i}_{j}")
            if j % 2:
                chain.seal_pending()

    race(threads, work)
    chain.seal_pending()
    entries = list(AuditEntry.objects.order_by("seq"))
    assert len(entries) == threads * per_thread
    assert [e.seq for e in entries] == list(range(1, threads * per_thread + 1))
    assert len({e.subject_id for e in entries}) == threads * per_thread
    out, _ = verify("--head", head())
    assert out.startswith(f"{threads * per_thread} audit entries checked; the chain verifies")


def test_beat_runs_the_sealer_every_few_seconds():
    schedule = {job["task"]: job["schedule"] for job in settings.CELERY_BEAT_SCHEDULE.values()}
    assert schedule["audit.tasks.seal_audit_log"].total_seconds() <= 10
    write(2)
    seal_audit_log.apply()
    assert list(AuditEntry.objects.order_by("seq").values_list("seq", flat=True)) == [1, 2]


# The head kept outside the database

def test_verify_audit_checks_against_an_exported_head_given_inline_or_in_a_file(tmp_path):
    write_sealed(3)
    kept = head()
    seq, digest = kept.split(":")
    assert seq == "3" and len(digest) == 64
    (tmp_path / "head").write_text(kept + "\n")
    assert verify("--head", kept)[0].startswith("3 audit entries checked; the chain verifies")
    write(2, start=4)
    chain.seal_pending()
    out, _ = verify("--head-file", str(tmp_path / "head"))
    assert out.startswith("5 audit entries checked; the chain verifies") and "head #3 matches" in out
    with pytest.raises(CommandError, match=r"entry #3 does not match the head kept outside the database"):
        verify("--head", f"3:{'0' * 64}")
    with pytest.raises(CommandError, match=r"--head: expected SEQ:HASH"):
        verify("--head", "nonsense")


def test_audit_head_seals_what_is_committed_before_it_prints():
    write(2)
    assert head() == f"2:{AuditEntry.objects.get(seq=2).hash}"


def test_an_empty_chains_head_is_zero_and_genesis():
    assert head() == f"0:{chain.GENESIS}"


def test_verify_audit_exits_non_zero_from_the_command_line():
    write_sealed(2)
    with as_table_owner():
        sql("UPDATE audit_auditentry SET action = 'refund.rejected' WHERE seq = 1")
    err = io.StringIO()
    with pytest.raises(SystemExit) as exited, contextlib.redirect_stderr(err):
        ManagementUtility(["manage.py", "verify_audit"]).execute()
    assert exited.value.code != 0 and "audit entry #1" in err.getvalue()


# The key comes from the environment

def test_production_mode_refuses_to_start_without_an_audit_key():
    env = {"PATH": "/usr/bin:/bin", "REFUNDOPS_ENV": "production", "DJANGO_SECRET_KEY": secrets.token_urlsafe(50),
           "DJANGO_SETTINGS_MODULE": "refundops.settings"}
    started = subprocess.run([sys.executable, "-c", "import django; django.setup()"], env=env,
                             cwd=settings.BASE_DIR, capture_output=True, text=True)
    assert started.returncode != 0 and "AUDIT_KEY" in started.stderr
    started = subprocess.run([sys.executable, "-c", "import django; django.setup()"],
                             env={**env, "AUDIT_KEY": "k" * 40}, cwd=settings.BASE_DIR,
                             capture_output=True, text=True)
    assert "AUDIT_KEY" not in started.stderr


def test_the_unsealed_grace_is_measured_from_when_the_entry_was_written(settings):
    entry = write(1)[0]
    settings.AUDIT_SEAL_GRACE_SECONDS = 60
    assert chain.overdue(now=entry.created_at + timedelta(seconds=59)) == []
    assert [e.pk for e in chain.overdue(now=entry.created_at + timedelta(seconds=61))] == [entry.pk]


def test_the_canonical_spelling_of_every_kind_of_value_is_pinned():
    """Digests of rows already in the chain are computed again at verification: the spelling may
    never change (these bytes are what the code before 2026-12-01's faster _plain produced)."""
    from datetime import date, datetime, time, timezone
    from decimal import Decimal
    from uuid import UUID

    from refundops.models import RefundState

    value = {"a": [1, 2.0, 2.5, None, True, "é", (3, 4.0),
                   {"x": Decimal("1.50"), "y": [datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone(timedelta(hours=2)))]}],
             1: "int key", None: "none key", False: "bool key", 2.0: "float key", "d": date(2026, 1, 2),
             "t": time(1, 2), "u": UUID(int=5), "b": b"\x01\x02", "s": RefundState.APPROVED, "n": {"deep": [[[1.0]]]}}
    assert chain.canonical(value) == (
        b'{"1":"int key","2.0":"float key","False":"bool key","None":"none key","a":[1,2,2.5,null,true,"\xc3\xa9",[3,4],'
        b'{"x":"1.5","y":["2026-01-02T01:04:05+00:00"]}],"b":"0102","d":"2026-01-02","n":{"deep":[[[1]]]},'
        b'"s":"approved","t":"01:02:00","u":"00000000-0000-0000-0000-000000000005"}')


# Verdicts that no act's entry records (issue 28, finding 10): dry runs, refusals before a refund
# row, replays. The sealer covers every verdict, so editing or deleting one fails verification.

def _verdict_no_act_records(api, kind: str) -> Verdict:
    payment = make_payment(amount=5_000)
    body = {"transaction_id": payment.pk, "amount": 100, "reason": "duplicate"}
    if kind == "dry run":
        response = post(api, "/api/v1/refunds/check", body)
    elif kind == "refusal":
        response = post(api, "/api/v1/refunds", {**body, "transaction_id": "txn_missing"})
    else:
        post(api, "/api/v1/refunds", body, key="same")
        post(api, "/api/v1/refunds", body, key="same")
        return Verdict.objects.get(deduplicated=True)
    data = response.json()
    verdict_id = data["verdict"]["id"] if "verdict" in data else data["error"]["verdict_id"]
    return Verdict.objects.get(pk=verdict_id)


@pytest.mark.parametrize("kind", ["dry run", "refusal", "replay"])
def test_a_verdict_no_act_records_is_covered_by_the_chain_edited_or_deleted(api, policy, kind):
    verdict = _verdict_no_act_records(api, kind)
    assert not any(r["pk"] == verdict.pk for e in AuditEntry.objects.all() for r in e.records)
    kept = head()  # seals what is committed: the verdicts too
    verify("--head", kept)
    Verdict.objects.filter(pk=verdict.pk).update(message="edited by hand", amount_minor=999_999)
    with pytest.raises(CommandError, match=rf"the verdict {verdict.pk} it records was altered"):
        verify("--head", kept)
    Verdict.objects.filter(pk=verdict.pk).delete()
    with pytest.raises(CommandError, match=rf"the verdict {verdict.pk} it records is missing"):
        verify("--head", kept)


def test_verdicts_left_uncovered_too_long_fail_verification(api, policy, settings):
    _verdict_no_act_records(api, "dry run")
    verify()  # within the grace: the sealer has not run yet
    settings.AUDIT_SEAL_GRACE_SECONDS = 0
    with pytest.raises(CommandError, match=r"1 verdict not covered by the chain within 0 s"):
        verify()
    head()
    verify()


def test_a_verdict_marked_covered_without_an_entry_recording_it_is_caught(api, policy):
    first = _verdict_no_act_records(api, "dry run")
    head()
    covering = Verdict.objects.get(pk=first.pk).chained_by
    forged = _verdict_no_act_records(api, "refusal")  # not yet covered: marked as if it were
    Verdict.objects.filter(pk=forged.pk).update(chained_by=covering)
    with pytest.raises(CommandError, match=r"2 verdicts say they are covered by audit entry .* which records 1"):
        verify()
    Verdict.objects.filter(pk=forged.pk).update(chained_by=uuid.uuid4())
    with pytest.raises(CommandError, match=r"1 verdict says it is covered by an audit entry that does not exist"):
        verify()


def test_the_sealer_task_covers_verdicts_and_a_decision_sends_no_extra_statement(api, policy):
    verdict = _verdict_no_act_records(api, "refusal")
    seal_audit_log()
    entry = AuditEntry.objects.get(action="verdicts.chained")
    assert entry.seq is not None and [r["pk"] for r in entry.records] == [verdict.pk]
    assert Verdict.objects.get(pk=verdict.pk).chained_by == entry.uid
    seal_audit_log()  # nothing new: no empty entry
    assert AuditEntry.objects.filter(action="verdicts.chained").count() == 1


def _swap(entries: list[AuditEntry], a: int, b: int) -> None:
    """Swap entries #a and #b = #a + 1, links and all (as test_reordered_entries_are_caught)."""
    first, second, before, after = entries[a - 1], entries[b - 1], entries[a - 2], entries[b]
    sql("UPDATE audit_auditentry SET seq = -seq WHERE id IN (%s, %s)", [first.pk, second.pk])
    sql("UPDATE audit_auditentry SET seq = %s, prev_hash = %s, hash = %s WHERE id = %s",
        [b, second.hash, after.prev_hash, first.pk])
    sql("UPDATE audit_auditentry SET seq = %s, prev_hash = %s, hash = %s WHERE id = %s",
        [a, before.hash, first.hash, second.pk])


@pytest.mark.parametrize(("tamper", "named"), [
    (("edit", 1), r"#1 .*entry #1 was altered"), (("edit", 4), r"#4 .*entry #4 was altered"),
    (("edit", 5), r"#5 .*entry #5 was altered"), (("edit", 8), r"#8 .*entry #8 was altered"),
    (("edit", 9), r"#9 .*entry #9 was altered"), (("edit", 10), r"#10 .*entry #10 was altered"),
    (("delete", 1), r"entry #2 follows #0"), (("delete", 4), r"entry #5 follows #3"),
    (("delete", 5), r"entry #6 follows #4"), (("delete", 8), r"entry #9 follows #7"),
    (("delete", 10), r"entries #10 to #10|entry #10 is missing"),
    (("swap", 4), r"audit entry #4 .*does not verify"), (("swap", 8), r"audit entry #8 .*does not verify"),
])
def test_tampering_at_and_across_a_chunks_edge_is_caught(tamper, named):
    """Review of issue 31: verify_audit now reads the chain in keyset chunks (here of 4: #1-#4,
    #5-#8, #9-#10); an edit, a deletion or a swap at either edge of a chunk, and at the chain's
    first and last entries, is named as it is within one chunk."""
    entries = write_sealed(10)
    kept = head()
    how, seq = tamper
    with as_table_owner():
        if how == "edit":
            sql("UPDATE audit_auditentry SET actor = 'user:mallory' WHERE seq = %s", [seq])
        elif how == "delete":
            sql("DELETE FROM audit_auditentry WHERE seq = %s", [seq])
        else:
            _swap(entries, seq, seq + 1)
    with pytest.raises(CommandError, match=named):
        verify("--chunk-size", "4", "--head", kept)


@pytest.mark.parametrize("at", [1, 4, 5, 8])
def test_an_edited_recorded_row_of_an_entry_at_a_chunks_edge_is_caught(at):
    """Review of issue 31: the rows a chunk's entries record are read a chunk at a time; the
    entry recording one at either edge of a chunk names it."""
    write(at - 1)
    key, _ = make_agent_key()
    revoke_key(prefix=key.prefix, actor="user:root")
    write(10, start=at)
    chain.seal_pending()
    entry = AuditEntry.objects.get(action="key.revoked")
    assert entry.seq == at and entry.records  # the entry that records the key's history row, at the edge
    verify("--chunk-size", "4")
    history = key.history.latest()
    type(history).objects.filter(pk=history.pk).update(revoked_at=None)
    with pytest.raises(CommandError, match=rf"audit entry #{entry.seq} .*the historical agent key {history.pk} "
                                           rf"it records was altered"):
        verify("--chunk-size", "4")


@pytest.mark.django_db(transaction=True)
def test_a_seal_committed_while_the_cover_is_read_is_no_fault(monkeypatch):
    """verify_audit reads the verdicts.chained entries, then the verdicts' marks: a sealer committing
    between the two (an entry and its marks, in one transaction) made a good chain fail with
    "covered by an audit entry that does not exist". Both are read in one snapshot."""
    write_sealed(1)
    Verdict.objects.create(operation="refund.create", outcome=Verdict.Outcome.HELD, amount_minor=900_000,
                           currency="USD", hold_reasons=["APPROVAL_REQUIRED"])
    read_entries = chain._chained_counts

    def then_the_sealer_commits():
        counts = read_entries()
        worker = threading.Thread(target=lambda: (chain.chain_verdicts(), connection.close()))
        worker.start()
        worker.join()
        return counts

    monkeypatch.setattr(chain, "_chained_counts", then_the_sealer_commits)
    assert chain._verdicts_fault() == ""
    assert Verdict.objects.filter(chained_by__isnull=False).count() == 1  # the sealer did commit in between
