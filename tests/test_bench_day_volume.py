"""bench/day_volume.py, briefly (two volumes, a few requests each): it grows the day's refunds to
each volume and reports every figure it promises. Never its figures: speed is not asserted here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parent.parent


def test_day_volume_bench_reports_full_and_floor_at_each_volume():
    base = urlsplit(os.environ.get("DATABASE_URL", "")).path.lstrip("/") or "refundops_test"
    answer = subprocess.run(
        [sys.executable, "bench/day_volume.py", "--volumes", "0,150", "--requests", "5",
         "--database", f"{base}_volume", "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=240)

    assert answer.returncode == 0, answer.stderr[-3000:]
    report = json.loads(answer.stdout)
    assert report["requests"] == 5
    first, second = report["volumes"]
    assert first["day_refunds"] < 150 <= second["day_refunds"]  # the copies reached the volume asked for
    for row in (first, second):
        for side in ("full", "floor"):
            assert set(row[side]) == {"p50_ms", "thread_ms", "backend_ms"}
            assert row[side]["p50_ms"] > 0 and row[side]["thread_ms"] > 0
        assert row["cpu_ratio"] > 0
