"""The verdict's checks table and the charts (the audit chain: tests/test_audit_chain.py)."""

from __future__ import annotations

import re

import pytest

from audit import charts
from audit.admin import checks_table

pytestmark = pytest.mark.django_db


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
    assert "2 checks, in the order they ran" in html and "minor units" not in html
