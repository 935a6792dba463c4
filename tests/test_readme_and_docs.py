"""The README and the product's own docs, as a newcomer reads them from a clone: links that resolve
inside the repository, every variable the settings read in the table with its true default, and
commands that run on a bare Debian. (Issue 13, finding 6.)"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.test_deploy_files import settings_variables

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
