"""The fault harness, bounded: 200 refunds end to end while 24 faults are injected (workers
SIGKILLed, the gateway timing out after acting, duplicates at once, webhooks twice or lost, dropped
connections, Redis restarted, the merchant down), then every invariant of bench/chaos.py.

The merchant endpoint subscribes to approvals and outcomes (``--events money``) to fit the budget.
It runs the harness as a subprocess: its own database (this run's name with ``_chaos``), its own
redis-server on a free port, real ``celery worker`` processes. Budget: under 3 minutes on 2 cores.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KINDS = ["worker_kill", "gateway_timeout_after_acting", "duplicate_submission", "webhook_twice", "webhook_lost",
         "gateway_unreachable", "redis_restart", "merchant_down"]

def test_two_hundred_refunds_under_two_dozen_faults_keep_the_books_exact():
    answer = subprocess.run(
        [sys.executable, "bench/chaos.py", "--refunds", "200", "--faults", "24", "--seed", "8", "--seconds", "20",
         "--workers", "4",
         "--drain-seconds", "100", "--events", "money", "--kinds", ",".join(KINDS), "--json"],
        cwd=ROOT, capture_output=True, text=True, timeout=240)

    assert answer.stdout, answer.stderr[-3000:]
    report = json.loads(answer.stdout)
    assert report["refunds_asked"] >= 200 and report["refunds"] >= 200
    assert report["faults"] >= 20 and set(report["faults_by_kind"]) == set(KINDS), report["faults_by_kind"]
    assert report["refunds_by_status"].get("settled", 0) > 100  # the run paid refunds, not only refused them
    assert report["reconcile"]["exit"] == 0 and report["reconcile"]["checked"] == report["payments"]
    assert report["violations"] == 0, json.dumps(report["violation_details"], indent=1)[:5000]
    assert answer.returncode == 0
