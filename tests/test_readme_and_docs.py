"""The README and the product's own docs, as a newcomer reads them from a clone: links that resolve
inside the repository, every variable the settings read in the table with its true default, and
commands that run on a bare Debian. (Issue 13, finding 6.)"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.test_deploy_files import compose, settings_variables

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def table_rows() -> dict[str, str]:
    """variable -> its default cell, from the README's configuration table (one variable a row)."""
    rows = {}
    for line in README.splitlines():
        match = re.match(r"^\| `([A-Z][A-Z0-9_]*)` \| (.*?) \| .* \|$", line)
        if match:
            rows[match.group(1)] = match.group(2)
    return rows


def literal(node: ast.expr | None):
    """The default's value when it is a constant expression (``512 * 1024`` too); else None."""
    if node is None or not all(isinstance(n, (ast.Constant, ast.BinOp, ast.UnaryOp, ast.List, ast.operator,
                                              ast.unaryop, ast.Load, ast.USub)) for n in ast.walk(node)):
        return None
    return eval(compile(ast.Expression(node), "settings.py", "eval"), {})  # constants only, checked above


def shown(value) -> list[str]:
    """How the README writes a default: `true`/`false`, numbers without separators, `empty`."""
    if isinstance(value, bool):
        return ["true" if value else "false"]
    if isinstance(value, float) and value.is_integer():
        return [str(value), str(int(value))]
    if isinstance(value, list):
        return [str(v) for v in value] or ["empty"]
    return [str(value)] if value != "" else ["empty"]


def test_every_variable_the_settings_read_is_in_the_table_with_its_true_default():
    rows = table_rows()
    variables = settings_variables()
    missing = sorted(set(variables) - set(rows))
    assert not missing, f"README's configuration table lacks {missing}"
    for name, default in variables.items():
        value = literal(default)
        # Read twice, or replaced when empty (AUDIT_KEY's development value): the README says it in words.
        if value is None or name in ("DJANGO_SECRET_KEY", "REFUNDOPS_ENV", "AUDIT_KEY"):
            continue
        cell = rows[name].replace("_", "").replace(",", "")
        for text in shown(value):
            assert text.replace("_", "").replace(",", "") in cell, f"{name}: default {value!r}, README says {rows[name]!r}"


def test_the_readme_links_only_inside_the_repository_and_the_docs_are_there():
    assert "../shared" not in README
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README):
        if not target.startswith("http"):
            assert (ROOT / target).exists(), target
    for doc in ("CONTRACT.md", "ARCHITECTURE.md", "OPERATIONS.md"):
        assert (ROOT / "docs" / doc).is_file(), doc
    operations = (ROOT / "docs" / "OPERATIONS.md").read_text()
    for section in ("## Deploy", "## Scale", "## Back up", "## Rotate keys", "what each alert means"):
        assert section in operations, section
    for series in ("refundops_queue_depth", "refundops_gateway_breaker_open", "refundops_oldest_held_refund_age_seconds",
                   "refundops_webhook_delivery_lag_seconds", "refundops_agent_breaker_open"):
        assert series in operations, series  # every alert says what it means


def test_the_contract_in_the_repository_is_the_products_contract():
    contract = (ROOT / "docs" / "CONTRACT.md").read_text()
    assert "IDEMPOTENCY_KEY_REQUIRED" in contract and "CIRCUIT_OPEN" in contract


def test_commands_in_the_readme_need_nothing_debian_slim_lacks():
    assert "uuidgen" not in README


# --- The README's and the docs' checkable claims, read against the code (issue 29, finding 2) ---

DOCS = {name: (ROOT / name).read_text() for name in ("README.md", "docs/OPERATIONS.md", ".env.example",
                                                      "examples/agent/README.md")}


def variables_read() -> set[str]:
    """Every environment variable something we ship reads: the settings, and os.environ / getenv in
    the code, the gunicorn config and the scripts."""
    names = set(settings_variables())
    for path in [*ROOT.glob("refundops/**/*.py"), ROOT / "gunicorn.conf.py", *ROOT.glob("scripts/*")]:
        text = path.read_text()
        names |= set(re.findall(r"environ(?:\.get)?\(\s*[\"']([A-Z][A-Z0-9_]*)[\"']", text))
        names |= set(re.findall(r"environ\[[\"']([A-Z][A-Z0-9_]*)[\"']\]", text))
        names |= set(re.findall(r"getenv\(\s*[\"']([A-Z][A-Z0-9_]*)[\"']", text))
        names |= set(re.findall(r"\$\{([A-Z][A-Z0-9_]*)[:}]", text))  # the scripts' ${NAME:-default}
    return names


def test_every_variable_the_readme_env_example_and_docs_offer_is_read():
    read = variables_read()
    offered = set(table_rows()) | set(env_example_pairs())
    assert not sorted(offered - read - {"POSTGRES_PASSWORD"}), "offered, never read"  # compose reads POSTGRES_PASSWORD


def env_example_pairs() -> dict[str, str]:
    """name -> value in .env.example, commented or not, without a trailing comment."""
    pairs = {}
    for line in DOCS[".env.example"].splitlines():
        match = re.match(r"^#?\s*([A-Z][A-Z0-9_]*)=(\S*)", line)
        if match:
            pairs[match.group(1)] = match.group(2)
    return pairs


def test_env_example_lists_every_variable_the_settings_read_and_its_commented_defaults_are_true():
    pairs = env_example_pairs()
    variables = settings_variables()
    assert not sorted(set(variables) - set(pairs)), ".env.example lacks these"
    for line in DOCS[".env.example"].splitlines():
        match = re.match(r"^#\s*([A-Z][A-Z0-9_]*)=(\S*)", line)  # commented: "the default it takes when left out"
        if not match or match.group(1) not in variables:
            continue
        value = literal(variables[match.group(1)])
        if value is None or value == "" or value == []:
            continue
        said = match.group(2).lower().replace("_", "")
        under_compose = re.findall(rf"\$\{{{match.group(1)}:-([^}}]*)\}}", (ROOT / "docker-compose.yml").read_text())
        assert said in [text.lower().replace("_", "") for text in [*shown(value), *under_compose]], (
            match.group(1), said, value)


def every_seconds(amount: str | None, unit: str) -> float:
    return (int(amount) if amount else 1) * {"second": 1, "minute": 60, "hour": 3600}[unit]


def test_the_schedules_the_docs_give_are_beats():
    from django.conf import settings

    beats = {name: entry["schedule"].total_seconds() for name, entry in settings.CELERY_BEAT_SCHEDULE.items()}
    said = []
    for name, text in DOCS.items():
        for beat, amount, unit in re.findall(r"`([a-z-]+)`[^`.;]{0,30}?every (?:(\d+) )?(second|minute|hour)s?",
                                             text):
            if beat in beats:
                said.append(beat)
                assert every_seconds(amount, unit) == beats[beat], f"{name}: {beat} runs every {beats[beat]} s"
    assert "resubmit-stalled-approved-refunds" in said


def test_the_connections_the_docs_count_are_composes():
    services = compose()["services"]
    web = services["web"]["environment"]
    default = lambda value: int(re.search(r":-(\d+)\}", str(value)).group(1))  # noqa: E731 - ${NAME:-4}
    worker = default(re.search(r"\$\{CELERY_WORKER_CONCURRENCY:-\d+\}", " ".join(services["worker"]["command"])).group(0))
    total = default(web["WEB_CONCURRENCY"]) * default(web["DATABASE_POOL_MAX"]) + worker + 1 + 1  # beat, migrate
    compose_says = int(re.search(r"(\d+) of PostgreSQL's max_connections", (ROOT / "docker-compose.yml").read_text()).group(1))
    operations_says = int(re.search(r"Compose's defaults:[^\n]*?(\d+) of 100", DOCS["docs/OPERATIONS.md"]).group(1))
    assert compose_says == operations_says == total


def test_the_scripts_and_commands_the_readme_and_docs_name_exist():
    from django.core.management import get_commands

    commands = set(get_commands())
    for name, text in DOCS.items():
        for script in set(re.findall(r"\bscripts/([a-z_]+)\b", text)):
            path = ROOT / "scripts" / script
            assert path.is_file() and path.stat().st_mode & 0o111, f"{name}: scripts/{script}"
        for command in set(re.findall(r"manage\.py ([a-z_]+)", text)):
            assert command in commands, f"{name}: manage.py {command}"


def readme_banner() -> str:
    block = README.split("For example:\n\n```\n", 1)[1].split("```", 1)[0]
    return block.strip("\n")


def placeholders(text: str) -> str:
    """The banner with what differs from start to start written as the README writes it."""
    text = re.sub(r"rk_[A-Za-z0-9_-]{20,}", "rk_…", text)
    text = re.sub(r"txn_[0-9a-f]{24}", "txn_…", text)
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


def test_the_banner_in_the_readme_is_the_one_printed(db, tmp_path, settings):
    """Printed on a fresh demo database; the README shows it with rk_… and txn_… for the key and
    payment ids. It names var/demo.json and a payment and amount the example agent is held on."""
    from io import StringIO

    from django.core.management import call_command

    settings.VAR_DIR = ROOT / "var"
    call_command("demo_data", "--json", "--output", str(tmp_path / "demo.json"), stdout=StringIO())
    out = StringIO()
    call_command("run_banner", "--base-url", "http://127.0.0.1:8000", "--key-file", str(tmp_path / "demo.json"),
                 stdout=out)
    printed = out.getvalue().replace(str(tmp_path), "var")  # scripts/run's --key-file is var/demo.json
    assert placeholders(printed) == placeholders(readme_banner())
    assert "var/demo.json lists a payment" in printed and "--amount 30000" in printed


def test_the_example_agents_hold_is_on_a_payment_it_is_held_on():
    """--amount 30000 is held only on a payment of more than 200.00 USD (the demo's approval
    threshold): the README says which one (450.00 USD, in var/demo.json)."""
    agent_readme = DOCS["examples/agent/README.md"]
    assert "--amount 30000" in agent_readme and "450.00 USD" in agent_readme and "var/demo.json" in agent_readme


def test_the_postgresql_command_creates_its_database(tmp_path):
    """The README's `DATABASE_URL=postgres://…/refundops scripts/run` on a server without that
    database: scripts/run creates it (one line, not an 85-line traceback)."""
    import subprocess
    import sys
    import uuid as uuidlib

    import psycopg
    from django.conf import settings

    db = settings.DATABASES["default"]
    server = f"postgres://{db['USER']}@{db['HOST'] or '127.0.0.1'}:{db['PORT'] or 5432}"
    name = f"fresh_{uuidlib.uuid4().hex[:12]}"
    assert re.search(r"\$py manage\.py ensure_database", (ROOT / "scripts" / "run").read_text())
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("DATABASE_")}
    env["DATABASE_URL"] = f"{server}/{name}"
    try:
        done = subprocess.run([sys.executable, "manage.py", "ensure_database"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        assert f"created the database {name}" in done.stdout, done.stdout
        again = subprocess.run([sys.executable, "manage.py", "ensure_database"], cwd=ROOT, env=env,
                               capture_output=True, text=True, timeout=120)
        assert again.returncode == 0 and again.stdout == "", again.stdout + again.stderr  # there: nothing to say
    finally:
        with psycopg.connect(f"{server}/postgres", autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
