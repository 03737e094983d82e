"""Pass 5 — schedule for overlap: issue transfers early, wait late.

Every collective is a ``*_start`` node and a ``*_wait`` node (``runtime/comm.py``). This pass
moves

* each wait to just before the first node that uses its result, and
* each start up to just after the latest of its inputs — but, within one stream of transfers
  (same kind and layer: the D weight broadcasts of an attention, the hops of a ring), never above
  the wait of the transfer ``lookahead`` places before it. With ``lookahead = 1`` step r+1's
  weights are requested as soon as step r's have arrived, before step r's compute: one shard in
  use, one in flight, as the paper's double buffering.

It works on any FX graph that uses the tspc ops — the Dynamo-level graph and the forward and
backward graphs aot_autograd produces — and it only reorders, so every rank (whose graphs differ
only in constants) ends with the same order of collectives.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch.fx as fx

from tspc.runtime.comm import START_KIND, START_TO_WAIT, WAIT_OPS


@dataclass
class ScheduleReport:
    starts_moved: int = 0
    waits_moved: int = 0
    streams: int = 0


def _stream_key(start: fx.Node) -> tuple:
    kind = START_KIND[start.target]
    tag = start.args[-1] if start.args and isinstance(start.args[-1], str) else ""
    return kind, tag


def _wait_of(start: fx.Node) -> fx.Node | None:
    wait_op = START_TO_WAIT[start.target]
    for u in start.users:
        if u.op == "call_function" and u.target is wait_op:
            return u
    return None


def schedule_overlap(gm: fx.GraphModule, lookahead: int = 1) -> ScheduleReport:
    g = gm.graph
    report = ScheduleReport()
    # 1. waits as late as possible
    for node in list(g.nodes):
        if node.op == "call_function" and node.target in WAIT_OPS and node.users:
            order = {n: i for i, n in enumerate(g.nodes)}
            first = min(node.users, key=order.__getitem__)
            if first.prev is not node:
                first.prepend(node)
                report.waits_moved += 1
    # 2. starts as early as their inputs and the stream's double buffering allow
    streams: dict[tuple, list[fx.Node]] = defaultdict(list)
    for node in g.nodes:
        if node.op == "call_function" and node.target in START_KIND:
            streams[_stream_key(node)].append(node)
    report.streams = len(streams)
    for starts in streams.values():
        for i, start in enumerate(starts):
            order = {n: k for k, n in enumerate(g.nodes)}
            anchors = list(start.all_input_nodes)
            if i >= lookahead:
                barrier = _wait_of(starts[i - lookahead])
                if barrier is not None:
                    anchors.append(barrier)
            if not anchors:
                continue
            anchor = max(anchors, key=order.__getitem__)
            if anchor.next is not start and order[anchor] < order[start]:
                anchor.append(start)
                report.starts_moved += 1
    g.lint()
    gm.recompile()
    return report


def comm_order(gm: fx.GraphModule) -> list[tuple[str, str]]:
    """The (kind, tag) of every collective start, in issue order — equal on every rank."""
    return [
        _stream_key(n) for n in gm.graph.nodes if n.op == "call_function" and n.target in START_KIND
    ]
