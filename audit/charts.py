"""Server-side inline SVG charts for the finance dashboard: pure functions from numbers to markup.

No JavaScript and nothing fetched at runtime. Every chart has a <title> and <desc> for screen
readers, labelled axes, and a <title> on each mark so hovering shows the exact figure. Callers pass
the formatting (``fmt``) so money stays exact: amounts arrive as integer minor units and are only
ever turned into text by the caller's formatter. Colours come from CSS classes (``chart-*``) that
the page styles for light and dark themes.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from django.utils.html import escape
from django.utils.safestring import SafeString, mark_safe

Formatter = Callable[[int], str]
_ids = itertools.count(1)


@dataclass(frozen=True)
class Bar:
    label: str  # short label on the axis
    value: int
    tooltip: str = ""  # the full sentence shown on hover; defaults to "label: value"


@dataclass(frozen=True)
class StackedRow:
    label: str
    values: Sequence[int]  # one per series, in the chart's series order


def nice_ticks(maximum: int, *, count: int = 4) -> list[int]:
    """Round, evenly spaced integer ticks from 0 that reach at least ``maximum``."""
    if maximum <= 0:
        return [0, 1]
    raw = maximum / count
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    step = max(1, math.ceil(step))
    top = math.ceil(maximum / step) * step
    return list(range(0, top + 1, step))


def _svg_open(*, width: int, height: int, title: str, description: str) -> tuple[str, str]:
    uid = f"chart{next(_ids)}"
    head = (f'<svg class="chart" role="img" viewBox="0 0 {width} {height}" width="100%" '
            f'preserveAspectRatio="xMinYMin meet" style="max-width:{width}px" '
            f'aria-labelledby="{uid}-t {uid}-d" xmlns="http://www.w3.org/2000/svg">'
            f'<title id="{uid}-t">{escape(title)}</title><desc id="{uid}-d">{escape(description)}</desc>')
    return uid, head


def column_chart(*, title: str, description: str, bars: Sequence[Bar], x_label: str, y_label: str,
                 fmt: Formatter = str, tick_fmt: Formatter | None = None, value_fmt: Formatter | None = None,
                 limit: int | None = None, limit_label: str = "", show_values: bool = False, width: int = 680,
                 height: int = 280) -> SafeString:
    """Vertical bars over a category axis (e.g. days), with an optional dashed limit line.
    ``show_values`` writes each non-zero figure above its bar (with ``value_fmt``, default ``fmt``)."""
    tick_fmt = tick_fmt or fmt
    value_fmt = value_fmt or fmt
    left, right, top, bottom = 84, 16, 24, 58
    plot_w, plot_h = width - left - right, height - top - bottom
    peak = max([b.value for b in bars] + [limit or 0, 0])
    ticks = nice_ticks(peak)
    scale = plot_h / ticks[-1]
    _, out = _svg_open(width=width, height=height, title=title, description=description)
    parts = [out]
    for tick in ticks:
        y = top + plot_h - tick * scale
        parts.append(f'<line class="chart-grid" x1="{left}" x2="{left + plot_w}" y1="{y:.1f}" y2="{y:.1f}"/>'
                     f'<text class="chart-tick" x="{left - 6}" y="{y + 4:.1f}" text-anchor="end">'
                     f'{escape(tick_fmt(tick))}</text>')
    slot = plot_w / max(len(bars), 1)
    bar_w = max(slot * 0.7, 1)
    label_every = max(1, math.ceil(len(bars) / 14))
    for i, bar in enumerate(bars):
        x = left + i * slot + (slot - bar_w) / 2
        h = bar.value * scale
        y = top + plot_h - h
        tip = bar.tooltip or f"{bar.label}: {fmt(bar.value)}"
        parts.append(f'<rect class="chart-bar" x="{x:.1f}" y="{y:.1f}" width="{bar_w:.1f}" height="{h:.1f}">'
                     f'<title>{escape(tip)}</title></rect>')
        # An invisible full-height target so a zero bar still answers on hover.
        parts.append(f'<rect class="chart-hit" x="{left + i * slot:.1f}" y="{top}" width="{slot:.1f}" '
                     f'height="{plot_h}"><title>{escape(tip)}</title></rect>')
        if show_values and bar.value:
            parts.append(f'<text class="chart-value" x="{x + bar_w / 2:.1f}" y="{y - 4:.1f}" '
                         f'text-anchor="middle">{escape(value_fmt(bar.value))}</text>')
        if i % label_every == 0:
            parts.append(f'<text class="chart-tick" x="{x + bar_w / 2:.1f}" y="{top + plot_h + 16}" '
                         f'text-anchor="middle">{escape(bar.label)}</text>')
    if limit is not None and limit > 0:
        y = top + plot_h - limit * scale
        text = limit_label or "limit"
        parts.append(f'<line class="chart-limit" x1="{left}" x2="{left + plot_w}" y1="{y:.1f}" y2="{y:.1f}">'
                     f'<title>{escape(text)}: {escape(fmt(limit))}</title></line>'
                     f'<text class="chart-limit-label" x="{left + plot_w}" y="{y - 5:.1f}" text-anchor="end">'
                     f'{escape(text)} {escape(fmt(limit))}</text>')
    parts.append(f'<line class="chart-axis" x1="{left}" x2="{left + plot_w}" y1="{top + plot_h}" '
                 f'y2="{top + plot_h}"/><line class="chart-axis" x1="{left}" x2="{left}" y1="{top}" '
                 f'y2="{top + plot_h}"/>')
    parts.append(f'<text class="chart-axis-label" x="{left + plot_w / 2:.1f}" y="{height - 8}" '
                 f'text-anchor="middle">{escape(x_label)}</text>'
                 f'<text class="chart-axis-label" transform="translate(14 {top + plot_h / 2:.1f}) rotate(-90)" '
                 f'text-anchor="middle">{escape(y_label)}</text></svg>')
    return mark_safe("".join(parts))


def bar_chart(*, title: str, description: str, bars: Sequence[Bar], x_label: str, fmt: Formatter = str,
              tick_fmt: Formatter | None = None, width: int = 680) -> SafeString:
    """Horizontal bars, one per category, each labelled with its value."""
    return stacked_bar_chart(title=title, description=description, series=[x_label],
                             rows=[StackedRow(b.label, [b.value]) for b in bars], x_label=x_label,
                             fmt=fmt, tick_fmt=tick_fmt, width=width, tooltips=[b.tooltip for b in bars],
                             legend=False)


def stacked_bar_chart(*, title: str, description: str, series: Sequence[str], rows: Sequence[StackedRow],
                      x_label: str, fmt: Formatter = str, tick_fmt: Formatter | None = None, width: int = 680,
                      tooltips: Sequence[str] | None = None, legend: bool = True) -> SafeString:
    """Horizontal bars split into series (e.g. approved / rejected per hold rule), with a legend."""
    tick_fmt = tick_fmt or fmt
    left, right, top, row_h = 190, 110, 30 if legend else 10, 30
    plot_w = width - left - right
    height = top + max(len(rows), 1) * row_h + 44
    peak = max([sum(r.values) for r in rows] + [0])
    ticks = nice_ticks(peak)
    scale = plot_w / ticks[-1]
    _, out = _svg_open(width=width, height=height, title=title, description=description)
    parts = [out]
    plot_bottom = top + max(len(rows), 1) * row_h
    if legend:
        x = 10
        for s, name in enumerate(series):
            parts.append(f'<rect class="chart-series-{s}" x="{x}" y="8" width="12" height="12"/>'
                         f'<text class="chart-tick" x="{x + 16}" y="18">{escape(name)}</text>')
            x += 26 + 7 * len(name)
    for tick in ticks:
        x = left + tick * scale
        parts.append(f'<line class="chart-grid" x1="{x:.1f}" x2="{x:.1f}" y1="{top}" y2="{plot_bottom}"/>'
                     f'<text class="chart-tick" x="{x:.1f}" y="{plot_bottom + 16}" text-anchor="middle">'
                     f'{escape(tick_fmt(tick))}</text>')
    if not rows:
        parts.append(f'<text class="chart-tick" x="{left + 8}" y="{top + 20}">Nothing in this period</text>')
    for i, row in enumerate(rows):
        y = top + i * row_h + 5
        short = row.label if len(row.label) <= 28 else row.label[:27] + "…"
        parts.append(f'<text class="chart-tick" x="{left - 8}" y="{y + 15}" text-anchor="end">'
                     f'<title>{escape(row.label)}</title>{escape(short)}</text>')
        x = left
        for s, value in enumerate(row.values):
            if not value:
                continue
            w = value * scale
            tip = (tooltips[i] if tooltips and tooltips[i] else
                   f"{row.label}, {series[s]}: {fmt(value)}")
            parts.append(f'<rect class="chart-series-{s}" x="{x:.1f}" y="{y}" width="{w:.1f}" height="{row_h - 10}">'
                         f'<title>{escape(tip)}</title></rect>')
            x += w
        total = sum(row.values)
        parts.append(f'<text class="chart-value" x="{x + 6:.1f}" y="{y + 15}">{escape(fmt(total))}</text>')
    parts.append(f'<line class="chart-axis" x1="{left}" x2="{left}" y1="{top}" y2="{plot_bottom}"/>'
                 f'<text class="chart-axis-label" x="{left + plot_w / 2:.1f}" y="{height - 6}" '
                 f'text-anchor="middle">{escape(x_label)}</text></svg>')
    return mark_safe("".join(parts))
