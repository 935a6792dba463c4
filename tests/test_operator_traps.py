"""The operator's first hour: what stops a start says in one line what happened and what to set;
Django's standard `gunicorn refundops.wsgi:application` serves; development installs what the image
installs. (Issue 29, finding 3.)"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from importlib import metadata
from pathlib import Path

import pytest
from django.conf import settings

ROOT = Path(__file__).resolve().parent.parent
PYTHON = str(ROOT / ".venv" / "bin" / "python")
CELERY = str(ROOT / ".venv" / "bin" / "celery")


def environment(**extra: str) -> dict[str, str]:
    """This process's environment without what the suite sets for its own database and broker."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("DATABASE_", "REDIS_", "CELERY_", "REFUNDOPS_", "DJANGO_"))}
    env.update(extra)
    return env


def production_without_secrets() -> dict[str, str]:
    return environment(REFUNDOPS_ENV="production", REFUNDOPS_VAR_DIR="/tmp")


@pytest.mark.parametrize("command", [
    [PYTHON, "manage.py", "migrate", "--noinput"],
    [PYTHON, "-c", "import refundops.wsgi"],
    [PYTHON, "-c", "import refundops.asgi"],
    [CELERY, "-A", "refundops", "worker"],
    [CELERY, "-A", "refundops", "beat"],
], ids=["manage.py", "wsgi", "asgi", "celery worker", "celery beat"])
def test_a_configuration_error_is_one_line_saying_what_to_set(command):
    done = subprocess.run(command, cwd=ROOT, env=production_without_secrets(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "Traceback" not in done.stderr and "DJANGO_SECRET_KEY" in lines[0]


def test_scripts_run_after_cp_env_example_says_what_happened_and_what_to_do(tmp_path):
    """`cp .env.example .env` (the README's step for compose), then `scripts/run`: production mode
    from .env, which scripts/run (development) cannot start in. One line names .env and the way out."""
    checkout = tmp_path / "checkout"
    (checkout / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "run", checkout / "scripts" / "run")
    shutil.copy(ROOT / ".env.example", checkout / ".env")
    done = subprocess.run(["scripts/run"], cwd=checkout, env=environment(PORT="1"), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode != 0
    said = (done.stdout + done.stderr).strip().splitlines()
    assert len(said) == 1 and ".env" in said[0] and "REFUNDOPS_ENV=production" in said[0], said
    assert "mv .env" in said[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.django_db(transaction=True)
def test_djangos_standard_gunicorn_command_serves_from_the_repository_root():
    """`gunicorn refundops.wsgi:application` reads ./gunicorn.conf.py; that file must not force
    uvicorn's worker on a WSGI application (every request failed)."""
    db = settings.DATABASES["default"]
    port = free_port()
    env = environment(DATABASE_URL=f"postgres://{db['USER']}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}/{db['NAME']}",
                      REDIS_URL=settings.REDIS_URL, REDIS_KEY_PREFIX=settings.REDIS_KEY_PREFIX,
                      WEB_CONCURRENCY="1", BIND=f"127.0.0.1:{port}")
    server = subprocess.Popen([str(ROOT / ".venv" / "bin" / "gunicorn"), "refundops.wsgi:application"], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              start_new_session=True)
    try:
        answers = []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and server.poll() is None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as answer:
                    answers.append(answer.status)
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/admin/login/", timeout=10) as answer:
                    answers.append(answer.status)
                break
            except OSError:
                time.sleep(0.5)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        output = server.communicate(timeout=60)[0]
    assert answers == [200, 200], output


def locked_versions() -> dict[str, str]:
    pins = re.findall(r"^([A-Za-z0-9_.-]+)==([^\s\\;]+)", (ROOT / "requirements.lock").read_text(), re.M)
    return {re.sub(r"[-_.]+", "-", name).lower(): version for name, version in pins}


def test_development_runs_the_versions_the_image_runs():
    """scripts/install installs under requirements.lock (the image's pins): each locked package in
    .venv has the locked version."""
    assert "requirements.lock" in (ROOT / "scripts" / "install").read_text()
    differ = {}
    for dist in metadata.distributions():
        name = re.sub(r"[-_.]+", "-", dist.metadata["Name"]).lower()
        locked = locked_versions().get(name)
        if locked and dist.version != locked:
            differ[name] = (dist.version, locked)
    assert not differ, f"installed vs locked: {differ}"


def test_the_lock_pins_every_dependency_pyproject_names_within_its_range():
    """requirements.lock is what both install: fresh with respect to pyproject.toml (regenerate it
    with the pip-compile command at its top when this fails)."""
    import tomllib

    from packaging.requirements import Requirement

    locked = locked_versions()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for line in project["dependencies"]:
        requirement = Requirement(line)
        name = re.sub(r"[-_.]+", "-", requirement.name).lower()
        assert name in locked, f"requirements.lock lacks {requirement.name}"
        assert requirement.specifier.contains(locked[name], prereleases=True), (line, locked[name])


@pytest.mark.django_db
def test_the_first_staff_login_of_production_is_one_command_with_a_role():
    """No demo logins in production: `manage.py create_staff USER ROLE` makes the first one, audited,
    and says that its first sign-in enrols a TOTP second factor."""
    from io import StringIO

    from django.contrib.auth.models import User
    from django.core.management import call_command

    from audit.models import AuditEntry

    out = StringIO()
    call_command("create_staff", "alice", "administrator", "--email", "alice@example.com",
                 stdin=StringIO("a long enough passphrase\n"), stdout=out)
    alice = User.objects.get(username="alice")
    assert alice.is_staff and not alice.is_superuser and alice.check_password("a long enough passphrase")
    assert list(alice.groups.values_list("name", flat=True)) == ["Administrators"]
    assert {"user.created", "role.granted"} <= set(AuditEntry.objects.filter(subject_id=str(alice.pk))
                                                   .values_list("action", flat=True))
    assert "TOTP" in out.getvalue() and "/admin/" in out.getvalue()
    readme = (ROOT / "README.md").read_text()
    assert "manage.py create_staff" in readme and "docker compose exec web" in readme


def test_compose_on_plain_http_is_explained():
    """.env.example's DJANGO_SECURE=true redirects http://localhost:8000 to https (no proxy in
    compose): the README says so where it gives the compose command, and what to set instead."""
    readme = (ROOT / "README.md").read_text()
    two_commands = readme.split("## Two commands", 1)[1].split("\n## ", 1)[0]
    assert re.search(r"^DJANGO_SECURE=true$", (ROOT / ".env.example").read_text(), re.M)
    assert "DJANGO_SECURE=false" in two_commands and "redirects to https" in two_commands
