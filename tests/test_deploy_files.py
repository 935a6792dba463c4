"""The deploy an operator runs as written: compose parsed and checked against the variables the
settings read, the image's build files, and the connection budget. (Issue 13, findings 3, 4 and 6.)

No Docker engine here: the files are read as compose and docker would read them."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
APP_SERVICES = ("web", "worker", "beat", "migrate")
LONG_RUNNING = ("postgres", "redis", "web", "worker", "beat")


def settings_variables() -> dict[str, ast.expr | None]:
    """Every environment variable refundops/settings.py reads, with its default expression."""
    found: dict[str, ast.expr | None] = {}
    for node in ast.walk(ast.parse((ROOT / "refundops" / "settings.py").read_text())):
        if not isinstance(node, ast.Call) or not node.args or not isinstance(node.args[0], ast.Constant):
            continue
        func = node.func
        is_env = (isinstance(func, ast.Name) and func.id == "env") or (
            isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "env")
        if is_env and isinstance(node.args[0].value, str) and node.args[0].value.isupper():
            default = next((k.value for k in node.keywords if k.arg == "default"), None)
            found.setdefault(node.args[0].value, default)
    return found


def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def env_example() -> dict[str, str]:
    pairs = {}
    for line in (ROOT / ".env.example").read_text().splitlines():
        match = re.match(r"^#?\s*([A-Z][A-Z0-9_]*)=(.*)$", line)
        if match:
            pairs[match.group(1)] = match.group(2)
    return pairs


def test_settings_are_read_as_this_test_thinks():
    variables = settings_variables()
    assert {"DATABASE_URL", "PUBLIC_BASE_URL", "PAYPAL_ENVIRONMENT", "EMAIL_HOST", "METRICS_TOKEN"} <= set(variables)


def test_every_app_service_reads_the_env_file_and_every_variable_is_in_it():
    services = compose()["services"]
    for name in APP_SERVICES:
        assert services[name]["env_file"] == ".env", name
    documented = env_example()
    missing = sorted(set(settings_variables()) - set(documented))
    assert not missing, f".env.example lacks {missing}"
    assert re.search(r"^REFUNDOPS_ENV=production$", (ROOT / ".env.example").read_text(), re.M)
    assert documented["PAYPAL_ENVIRONMENT"] == "live"  # with live credentials, never sandbox by omission


def test_every_service_restarts_and_has_a_health_check():
    services = compose()["services"]
    for name in LONG_RUNNING:
        assert services[name]["restart"] == "unless-stopped", name
        check = services[name]["healthcheck"]["test"]
        assert check and not services[name]["healthcheck"].get("disable"), name
    assert services["migrate"]["restart"] == "on-failure"
    postgres = services["postgres"]["healthcheck"]["test"]
    assert "pg_isready" in postgres and postgres[postgres.index("-h") + 1] == "127.0.0.1"
    assert "/readyz" in " ".join(services["web"]["healthcheck"]["test"])


def test_a_plain_worker_and_connection_budgets_that_add_up():
    services = compose()["services"]
    assert "-Q" not in services["worker"]["command"]
    max_connections = int(re.search(r"max_connections=(\d+)", " ".join(services["postgres"]["command"])).group(1))
    default = lambda text: int(re.search(r":-(\d+)\}", str(text)).group(1))  # noqa: E731
    web_env = services["web"]["environment"]
    web = default(web_env["WEB_CONCURRENCY"]) * default(web_env["DATABASE_POOL_MAX"])
    worker = default(" ".join(services["worker"]["command"]))
    assert web_env["DATABASE_POOL"] == "true"
    for name in ("worker", "beat", "migrate"):
        assert services[name]["environment"]["DATABASE_POOL"] == "false", name  # pool off in Celery
    assert web + worker + 1 + 1 + 5 < max_connections  # beat, migrate, a few admin commands
    gunicorn = (ROOT / "gunicorn.conf.py").read_text()
    assert 'os.environ.get("WEB_CONCURRENCY"' in gunicorn and "child_exit" in gunicorn


def test_the_image_runs_as_a_user_installs_from_the_lock_before_the_code_and_carries_no_secrets():
    dockerfile = (ROOT / "Dockerfile").read_text()
    lines = [line for line in dockerfile.splitlines() if line and not line.startswith("#")]
    user = [line for line in lines if line.startswith("USER ")]
    assert user and user[-1] != "USER root"
    install = next(i for i, line in enumerate(lines) if "-r requirements.lock" in line)
    first_code = next(i for i, line in enumerate(lines) if line.startswith("COPY refundops"))
    assert install < first_code  # the dependency layer survives a code change
    assert "REFUNDOPS_ENV=production" in dockerfile
    lock = (ROOT / "requirements.lock").read_text()
    for package in ("django==", "celery==", "psycopg==", "prometheus-client=="):
        assert package in lock.lower(), package
    assert "--hash=sha256:" in lock
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert {".venv", "var", ".env", ".git"} <= set(ignored)


def test_the_image_alone_refuses_clearly_without_its_secrets(tmp_path):
    """The image's CMD with none of compose's environment: production mode, which says what is missing."""
    import os
    import subprocess
    import sys

    env = {"PATH": os.environ["PATH"], "REFUNDOPS_ENV": "production", "HOME": str(tmp_path)}
    refused = subprocess.run([sys.executable, "manage.py", "check"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode != 0
    assert "DJANGO_SECRET_KEY" in refused.stderr
    import secrets

    env.update(DJANGO_SECRET_KEY=secrets.token_urlsafe(50), AUDIT_KEY=secrets.token_urlsafe(30))  # 'x' * 50 is refused now
    refused = subprocess.run([sys.executable, "manage.py", "check"], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=120)
    assert refused.returncode != 0 and "DATABASE_URL" in refused.stderr and "REDIS_URL" in refused.stderr
