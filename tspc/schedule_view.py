"""The schedule as a picture: one self-contained HTML page with inline SVG (opens offline).

For every graph (forward, backward) the page draws the issue order left to right: one column per
node that does work (views are free and left out), one row per layer with a bar for each
transfer from its start node to its wait node, and a strip of compute nodes underneath (GEMMs and
attention kernels tall and dark, the rest short and grey). A bar covers exactly the compute it
overlaps; a transfer whose wait directly follows its start has nothing to hide behind and is
drawn with a red outline. Then, per layer, the same picture restricted to that layer's transfers
and a table of them: buffer, bytes, where it is issued and waited, what it overlaps.

Hovering a bar highlights the compute it overlaps; the inline script is the page's only code
and loads nothing. It also records, on the ``<html>`` element, how many charts and transfers the
browser laid out (``data-tspc-charts``, ``data-tspc-transfers``, ``data-tspc-rendered-width``),
which is what the headless-browser test reads back.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field

from .graph_comm import GraphSchedule, Transfer

KIND_COLOURS = {
    "broadcast": "#4e79a7",
    "all_gather": "#f28e2b",
    "ring": "#59a14f",
    "reduce": "#e15759",
    "reduce_scatter": "#b07aa1",
    "all_reduce": "#9c755f",
}
_LABEL_W = 240
_LANE_H = 12
_ROW_PAD = 6
_AXIS_H = 20
_COMPUTE_H = 30


@dataclass
class Table:
    caption: str
    header: list[str]
    rows: list[list[object]]


@dataclass
class SchedulePage:
    title: str
    lines: list[str] = field(default_factory=list)  # plain facts under the title
    tables: list[Table] = field(default_factory=list)
    schedules: list[GraphSchedule] = field(default_factory=list)
    layers: list[str] = field(default_factory=list)  # the matched modules, in model order


def _e(x: object) -> str:
    return html.escape(str(x), quote=True)


def _row_of(t: Transfer, layers: set[str]) -> str:
    # Layers and the output gather get a row each; the many per-parameter gradient all-reduces
    # share one row per kind.
    if t.tag in layers or t.tag == "output":
        return t.tag
    return f"other {t.kind}"


def _lanes(transfers: list[Transfer], col) -> dict[int, int]:
    """Greedy lane per transfer so that transfers in flight together do not overlap."""
    ends: list[int] = []
    lane_of = {}
    for i, t in sorted(enumerate(transfers), key=lambda it: col(it[1].start_pos)):
        a = col(t.start_pos)
        b = col(t.wait_pos if t.wait_pos is not None else t.start_pos)
        for lane, end in enumerate(ends):
            if end < a:
                ends[lane] = b
                lane_of[i] = lane
                break
        else:
            lane_of[i] = len(ends)
            ends.append(b)
    return lane_of


def _transfer_title(t: Transfer) -> str:
    heavy = ", ".join(t.heavy_overlapped[:8]) + (" ..." if len(t.heavy_overlapped) > 8 else "")
    waited = f"#{t.wait_pos} {t.wait}" if t.wait else "never waited"
    return (
        f"{t.kind} {t.tag}\nissued #{t.start_pos} {t.start}, waited {waited}\n"
        f"buffer {t.buffer}, receives {t.recv_bytes} B\n"
        f"overlaps {len(t.overlapped)} compute nodes"
        + (f" ({len(t.heavy_overlapped)} heavy: {heavy})" if t.heavy_overlapped else "")
    )


def timeline_svg(
    sched: GraphSchedule, layers: list[str], lo: int = 0, hi: int | None = None, focus: str = ""
) -> str:
    """Labels and chart of the steps ``lo..hi`` of one graph; ``focus`` fades other layers."""
    hi = len(sched.steps) - 1 if hi is None else hi
    shown = [s for s in sched.steps[lo : hi + 1] if s.role != "view"]
    column = {s.pos: i for i, s in enumerate(shown)}

    def col(pos: int) -> int:
        # a position outside the window (or a view) maps to the nearest shown column
        if pos in column:
            return column[pos]
        if pos < lo or not shown:
            return 0
        if pos > hi:
            return len(shown) - 1
        return next((column[s.pos] for s in shown if s.pos >= pos), len(shown) - 1)

    px = max(3, min(10, 2400 // max(1, len(shown))))
    layer_set = set(layers)
    visible = [
        t
        for t in sched.transfers
        if t.start_pos <= hi and (t.wait_pos if t.wait_pos is not None else t.start_pos) >= lo
    ]
    rows: dict[str, list[Transfer]] = {}
    for t in visible:
        rows.setdefault(_row_of(t, layer_set), []).append(t)
    order = [r for r in layers if r in rows] + [r for r in rows if r not in layer_set]

    labels, parts = [], []
    y = _AXIS_H
    for r_i, row in enumerate(order):
        ts = rows[row]
        lane_of = _lanes(ts, col)
        height = _ROW_PAD * 2 + _LANE_H * (max(lane_of.values()) + 1)
        fill = "#f4f4f4" if r_i % 2 == 0 else "#ffffff"
        parts.append(
            f'<rect class="row" x="0" y="{y}" width="{len(shown) * px}" height="{height}" '
            f'fill="{fill}"/>'
        )
        labels.append(
            f'<text x="{_LABEL_W - 6}" y="{y + height / 2 + 4}" text-anchor="end">{_e(row)}</text>'
        )
        for i, t in enumerate(ts):
            a = col(t.start_pos)
            b = col(t.wait_pos) if t.wait_pos is not None else a
            exposed = not t.overlapped
            faded = focus and t.tag != focus
            style = ' stroke="#d00" stroke-width="1.5"' if exposed else ""
            style += ' opacity="0.25"' if faded else ""
            parts.append(
                f'<rect class="transfer" data-kind="{t.kind}" data-start="{a}" data-wait="{b}" '
                f'x="{a * px}" y="{y + _ROW_PAD + lane_of[i] * _LANE_H}" '
                f'width="{max(px, (b - a + 1) * px)}" height="{_LANE_H - 2}" '
                f'fill="{KIND_COLOURS.get(t.kind, "#888")}"{style}>'
                f"<title>{_e(_transfer_title(t))}</title></rect>"
            )
        y += height
    labels.append(f'<text x="{_LABEL_W - 6}" y="{y + 19}" text-anchor="end">compute</text>')
    for s in shown:
        if s.role != "compute":
            continue
        h = 22 if s.heavy else 8
        cls = "compute heavy" if s.heavy else "compute"
        title = f"#{s.pos} {s.name} ({s.op}), after {s.context or 'no transfer yet'}"
        parts.append(
            f'<rect class="{cls}" data-col="{column[s.pos]}" x="{column[s.pos] * px}" '
            f'y="{y + _COMPUTE_H - h - 2}" width="{max(1, px - 1)}" height="{h}">'
            f"<title>{_e(title)}</title></rect>"
        )
    y += _COMPUTE_H
    every = max(1, 60 // px)
    for i, s in enumerate(shown):
        if i % every == 0:
            parts.append(
                f'<text class="axis" x="{i * px}" y="{_AXIS_H - 6}">#{s.pos}</text>'
                f'<line x1="{i * px}" x2="{i * px}" y1="{_AXIS_H - 3}" y2="{y}" class="grid"/>'
            )
    width = len(shown) * px + 40
    return (
        f'<div class="timeline"><svg class="labels" width="{_LABEL_W}" height="{y}">'
        + "".join(labels)
        + f'</svg><div class="scroll"><svg class="chart" width="{width}" height="{y}" '
        f'xmlns="http://www.w3.org/2000/svg">' + "".join(parts) + "</svg></div></div>"
    )


def _table(t: Table) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in t.header)
    body = "".join(
        "<tr>" + "".join(f"<td>{_e('' if c is None else c)}</td>" for c in row) + "</tr>"
        for row in t.rows
    )
    return f"<table><caption>{_e(t.caption)}</caption><tr>{head}</tr>{body}</table>"


def _names(names: list[str], limit: int = 12) -> str:
    more = f" ... ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _layer_section(sched: GraphSchedule, layer: str, layers: list[str]) -> str:
    ts = [t for t in sched.transfers if t.tag == layer]
    if not ts:
        return ""
    lo = min(t.start_pos for t in ts)
    hi = max(t.wait_pos if t.wait_pos is not None else t.start_pos for t in ts)
    hidden = sum(1 for t in ts if t.heavy_overlapped)
    exposed = sum(1 for t in ts if not t.overlapped)
    rows = [
        [
            t.kind,
            t.buffer,
            t.recv_bytes,
            f"#{t.start_pos} {t.start}",
            f"#{t.wait_pos} {t.wait}" if t.wait else "never waited",
            len(t.overlapped),
            _names(t.heavy_overlapped) or ("nothing: exposed" if not t.overlapped else "-"),
        ]
        for t in ts
    ]
    table = Table(
        f"{layer}, {sched.label}: {len(ts)} transfers, {hidden} overlap a GEMM or attention "
        f"kernel, {exposed} overlap nothing",
        ["kind", "buffer", "bytes received", "issued", "waited", "compute overlapped", "heavy"],
        rows,
    )
    return (
        f"<h3>{_e(layer)} — {_e(sched.label)}</h3>"
        + timeline_svg(sched, layers, lo, hi, focus=layer)
        + _table(table)
    )


_CSS = """
body{font:13px/1.4 system-ui,sans-serif;margin:16px;color:#222}
h1{font-size:20px}h2{font-size:16px;margin-top:28px}h3{font-size:14px;margin-top:18px}
table{border-collapse:collapse;margin:8px 0 14px}td,th{border:1px solid #ccc;padding:2px 6px;
text-align:left;font-variant-numeric:tabular-nums}caption{text-align:left;font-weight:600;
padding:4px 0}.timeline{display:flex;align-items:flex-start;border:1px solid #ddd}
.scroll{overflow-x:auto;flex:1}svg text{font-size:11px}svg .axis{fill:#777;font-size:10px}
.grid{stroke:#e3e3e3}rect.compute{fill:#bbb}rect.compute.heavy{fill:#333}
rect.compute.hl{fill:#e8a200}rect.transfer:hover{stroke:#000;stroke-width:1.5}
.legend span{display:inline-block;padding:1px 8px;margin-right:6px;color:#fff;border-radius:3px}
"""

_SCRIPT = """
(function () {
  function mark(ev, on) {
    var t = ev.target, a = +t.dataset.start, b = +t.dataset.wait;
    t.ownerSVGElement.querySelectorAll('rect.compute').forEach(function (c) {
      var p = +c.dataset.col;
      c.classList.toggle('hl', on && p > a && p < b);
    });
  }
  document.querySelectorAll('rect.transfer').forEach(function (r) {
    r.addEventListener('mouseenter', function (ev) { mark(ev, true); });
    r.addEventListener('mouseleave', function (ev) { mark(ev, false); });
  });
  var charts = document.querySelectorAll('svg.chart'), width = 0;
  charts.forEach(function (s) { width = Math.max(width, s.getBoundingClientRect().width); });
  var root = document.documentElement.dataset;
  root.tspcCharts = charts.length;
  root.tspcTransfers = document.querySelectorAll('rect.transfer').length;
  root.tspcRenderedWidth = Math.round(width);
})();
"""


def render_page(page: SchedulePage) -> str:
    legend = "".join(
        f'<span style="background:{c}">{_e(k)}</span>' for k, c in KIND_COLOURS.items()
    )
    body = [f"<h1>{_e(page.title)}</h1>"]
    body += [f"<p>{_e(line)}</p>" for line in page.lines]
    body += [_table(t) for t in page.tables]
    body.append(
        f'<p class="legend">{legend} a bar runs from a transfer\'s start node to its wait node; '
        "red outline: nothing to overlap. Compute: dark = GEMM / attention kernel. Hover a bar "
        "to highlight the compute it overlaps; hover anything for its node.</p>"
    )
    for sched in page.schedules:
        body.append(
            f"<h2>{_e(sched.label)}: {len(sched.steps)} nodes, {len(sched.transfers)} transfers "
            f"(issue-order digest {_e(sched.issue_order_hash())})</h2>"
        )
        body.append(timeline_svg(sched, page.layers))
    for layer in page.layers:
        body += [_layer_section(sched, layer, page.layers) for sched in page.schedules]
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{_e(page.title)}</title><style>{_CSS}</style></head><body>"
        + "\n".join(body)
        + f"<script>{_SCRIPT}</script></body></html>\n"
    )
