"""The real parts the bench harnesses run on (bench/chaos.py, bench/drain.py): a migrated database of
their own, a private ``redis-server`` on a free port, ``celery -A refundops worker`` subprocesses."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def migrations_digest() -> str:
    """Of every migration file: a migrated copy kept under this name is still what migrate would make."""
    digest = hashlib.sha1()
    for path in sorted(ROOT.glob("*/migrations/*.py")):
        digest.update(str(path.relative_to(ROOT)).encode() + path.read_bytes())
    return digest.hexdigest()[:10]


def create_migrated_database(url: str, env: dict[str, str]) -> None:
    """The run's database, fresh and migrated: a copy of a migrated template kept beside it (made by
    the first run after any migration changes; ``migrate`` under load takes a minute)."""
    import psycopg

    parts = urlsplit(url)
    name = parts.path.lstrip("/")
    template = f"{name}_tpl_{migrations_digest()}"[:63]
    admin = urlunsplit(parts._replace(path="/postgres"))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        have = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", [template]).fetchone()
        if have:
            conn.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
            return
        conn.execute(f'CREATE DATABASE "{name}"')
    subprocess.run([sys.executable, "manage.py", "migrate", "--noinput", "-v", "0"], cwd=ROOT,
                   env={**env, "DATABASE_URL": url}, check=True)
    with psycopg.connect(admin, autocommit=True) as conn:
        stale = conn.execute("SELECT datname FROM pg_database WHERE datname LIKE %s",
                             [f"{name}_tpl_%"]).fetchall()
        for (old,) in stale:  # templates of migrations since changed
            conn.execute(f'DROP DATABASE IF EXISTS "{old}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{template}" TEMPLATE "{name}"')


def drop_database(url: str) -> None:
    import psycopg

    if "django" in sys.modules:
        from django.db import connections

        connections.close_all()
    parts = urlsplit(url)
    with psycopg.connect(urlunsplit(parts._replace(path="/postgres")), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{parts.path.lstrip("/")}" WITH (FORCE)')


class PrivateRedis:
    """A redis-server of the harness's own on a free port, no persistence: a restart loses everything."""

    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.workdir), "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        import redis

        client = redis.Redis(port=self.port, socket_connect_timeout=0.2)
        for _ in range(100):
            try:
                if client.ping():
                    return
            except redis.RedisError:
                time.sleep(0.05)
        raise RuntimeError("private redis-server did not answer")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
        self.proc = None


class Workers:
    """``celery -A refundops worker`` subprocesses on ``queues``, each in its own process group: by
    default a pool of 4 threads each (the fault harness); ``pool``/``concurrency`` as deployed."""

    def __init__(self, count: int, env: dict[str, str], logdir: Path, queues: list[str], *,
                 pool: str = "threads", concurrency: int = 4, name: str = "chaos",
                 extra: Sequence[str] = ()) -> None:
        self.env, self.logdir, self.queues = env, logdir, queues
        self.pool, self.concurrency, self.name, self.extra = pool, concurrency, name, list(extra)
        self.procs: list[subprocess.Popen | None] = [None] * count
        self.started = 0

    def start(self, slot: int) -> None:
        self.started += 1
        logfile = open(self.logdir / f"worker{slot}-{self.started}.log", "wb")  # noqa: SIM115
        self.procs[slot] = subprocess.Popen(
            [sys.executable, "-m", "celery", "-A", "refundops", "worker", "-Q", ",".join(self.queues),
             "--pool", self.pool, "--concurrency", str(self.concurrency), "--loglevel", "WARNING",
             "--without-gossip", "--without-mingle", "--without-heartbeat",
             "-n", f"{self.name}{slot}-{self.started}@%h", *self.extra],
            cwd=ROOT, env=self.env, stdout=logfile, stderr=subprocess.STDOUT, start_new_session=True)

    def start_all(self) -> None:
        for slot in range(len(self.procs)):
            self.start(slot)

    def kill(self, slot: int) -> None:
        proc = self.procs[slot]
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the worker and every thread of it, mid-work
            proc.wait()
        self.procs[slot] = None

    def ensure_running(self) -> None:
        for slot, proc in enumerate(self.procs):
            if proc is None or proc.poll() is not None:
                self.start(slot)

    def stop_all(self) -> None:
        for slot in range(len(self.procs)):
            self.kill(slot)

    def shut_down_all(self, *, timeout: float = 30) -> None:
        """A warm shutdown (SIGTERM: finish the task at hand, acknowledge it), SIGKILL past ``timeout``."""
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for slot, proc in enumerate(self.procs):
            if proc is not None:
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    pass
            self.kill(slot)
