"""What a block of code sends PostgreSQL, counted on the wire: libpq's trace of Django's connection
(psycopg's ``PGconn.trace``). Each round trip ends with the server's ReadyForQuery, each statement
with a CommandComplete (or an ErrorResponse). Django's CaptureQueriesContext counts execute() calls
instead: one may carry several statements, and psycopg sends BEGIN in a round trip of its own before
a transaction's first statement, which Django logs when it turns autocommit off."""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


_MESSAGE = re.compile(r"^[FB]\t\d+\t[A-Za-z]+(\t|$)")


@dataclass
class Wire:
    round_trips: int = 0
    statements: int = 0
    lines: list[str] = field(default_factory=list)  # the trace, one message an item (a query's text whole)

    @property
    def trips(self) -> list[list[str]]:
        """The statements' texts each round trip sent: a simple Query's, or an extended one's Parse
        (server-side binding, pipeline mode), in order."""
        trips: list[list[str]] = [[]]
        for line in self.lines:
            sender, _, message, *rest = (line.split("\t", 3) + ["", "", ""])[:4]
            if sender == "F" and message in ("Query", "Parse"):
                text = rest[0].strip()
                trips[-1].append(text.split('" "', 1)[1] if message == "Parse" else text.strip('"'))
            elif sender == "B" and message == "ReadyForQuery":
                trips.append([])
        return [trip for trip in trips if trip] if trips[-1] else trips[:-1]

    @property
    def failed_trips(self) -> list[list[str]]:
        """The statements of each round trip PostgreSQL answered an error in."""
        failed, sent, erred = [], [], False
        for line in self.lines:
            sender, _, message, *rest = (line.split("\t", 3) + ["", "", ""])[:4]
            if sender == "F" and message in ("Query", "Parse"):
                text = rest[0].strip()
                sent.append(text.split('" "', 1)[1] if message == "Parse" else text.strip('"'))
            elif sender == "B" and message == "ErrorResponse":
                erred = True
            elif sender == "B" and message == "ReadyForQuery":
                if erred:
                    failed.append(sent)
                sent, erred = [], False
        return failed


@contextmanager
def on_the_wire(connection) -> Iterator[Wire]:
    """Count what ``connection`` (Django's, on psycopg 3) exchanges with PostgreSQL in the block.
    Linux only (libpq writes the trace through a C stream)."""
    from psycopg import pq

    connection.ensure_connection()
    pgconn = connection.connection.pgconn
    wire = Wire()
    with tempfile.TemporaryFile("w+") as file:
        stream = os.dup(file.fileno())  # libpq's stream over it is left open by psycopg's untrace
        pgconn.trace(stream)
        pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)
        try:
            yield wire
        finally:
            pgconn.untrace()  # flushes the stream
            os.close(stream)
            file.seek(0)
            for line in file.read().splitlines():  # a query's text may span lines
                if _MESSAGE.match(line) or not wire.lines:
                    wire.lines.append(line)
                else:
                    wire.lines[-1] += "\n" + line
    for line in wire.lines:
        sender, _, message = (line.split("\t") + ["", "", ""])[:3]
        if sender == "B" and message == "ReadyForQuery":
            wire.round_trips += 1
        elif sender == "B" and message in ("CommandComplete", "ErrorResponse"):
            wire.statements += 1
