"""CPU time of the processes a benchmark run keeps busy, read from ``/proc`` (Linux) before and after
it: the server (gunicorn's master and every process under it, each with all its threads), the
PostgreSQL backends connected to the benchmark's database, Redis, and the load generator (wrk, a
child of the driver). On two cores a run is CPU-bound, so these are what a request costs and
where: the throughput is the cores divided by their sum.

Not counted: PostgreSQL's own background processes (the WAL writer, the checkpointer), the driver's
Python, a process that ends within the round. Redis is the whole server: on a machine where other
checkouts use it at the same time, its figure includes theirs. PostgreSQL and Redis must run on this
host (in a container their pids are not this ``/proc``'s)."""

from __future__ import annotations

import os
import resource
from collections.abc import Callable
from pathlib import Path

PROC = Path("/proc")
TICKS = os.sysconf("SC_CLK_TCK")


def _stat(pid: int | str) -> list[str] | None:
    """The fields of ``/proc/<pid>/stat`` after the process's name (state first); None once it is gone."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()  # the name, in parentheses, may hold spaces and ")"


def process_seconds(pid: int) -> float | None:
    """User and system CPU seconds of process ``pid`` and all its threads; None once it is gone."""
    fields = _stat(pid)
    return None if fields is None else (int(fields[11]) + int(fields[12])) / TICKS


def descendants(root: int) -> set[int]:
    """``root`` and every process under it."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit() and (fields := _stat(entry.name)) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo.extend(children.get(pid, ()))
    return found


def children_seconds() -> float:
    """CPU seconds of the driver's children that have been waited for (wrk, run to its end)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


class Meter:
    """CPU seconds by part, between ``start()`` and ``stop()``. ``parts`` maps a part's name to a
    function giving its pids at that moment; a process that starts in between counts from zero,
    one that ends in between is lost (none should: connections are kept, workers live)."""

    def __init__(self, parts: dict[str, Callable[[], set[int]]]) -> None:
        self.parts = parts
        self.before: dict[str, dict[int, float]] = {}
        self.children_before = 0.0

    def _read(self) -> dict[str, dict[int, float]]:
        readings: dict[str, dict[int, float]] = {}
        for name, pids in self.parts.items():
            readings[name] = {pid: s for pid in pids() if (s := process_seconds(pid)) is not None}
        return readings

    def start(self) -> None:
        self.before, self.children_before = self._read(), children_seconds()
        self.latest = {name: dict(pids) for name, pids in self.before.items()}

    def sample(self) -> None:
        """Read every part now: a process that ends before ``stop()`` (a database connection closed
        and opened again) then counts up to its last sample rather than not at all."""
        for name, pids in self._read().items():
            self.latest.setdefault(name, {}).update(pids)

    def stop(self) -> dict[str, float]:
        after = self._read()
        for name, pids in getattr(self, "latest", {}).items():
            after[name] = {**pids, **after.get(name, {})}
        spent = {name: sum(max(s - self.before.get(name, {}).get(pid, 0.0), 0.0) for pid, s in pids.items())
                 for name, pids in after.items()}
        spent["wrk"] = children_seconds() - self.children_before
        return spent


def available() -> bool:
    return (PROC / "self" / "stat").exists()
