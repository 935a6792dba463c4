"""bench/cpu.py: the CPU a benchmark round charges to each part (bench/refunds.py prints it a request).
What it reads must be the processes' own: a busy grandchild counts to its tree, an idle process
counts nothing, a waited child counts as the load generator."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from bench import cpu

BUSY = "import time\nend = time.process_time() + {seconds}\nwhile time.process_time() < end: pass\n"


def test_a_process_tree_is_charged_with_its_descendants_cpu_and_an_idle_one_with_none():
    # A parent that starts a busy child, as gunicorn's master starts its workers.
    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys; subprocess.run([sys.executable, '-c', " + repr(BUSY.format(seconds=2)) + "])")],
                              start_new_session=True)
    idle = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.3)  # both started; the child is busy (for 2 s of CPU)
        meter = cpu.Meter({"tree": lambda: cpu.descendants(parent.pid), "idle": lambda: {idle.pid}})
        meter.start()
        window = time.monotonic()
        assert len(cpu.descendants(parent.pid)) == 2
        time.sleep(0.4)
        spent = meter.stop()
        window = time.monotonic() - window
    finally:
        os.killpg(parent.pid, signal.SIGKILL)  # the busy child too
        idle.kill()
        for process in (parent, idle):
            process.wait()

    # Its busy loop ran in the window: charged, and never more than the window's own length (one
    # thread on one core), however busy the machine is (no CPU-time window, which load would break).
    assert 0 < spent["tree"] <= window + 0.02, (spent, window)
    assert spent["idle"] < 0.05, spent
    assert spent["wrk"] < 0.05, spent  # no child was waited for in the window


def test_a_waited_child_is_charged_as_the_load_generator_and_a_gone_process_reads_none():
    meter = cpu.Meter({})
    meter.start()
    subprocess.run([sys.executable, "-c", BUSY.format(seconds=0.3)], check=True)
    spent = meter.stop()

    assert spent["wrk"] >= 0.3, spent  # its loop ran until it had spent 0.3 s, the interpreter's start on top
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert cpu.process_seconds(child.pid) is None
    assert cpu.process_seconds(os.getpid()) > 0
