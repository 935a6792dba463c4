"""`scripts/run` as a newcomer runs it: it decides from the database, never from var/demo.json, checks
its port first, and says plainly when a part did not start. (Issue 13, finding 1.)

Each start is a real `scripts/run` in a process group of its own, with its own var directory and a
free port; the test reads its banner, uses the key and a login it printed, and stops it."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from pathlib import Path

import pytest
from django.conf import global_settings, settings
from django.contrib.admin.utils import unquote as admin_unquote
from django.core.management import call_command
from django.test import override_settings

from refundops.models import Refund, RefundState

ROOT = Path(__file__).resolve().parent.parent
BANNER_END = "Ctrl-C stops."
# The sandbox settles a refund 5 s after it is sent (demo_data), the worker looks 6 s after sending.
SETTLES_WITHIN = 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def database_url() -> str:
    db = settings.DATABASES["default"]
    return f"postgres://{db['USER']}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}"


class Run:
    """One `scripts/run`, read line by line until its banner ends or it exits."""

    def __init__(self, var: Path, port: int, **env: str):
        environment = {k: v for k, v in os.environ.items()
                       if k not in ("DATABASE_URL", "REDIS_URL", "REDIS_KEY_PREFIX", "DATABASE_POOL",
                                    "CELERY_TASK_ALWAYS_EAGER")}
        environment.update(REFUNDOPS_VAR_DIR=str(var), PORT=str(port), **env)
        self.port, self.var = port, var
        self.process = subprocess.Popen(["scripts/run"], cwd=ROOT, env=environment, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.output = ""

    def read_until_banner_or_exit(self, timeout: float = 300) -> str:
        deadline = time.monotonic() + timeout
        for line in self.process.stdout:
            self.output += line
            if BANNER_END in line or time.monotonic() > deadline:
                break
        return self.output

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)  # the group this test started
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()

    def logs(self) -> str:
        """The end of the web's and the worker's logs, for a failure's message."""
        var = Path(self.var)
        return "\n".join(f"--- {name}\n" + "\n".join((var / name).read_text().splitlines()[-30:])
                         for name in ("web.log", "worker.log") if (var / name).exists())

    def key(self) -> str:
        return re.search(r"Agent key\s+(rk_\S+)", self.output).group(1)

    def api(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/api/v1/{path}", method=method,
            data=json.dumps(body).encode() if body is not None else None,
            headers={"Authorization": f"Bearer {self.key()}", "Content-Type": "application/json",
                     "Idempotency-Key": uuid.uuid4().hex})
        try:
            with urllib.request.urlopen(request, timeout=30) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    def sign_in(self, username: str, password: str):
        """(a urllib opener holding the admin session, the page the sign-in landed on)."""
        import http.cookiejar
        jar = http.cookiejar.CookieJar()
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
        base = f"http://127.0.0.1:{self.port}"
        page = opener.open(f"{base}/admin/login/", timeout=30).read().decode()
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1)
        data = f"csrfmiddlewaretoken={token}&username={username}&password={password}&next=/admin/".encode()
        answer = opener.open(urllib.request.Request(f"{base}/admin/login/?next=/admin/", data=data,
                                                    headers={"Referer": f"{base}/admin/login/"}), timeout=30)
        return opener, answer

    def admin_login_works(self, username: str, password: str) -> bool:
        _, answer = self.sign_in(username, password)
        return answer.geturl().rstrip("/").endswith("/admin") and "Log out" in answer.read().decode()

    def approve_first_held_refund(self, username: str, password: str) -> str:
        """As an approver does: the held queue's first Approve button. Returns the refund's id."""
        opener, _ = self.sign_in(username, password)
        base = f"http://127.0.0.1:{self.port}"
        page = opener.open(f"{base}/admin/refundops/refund/held/", timeout=30).read().decode()
        action = re.search(r'<form method="post" action="(/admin/refundops/refund/([^/"]+)/approve/)">', page)
        assert action, page
        token = re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', page).group(1)
        data = urllib.parse.urlencode({"csrfmiddlewaretoken": token, "note": "checked the order"}).encode()
        opener.open(urllib.request.Request(base + action.group(1), data=data,
                                           headers={"Referer": f"{base}/admin/refundops/refund/held/"}), timeout=30)
        return admin_unquote(action.group(2))  # the admin's quoting: _5F is _

    def status_within(self, refund_id: str, seconds: float, wanted: str) -> str:
        """The refund's status once it is ``wanted``, or the last one seen ``seconds`` after asking."""
        deadline = time.monotonic() + seconds
        while True:
            status, body = self.api("GET", f"refunds/{refund_id}")
            assert status == 200, body
            if body["refund"]["status"] == wanted or time.monotonic() > deadline:
                return body["refund"]["status"]
            time.sleep(0.25)


def check_the_banner_tells_the_truth(run: Run) -> None:
    output = run.read_until_banner_or_exit()
    assert "RefundOps is running" in output, output
    fresh = re.search(r'"transaction_id": "(txn_\w+)"', output).group(1)
    status, body = run.api("GET", f"payments/{fresh}")
    assert status == 200, body  # the key printed works on this database, and the example payment is in it
    status, body = run.api("POST", "refunds", {"transaction_id": fresh, "amount": 100, "reason": "customer_request"})
    assert status in (200, 201) and body["verdict"]["outcome"] == "approved", body  # the example refund goes through
    # ... and reaches the sandbox and settles, sent on its commit (not by a sweep minutes later).
    assert run.status_within(body["refund"]["id"], SETTLES_WITHIN, "settled") == "settled", run.logs()
    login = re.search(r"login (\S+)\s+password (\S+)", output)
    assert run.admin_login_works(login.group(1), login.group(2)), output
    # The admin's styles, served by refundops.asgi itself (no WhiteNoise in the chain under uvicorn).
    with urllib.request.urlopen(f"http://127.0.0.1:{run.port}/static/admin/css/base.css", timeout=30) as css:
        assert css.status == 200 and css.headers["Content-Type"].startswith("text/css")
        assert css.headers["Cache-Control"] == "max-age=60, public" and css.headers["ETag"]
    assert "uuidgen" not in output  # absent on Debian slim


def check_a_held_refund_approved_in_the_admin_settles(run: Run) -> None:
    refund_id = run.approve_first_held_refund("approver", "refundops-demo")
    assert run.status_within(refund_id, SETTLES_WITHIN, "settled") == "settled", run.logs()


def test_embedded_mode_prints_a_banner_its_database_accepts_and_refunds_settle(tmp_path):
    """The README's refund, and a held one approved in the admin, settle at the sandbox within
    seconds. (Issue 29, finding 1: embedded mode's outbox claim failed on SQLite.) No test database:
    SQLite in the var directory, so this start runs beside the database tests, not after them."""
    run = Run(tmp_path, free_port())
    try:
        check_the_banner_tells_the_truth(run)
        check_a_held_refund_approved_in_the_admin_settles(run)
        assert "Traceback" not in (tmp_path / "worker.log").read_text()  # beat's relay runs clean
    finally:
        run.stop()
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.django_db(transaction=True)
def test_on_postgresql_the_banner_its_database_accepts_and_refunds_settle_past_an_earlier_starts_key(tmp_path):
    # An earlier start in embedded mode left var/demo.json behind: a key this database never issued.
    stale = {"agent": {"id": 1, "name": "support-bot", "key": "rk_" + uuid.uuid4().hex, "key_prefix": "rk_stale"}}
    (tmp_path / "demo.json").write_text(json.dumps(stale))
    run = Run(tmp_path, free_port(), DATABASE_URL=database_url(), REDIS_URL=settings.REDIS_URL,
              REDIS_KEY_PREFIX=settings.REDIS_KEY_PREFIX)
    try:
        check_the_banner_tells_the_truth(run)
        assert run.key() != stale["agent"]["key"]
        # An approver's first look at the queue shows the job.
        assert Refund.objects.filter(status=RefundState.HELD).count() >= 2
        check_a_held_refund_approved_in_the_admin_settles(run)
    finally:
        run.stop()


@pytest.mark.django_db(transaction=True)
def test_a_database_with_data_and_no_demo_json_starts_and_prints_what_the_database_holds(tmp_path):
    # The database as an earlier start left it (its demo data, made by the command scripts/run runs
    # on an empty database), and no var/demo.json: a whole first scripts/run (install check,
    # migrate, collectstatic, web and worker up and down) only to get here cost ~45 s under load.
    # With Django's own hashers, as scripts/run's processes check the demo logins (the suite's MD5 is
    # not among theirs).
    with override_settings(PASSWORD_HASHERS=global_settings.PASSWORD_HASHERS):
        call_command("demo_data", "--if-empty", "--output", str(tmp_path / "demo.json"), stdout=io.StringIO())
    assert Refund.objects.exists()
    for leftover in tmp_path.glob("demo.json*"):
        leftover.unlink()

    run = Run(tmp_path, free_port(), DATABASE_URL=database_url(), REDIS_URL=settings.REDIS_URL,
              REDIS_KEY_PREFIX=settings.REDIS_KEY_PREFIX)
    try:
        check_the_banner_tells_the_truth(run)
        assert "FileNotFoundError" not in run.output and "Traceback" not in run.output
    finally:
        run.stop()
    assert not list(tmp_path.glob("*.tmp"))


def test_a_taken_port_stops_the_start_with_a_plain_message(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        run = Run(tmp_path, port)
        try:
            output = run.read_until_banner_or_exit(timeout=120)
            code = run.process.wait(timeout=60)
        finally:
            run.stop()
    assert code != 0
    assert "RefundOps is running" not in output
    assert f"127.0.0.1:{port} is already in use" in output, output
