"""bench/locks.py, briefly (2 clients, 1 s per scenario): it runs and reports every figure it
promises, in the shape docs/PERFORMANCE.md reads. Never its figures: speed is not asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent


def test_lock_bench_reports_waits_holds_and_latency_per_scenario_and_client():
    # A database of this checkout's own (scripts/test names one per checkout), dropped and made anew.
    base = urlsplit(os.environ.get("DATABASE_URL", "")).path.lstrip("/") or "refundops_test"
    answer = subprocess.run(
        [sys.executable, "bench/locks.py", "--clients", "2", "--seconds", "1", "--warmup", "0.5",
         "--per-client", "300", "--database", f"{base}_locks", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=240)

    assert answer.returncode == 0, answer.stderr[-3000:]
    report = json.loads(answer.stdout)
    assert report["clients"] == 2 and set(report["scenarios"]) == {"spread", "same"}
    for name, scenario in report["scenarios"].items():
        assert scenario["customers"] == (2 if name == "spread" else 1) and scenario["agents"] == 2
        assert scenario["approved"] > 0 and scenario["errors"] == {} and not scenario["exhausted"]
        assert {"throughput_rps", "p50_ms", "p99_ms", "window_s"} <= set(scenario)
        assert scenario["sampler"]["samples"] > 0
        wait = scenario["lock_wait"]
        assert {"mean_share", "total_s", "by_event_s", "logged"} <= set(wait)
        assert [c["client"] for c in scenario["per_client"]] == [0, 1]
        for c in scenario["per_client"]:
            assert {"requests", "lock_wait_share", "lock_wait_s", "logged_waits", "logged_wait_s"} <= set(c)
            assert 0 <= c["lock_wait_share"] <= 1
        for figures in scenario["lock_functions"].values():
            assert {"calls", "call_p50_ms", "call_p99_ms", "hold_p50_ms", "hold_p99_ms", "hold_share"} <= set(figures)
        for lock in scenario["shared_locks"]:
            assert {"lock", "held_share", "exclusive_share", "max_holders_at_once", "sampled_hold_mean_ms",
                    "waited_share", "max_waiters_at_once", "wait_s"} <= set(lock)
        assert any(lock["lock"].startswith("row of ") for lock in scenario["shared_locks"])  # listed even if idle
