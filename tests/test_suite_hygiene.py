"""The suite's own plumbing: two test processes never starve PostgreSQL; the fast tier's list is true."""

from __future__ import annotations

import ast
import fcntl
import subprocess
import sys
from pathlib import Path

import pytest
from django.test import TestCase, TransactionTestCase

from tests.conftest import DESELECTED, SLOW_MODULES, SLOW_TESTS, outside_the_test_database
from tests.slots import BIG_RACE, BIG_RACE_LOCK, big_race_slot

HOLD_THE_SLOT = (
    "import sys; from tests.slots import big_race_slot\n"
    "with big_race_slot(64):\n"
    "    print('in', flush=True); sys.stdin.readline()\n")


def test_a_big_race_in_another_process_keeps_the_slot_until_it_ends():
    holder = subprocess.Popen([sys.executable, "-c", HOLD_THE_SLOT], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "in"
        with open(BIG_RACE_LOCK, "a") as lock, pytest.raises(BlockingIOError):
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a second big race would wait here
        with big_race_slot(BIG_RACE):  # a small race never waits for the slot
            pass
    finally:
        holder.communicate("go\n", timeout=30)
    assert holder.returncode == 0
    with big_race_slot(64), open(BIG_RACE_LOCK, "a") as lock, pytest.raises(BlockingIOError):
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # ours now: held until the block ends


def test_every_slow_proof_named_in_conftest_exists(request):
    """A name left in the list after a rename would silently put its test back in the fast tier."""
    here = Path(__file__).parent
    assert all((here / f"{module}.py").exists() for module in SLOW_MODULES), SLOW_MODULES
    cases = set()
    for name in SLOW_TESTS:
        file, function = name.split("::")
        tree = ast.parse((here / file).read_text())
        assert function.split("[")[0] in {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}, name
        if "[" in function:
            cases.add(name)
    # One case of a parametrized test: its id must be one pytest collects. This run's collection
    # (every xdist worker collects the whole suite; a -m or -k deselects after collecting) has it
    # when the run named its file; else, and for any id it lacks, a collection of those files in a
    # process of its own (25 s of the suite's time under load, for ids this process already had).
    collected = {item.nodeid for item in request.session.items} | request.config.stash.get(DESELECTED, set())
    cases -= {nodeid.removeprefix("tests/") for nodeid in collected}
    if cases:
        files = sorted({name.split("::")[0] for name in cases})
        collected = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:xdist",
                                    "-p", "no:cacheprovider", *(str(here / file) for file in files)],
                                   cwd=here.parent, capture_output=True, text=True, timeout=300)
        ids = {line.removeprefix("tests/") for line in collected.stdout.splitlines()}
        assert cases <= ids, (sorted(cases - ids), collected.stdout[-2000:], collected.stderr[-2000:])


def test_the_slow_proofs_outside_the_database_lead_and_the_database_groups_keep_their_order(request):
    """The run's order: the slow tests that touch no test database first (so the harness runs are
    never the tail), then pytest-django's groups as it made them, never a test in a transaction
    after a transactional one (whose flush deletes what the migrations made)."""
    items = [item for item in request.session.items]
    leading = [outside_the_test_database(item) and item.get_closest_marker("slow") is not None for item in items]
    first_other = leading.index(False) if False in leading else len(leading)
    assert not any(leading[first_other:]), "a slow proof outside the database after the others"

    def group(item) -> int:  # as pytest-django's get_order_number
        if issubclass(getattr(item, "cls", None) or object, TransactionTestCase):
            return 0 if issubclass(item.cls, TestCase) else 1
        marker = item.get_closest_marker("django_db")
        fixtures = set(item.fixturenames)
        if (marker and (marker.kwargs.get("transaction") or marker.kwargs.get("reset_sequences"))) \
                or fixtures & {"transactional_db", "live_server"}:
            return 1
        return 0 if marker or "db" in fixtures else 2

    groups = [group(item) for item in items[first_other:]]
    assert groups == sorted(groups)
    chaos = [i for i, item in enumerate(items) if "test_chaos.py" in item.nodeid]
    assert all(i < first_other for i in chaos)  # when it runs (not in --fast), the harness leads
