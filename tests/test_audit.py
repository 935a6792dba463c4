"""The audit log's hash chain (``manage.py verify_audit``), the verdict page, and the charts."""

from __future__ import annotations

import contextlib
import io
import re

import pytest
from django.core.management import CommandError, ManagementUtility, call_command
from django.db import connection

from audit import charts
from audit.admin import checks_table
from audit.models import AuditEntry
from audit.services import record_audit

pytestmark = pytest.mark.django_db


def write_chain(n: int) -> list[AuditEntry]:
    return [record_audit(actor="user:alice", action="refund.approved", subject_type="refund",
                         subject_id=f"rf_{i}", data={"amount_minor": 100 * i, "currency": "USD"})
            for i in range(1, n + 1)]


def verify(*args: str) -> tuple[str, str]:
    out, err = io.StringIO(), io.StringIO()
    call_command("verify_audit", *args, stdout=out, stderr=err)
    return out.getvalue(), err.getvalue()


def test_a_clean_chain_verifies_and_says_how_many_entries_it_checked():
    write_chain(5)
    out, _ = verify()
    assert out.strip() == "5 audit entries checked; the chain verifies."


def test_an_empty_log_verifies():
    out, _ = verify()
    assert out.startswith("0 audit entries checked")


def test_long_chains_report_progress_on_stderr():
    write_chain(7)
    out, err = verify("--progress-every", "3")
    assert err.splitlines() == ["… 3 entries verified", "… 6 entries verified"]
    assert out.startswith("7 audit entries checked")


def test_an_entry_altered_with_raw_sql_is_named():
    entries = write_chain(5)
    with connection.cursor() as cursor:
        cursor.execute("UPDATE audit_auditentry SET data = %s WHERE id = %s",
                       ['{"amount_minor": 1, "currency": "USD"}', entries[2].pk])
    with pytest.raises(CommandError, match=r"audit entry #3 \(id \d+, refund.approved refund:rf_3\) does not "
                                           r"verify: entry #3 was altered after it was written; 2 entries"):
        verify()


def test_an_altered_actor_is_caught_even_when_the_attacker_recomputes_that_entrys_hash():
    entries = write_chain(4)
    forged = AuditEntry.objects.get(pk=entries[1].pk)
    forged.actor = "user:mallory"
    with connection.cursor() as cursor:
        cursor.execute("UPDATE audit_auditentry SET actor = %s, hash = %s WHERE id = %s",
                       [forged.actor, forged.compute_hash(), forged.pk])
    with pytest.raises(CommandError, match=r"audit entry #3 .* does not link to the entry before it"):
        verify()


def test_an_entry_deleted_with_raw_sql_is_named_by_the_entry_after_the_gap():
    entries = write_chain(5)
    with connection.cursor() as cursor:
        cursor.execute("DELETE FROM audit_auditentry WHERE id = %s", [entries[1].pk])
    with pytest.raises(CommandError, match=r"audit entry #3 .* entry #3 follows #1: an entry is missing"):
        verify()


def test_verify_audit_exits_non_zero_from_the_command_line():
    write_chain(2)
    with connection.cursor() as cursor:
        cursor.execute("UPDATE audit_auditentry SET action = 'refund.rejected' WHERE seq = 1")
    err = io.StringIO()
    with pytest.raises(SystemExit) as exited, contextlib.redirect_stderr(err):
        ManagementUtility(["manage.py", "verify_audit"]).execute()
    assert exited.value.code != 0 and "audit entry #1" in err.getvalue()


def test_the_checks_table_escapes_what_an_agent_sent():
    html = checks_table([{"name": "reason", "result": "fail", "code": "REASON_NOT_ALLOWED",
                          "message": "<script>alert(1)</script>", "inputs": {"reason": "<b>"}, "limit": ["a"]}])
    assert "<script>" not in html and "&lt;script&gt;" in html
    assert '<tr class="check-fail">' in html and "REASON_NOT_ALLOWED" in html


def test_nice_ticks_are_round_and_reach_the_maximum():
    assert charts.nice_ticks(0) == [0, 1]
    assert charts.nice_ticks(7) == [0, 2, 4, 6, 8]
    assert charts.nice_ticks(2_000_000) == [0, 500_000, 1_000_000, 1_500_000, 2_000_000]
    assert charts.nice_ticks(123_456)[-1] >= 123_456


def test_a_column_chart_is_accessible_and_shows_exact_figures_on_hover():
    svg = charts.column_chart(
        title="Refund value per day", description="two days", x_label="day", y_label="USD",
        bars=[charts.Bar("01 Nov", 1_999, "Sat 01 Nov: 19.99 USD"), charts.Bar("02 Nov", 0)],
        fmt=lambda v: f"{v / 100:.2f} USD", limit=5_000, limit_label="global daily limit")
    assert svg.startswith('<svg class="chart" role="img"') and svg.endswith("</svg>")
    assert re.search(r'aria-labelledby="(chart\d+)-t \1-d"', svg)
    assert "<title" in svg and "<desc" in svg
    assert "<title>Sat 01 Nov: 19.99 USD</title>" in svg and "<title>02 Nov: 0.00 USD</title>" in svg
    assert "global daily limit 50.00 USD" in svg
    assert ">day<" in svg and ">USD<" in svg  # axis labels


def test_chart_labels_are_escaped():
    svg = charts.bar_chart(title="<t>", description="d", x_label="x",
                           bars=[charts.Bar("<img src=x onerror=alert(1)>", 3)])
    assert "<img" not in svg and "&lt;img" in svg


def test_a_stacked_chart_has_a_legend_and_one_mark_per_nonzero_part():
    svg = charts.stacked_bar_chart(title="Held by rule", description="d", x_label="refunds",
                                   series=["approved", "rejected"],
                                   rows=[charts.StackedRow("APPROVAL_REQUIRED", [3, 1]),
                                         charts.StackedRow("PAYMENT_FLAGGED", [0, 2])])
    assert svg.count('<rect class="chart-series-0"') == 2  # legend and one bar
    assert svg.count('<rect class="chart-series-1"') == 3
    assert "<title>APPROVAL_REQUIRED, rejected: 1</title>" in svg


def test_the_checks_table_gives_the_why_only_for_checks_that_did_not_pass():
    html = checks_table([{"name": "global_daily_amount", "result": "pass", "message": "Refused: would reach …"},
                         {"name": "approval_threshold", "result": "hold", "message": "above 200.00 USD"}],
                        currency="USD")
    assert "Refused: would reach" not in html and "above 200.00 USD" in html
    assert "Amounts are in minor units of USD. 2 checks, in the order they ran" in html
