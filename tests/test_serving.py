"""gunicorn's worker for refundops.asgi takes one new connection per wake-up of its event loop, and
the kernel's queue keeps gunicorn's backlog (refundops/serving.py; issue 11: with uvicorn's own
worker, 32 clients connecting at once all landed on one worker of four)."""

from __future__ import annotations

import asyncio
import json
import os
import runpy
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import uvicorn_worker

from refundops.serving import OneAcceptAtATime, UvicornWorker

ROOT = Path(__file__).resolve().parent.parent


class ListeningSocket:
    type = socket.SOCK_STREAM

    def __init__(self) -> None:
        self.listened: list[int] = []

    def listen(self, backlog: int) -> None:
        self.listened.append(backlog)


def test_the_worker_accepts_one_connection_per_wake_up_and_keeps_the_kernels_backlog(monkeypatch):
    """asyncio accepts up to the backlog it is given each time the socket is ready, and listens with
    it: the worker gives it 1 and keeps gunicorn's 2048 for the kernel. Fails before (uvicorn's
    worker): asyncio got 2048, so the first worker to wake took every waiting connection."""
    seen = {}

    async def uvicorns_serve(self) -> None:  # what uvicorn's Server does with them (asyncio's create_server)
        seen["backlog"] = self.config.backlog
        for sock in self.sockets:
            sock.listen(self.config.backlog)

    monkeypatch.setattr(uvicorn_worker.UvicornWorker, "_serve", uvicorns_serve)
    worker = object.__new__(UvicornWorker)
    listening = ListeningSocket()
    worker.cfg, worker.config, worker.sockets = SimpleNamespace(backlog=2048), SimpleNamespace(backlog=2048), [listening]
    asyncio.run(worker._serve())
    assert seen["backlog"] == 1
    assert listening.listened == [2048]
    assert isinstance(worker.sockets[0], OneAcceptAtATime) and worker.sockets[0].type == socket.SOCK_STREAM


def test_asyncio_accepts_as_many_as_its_backlog_per_wake_up_so_one_is_one():
    """The mechanism, on a real socket and loop: with 6 connections waiting, one wake-up of the loop
    for the listening socket accepts 6 when asyncio's backlog is 100 (uvicorn's worker: gunicorn's
    backlog), 1 when it is 1 (ours)."""
    def accepted_in_one_wake_up(backlog: int) -> int:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        clients = [socket.create_connection(listener.getsockname()) for _ in range(6)]
        loop = asyncio.new_event_loop()
        try:
            listener.setblocking(False)
            before = len(loop._selector.get_map()) if loop._selector else 0
            loop._accept_connection(asyncio.Protocol, OneAcceptAtATime(listener, 64), backlog=backlog)
            loop.run_until_complete(asyncio.sleep(0))
            return len(loop._selector.get_map()) - before  # each accepted connection is read from
        finally:
            for client in clients:
                client.close()
            loop.close()
            listener.close()

    assert accepted_in_one_wake_up(100) == 6
    assert accepted_in_one_wake_up(1) == 1


def test_gunicorn_conf_uses_the_worker(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["gunicorn", "refundops.asgi:application", "-c", "gunicorn.conf.py"])
    conf = runpy.run_path(str(ROOT / "gunicorn.conf.py"))
    assert conf["worker_class"] == "refundops.serving.UvicornWorker"
    # Django's standard command (the same file is read from the current folder): gunicorn's own worker.
    monkeypatch.setattr(sys, "argv", ["gunicorn", "refundops.wsgi:application"])
    assert "worker_class" not in runpy.run_path(str(ROOT / "gunicorn.conf.py"))


# In a new process: load the application as a server does, then count what a full collection has to
# look at (gc.get_objects()) and what it no longer does (frozen).
LOAD_AND_COUNT = """
import gc, importlib, json, sys
importlib.import_module(sys.argv[1])
generation = gc.get_objects()
print(json.dumps({"frozen": gc.get_freeze_count(), "scanned": len(generation)}))
"""


@pytest.mark.parametrize("entry", ["refundops.asgi", "refundops.wsgi"])
def test_what_the_server_loads_is_out_of_the_collectors_full_passes(entry):
    # A full pass over Django's and the apps' ~150,000 long-lived objects held the GIL ~0.1 s every
    # ~1,000 requests a process (docs/PERFORMANCE.md, "Garbage collection"); frozen, it sees only
    # what came after.
    environment = {**os.environ, "DATABASE_URL": "postgres://postgres@127.0.0.1:5432/refundops"}
    out = subprocess.run([sys.executable, "-c", LOAD_AND_COUNT, entry], cwd=ROOT, env=environment,
                         capture_output=True, text=True, check=True).stdout
    counted = json.loads(out.strip().splitlines()[-1])
    assert counted["frozen"] > 50_000
    assert counted["scanned"] < counted["frozen"] / 50
