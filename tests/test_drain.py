"""The drain benchmark (bench/drain.py), bounded: 20 approved refunds asked through the service,
drained by one real ``celery worker`` process from a private Redis against the sandbox at zero
delay, beside its floor; it must settle them all, pay each exactly once by the sandbox's own books,
and print its figures; the worker keeps one database connection across tasks. Speed is the
benchmark's to print, never a test's to assert."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent


def drain(*args: str) -> subprocess.CompletedProcess:
    name = urlsplit(os.environ.get("DATABASE_URL", "")).path.lstrip("/") or "refundops"
    return subprocess.run([sys.executable, "bench/drain.py", "--refunds", "20", "--processes", "1",
                           "--database", f"{name}_drain", "--drain-seconds", "120", *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_drain_settles_every_refund_once_and_prints_its_figures():
    answer = drain("--json", "--env", "DATABASE_CONN_MAX_AGE=600")

    assert answer.stdout, answer.stderr[-3000:]
    report = json.loads(answer.stdout)
    (run,) = report["runs"]
    assert run["processes"] == 1
    for side in ("full", "floor"):
        assert run[side]["refunds"] == run[side]["settled"] == 20, run
        assert run[side]["per_second"] > 0 and run[side]["seconds"] > 0, run
    assert run["ratio"] > 0
    # The worker process keeps its connection from task to task when CONN_MAX_AGE says so (Celery's
    # own fixup would close it around every task): 20 refunds, one connection, not 20.
    assert run["full"]["connections"] == run["floor"]["connections"] == 1, run
    assert report["checked"] == {"refunds": 20, "sandbox_refunds": 20, "floor_refunds": 20}
    assert report["exactly_once"] is True and report["violations"] == 0, report["violation_details"]
    assert answer.returncode == 0
    assert "settled" in answer.stderr  # progress and each run's figure, as it goes
