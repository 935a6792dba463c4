"""Slots the suite's processes share on one machine (no Django here: subprocesses import it bare)."""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator

# A race of more threads than this holds one connection each: two such races at once in two xdist
# workers (or two checkouts' suites) pass PostgreSQL's default max_connections of 100.
BIG_RACE = 16
BIG_RACE_LOCK = "/tmp/refundops-tests-big-race.lock"


@contextlib.contextmanager
def big_race_slot(n: int) -> Iterator[None]:
    """One big race at a time on this machine, across processes (an flock on a shared file)."""
    if n <= BIG_RACE:
        yield
        return
    with open(BIG_RACE_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
