"""A PgBouncer of the test's own, in transaction mode, in front of the test's PostgreSQL: Debian's
``pgbouncer`` (scripts/services installs it), started on a free local port and stopped after."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def pgbouncer(*, host: str = "127.0.0.1", port: int = 5432, user: str = "postgres", pool_size: int = 2,
              listen_port: int | None = None) -> Iterator[int]:
    """Run PgBouncer (transaction pooling, ``pool_size`` server sessions a database and user) in
    front of ``host:port``; yields the port it listens on. Its server sessions are handed out in
    turn (``server_round_robin``), as many processes at once make it do: threads of one Python
    process mostly find the session they just let go free again."""
    binary = shutil.which("pgbouncer") or "/usr/sbin/pgbouncer"
    assert os.path.exists(binary), "pgbouncer is not installed: run scripts/services (apt-get install pgbouncer)"
    listen_port = listen_port or _free_port()
    folder = Path(tempfile.mkdtemp(prefix="pgbouncer-"))
    (folder / "userlist.txt").write_text(f'"{user}" ""\n')
    (folder / "pgbouncer.ini").write_text(f"""[databases]
* = host={host} port={port}
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {listen_port}
unix_socket_dir =
auth_type = trust
auth_file = {folder}/userlist.txt
pool_mode = transaction
default_pool_size = {pool_size}
server_round_robin = 1
max_client_conn = 200
ignore_startup_parameters = extra_float_digits,options
server_reset_query =
logfile = {folder}/pgbouncer.log
""")
    command = [binary, str(folder / "pgbouncer.ini")]
    if os.geteuid() == 0:  # PgBouncer refuses to run as root
        folder.chmod(0o755)
        shutil.chown(folder, "postgres")
        for path in folder.iterdir():
            shutil.chown(path, "postgres")
        command[1:1] = ["-u", "postgres"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        for _ in range(100):
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", listen_port)) == 0:
                    break
            if process.poll() is not None:
                raise RuntimeError(f"pgbouncer exited: {process.stdout.read().decode()}")
            time.sleep(0.05)
        yield listen_port
    finally:
        process.terminate()
        process.wait(timeout=10)
        shutil.rmtree(folder, ignore_errors=True)
