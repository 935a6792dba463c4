"""The benches' fast seeder (bench/fast_chain.py) writes chains that verify_audit accepts, with real
MACs, links and recorded digests: a chain that only looked right would fail here, and an edit of a
recorded row is found. Small chains; never a speed."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

import psycopg
import pytest

ROOT = Path(__file__).resolve().parent.parent
PG = "postgres://postgres@127.0.0.1:5432"

# verify_chain in two processes on a small chain (parallel.MIN_ENTRIES lowered), printing its last word.
PARALLEL = ("import django; django.setup(); from audit import parallel; parallel.MIN_ENTRIES = 0; "
            "from audit.chain import verify_chain; print(list(verify_chain(processes=2))[-1][2])")


def _database(suffix: str) -> str:
    base = urlsplit(os.environ.get("DATABASE_URL", "")).path.lstrip("/") or "refundops_test"
    return f"{base}_{suffix}"


def _run(args: list[str], database: str) -> str:
    env = {**os.environ, "BENCH_DATABASE": database, "DATABASE_URL": f"{PG}/{database}",
           "DJANGO_SETTINGS_MODULE": "refundops.settings"}
    done = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def _verify(database: str) -> tuple[str, str]:
    """What verify_audit says in one process (Django's walk) and in two (the workers' reading)."""
    return (_run(["manage.py", "verify_audit", "--processes", "1"], database).strip().splitlines()[-1],
            _run(["-c", PARALLEL], database).strip().splitlines()[-1])


def _tamper(database: str, sql: str) -> None:
    with psycopg.connect(f"{PG}/{database}") as conn:
        conn.execute("SET session_replication_role = replica")  # past the append-only triggers, as an intruder
        assert conn.execute(sql).rowcount == 1


def _drop(database: str) -> None:
    with psycopg.connect(f"{PG}/postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")


@pytest.mark.parametrize("bench, refunds, tamper, found", [
    ("bench/evidence_pack.py", 6_000,
     "UPDATE audit_verdict SET amount_minor = amount_minor + 1 WHERE id = 'vd_' || substr(md5('v5999'), 1, 24)",
     "was altered"),
    ("bench/verify_audit.py", 2_000,
     "UPDATE refundops_historicalrefund SET amount_minor = amount_minor + 1 WHERE history_id = "
     "(SELECT min(history_id) FROM refundops_historicalrefund WHERE history_type = '~' AND history_id > 4000)",
     "was altered"),
])
def test_a_fast_seeded_chain_verifies_and_an_edited_record_is_found(bench, refunds, tamper, found):
    database = _database(f"fastchain_{Path(bench).stem}")  # one each: the cases may run at once
    try:
        out = _run([bench, "--refunds", str(refunds), "--seed-only"], database)
        assert "sealed" in out
        one, two = _verify(database)
        assert one.endswith("the chain verifies."), one
        assert two == "ok"
        with psycopg.connect(f"{PG}/{database}") as conn:
            entries, unsealed, covers = conn.execute(
                "SELECT count(*), count(*) FILTER (WHERE seq IS NULL), count(*) FILTER (WHERE action = "
                "'verdicts.chained') FROM audit_auditentry").fetchone()
            uncovered = conn.execute("SELECT count(*) FROM audit_verdict WHERE chained_by IS NULL").fetchone()[0]
        assert entries >= refunds and unsealed == 0 and covers >= 1 and uncovered == 0
        _tamper(database, tamper)
        one, two = _verify_failing(database)
        assert found in one and found in two, (one, two)
    finally:
        _drop(database)


def _verify_failing(database: str) -> tuple[str, str]:
    env = {**os.environ, "DATABASE_URL": f"{PG}/{database}", "DJANGO_SETTINGS_MODULE": "refundops.settings"}
    single = subprocess.run([sys.executable, "manage.py", "verify_audit", "--processes", "1"], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert single.returncode != 0
    return single.stdout + single.stderr, _run(["-c", PARALLEL], database).strip().splitlines()[-1]
