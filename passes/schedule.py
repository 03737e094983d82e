"""Pass 5 — schedule for overlap: issue transfers early, wait late, bound what is in flight.

Every collective is a ``*_start`` node and a ``*_wait`` node (``runtime/comm.py``). This pass
only reorders nodes, in three phases over the whole graph:

1. **Waits on what compute needs** (broadcast, all-gather, ring hop) move down to just before
   the first node that really uses the result; the free views that unpack it travel with the
   wait, so a packed weight's wait lands at its first GEMM, not at the slicing.
2. **Starts move up**, together with their *exclusive producers* — the compute whose only
   purpose is the transfer (a K projection and its RoPE feeding the K all-gather, the weight
   gradients feeding a reduce, the packing of a shard) — to just after the latest of their
   inputs and of their *window*:

   * weight transfers (every broadcast and every ring hop that carries weights, across all
     layers, in order) form one stream: transfer i starts only after transfer i-1 has
     arrived (``lookahead = 1``). That is the paper's double buffering: one shard in use,
     one in flight, never more. It is also the cross-layer prefetch: layer i+1's first
     broadcast is issued during layer i's last ring step, and a ring's first hop during the
     attention's last head group.
   * K/V all-gathers (every all-gather except the output gather) form one stream with a
     window of one head group (K and V): a group is requested only when the group before it
     has arrived. In backward the K/V inputs are saved tensors, so without the window each
     layer's first gather would move to the top of the graph and keep a gathered head group
     alive across the other layers' backward.
   * gradient ring hops, reduce, reduce-scatter and all-reduce starts have no window: they go
     as soon as their data is ready (their producers are pulled ahead of other compute).
   * the MLP ring's sub-shard hops (``ring_chunk_start``, ``ring_mlp(..., hop_chunks=k)``)
     do not move, nor do their waits: the ring issues each before the chunk's compute and
     waits it right after, which is what keeps about one chunk in flight. They still count in
     the weight stream, so the next weight transfer waits for the ring's last hop.
3. **Waits on results nobody needs soon** (reduce of a weight gradient to its owner,
   reduce-scatter of dK/dV, all-reduce of replicated gradients) move down, together with the
   cheap (non-GEMM) compute that consumes them, to just before their first GEMM or
   collective user — but no later than the start of the next transfer of their kind
   (reduce: the next one; reduce-scatter and all-reduce: the one after next), and a reduce no
   later than the first gradient transfer (ring hop or reduce) of another layer. That keeps one
   weight-gradient shard (two dK/dV or all-reduce buffers) in flight instead of a layer's worth,
   and no layer's reduce buffers beside the next layer's ring accumulators.

Within an attention head group the order becomes: weights of group r arrive, group r+1's
weights are requested, K is projected (and rotated) and its gather issued, V is projected and
its gather issued, Q is projected while both travel, then attention. The gather of group r+1
cannot also overlap group r's attention: that needs group r+1's projections, hence its
weights, before group r's output projection is done with group r's weights — a third shard.

Every rank runs the same program with different constants (and, in backward, a differently
decomposed zigzag attention kernel). Every decision here depends only on data dependencies,
op kinds and the order of nodes that every rank shares, so the order of collective starts —
which must be identical on every rank, or the collectives deadlock — is the same everywhere
(tests/test_graph_schedules.py checks it).

It works on any FX graph that uses the tspc ops: the Dynamo-level graph and the forward and
backward graphs aot_autograd produces. Cost: O(n log n) plus the size of the moved regions.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch.fx as fx

from tspc.runtime.comm import (
    FIXED_STARTS,
    START_KIND,
    wait_of,
)

from .schedule_nodes import (  # noqa: F401  (is_heavy, is_view_or_pack, pin_mutation_order: re-exported)
    _is_pack,
    _is_start,
    _is_view,
    _is_wait,
    is_heavy,
    is_mode_switch,
    is_pinned,
    is_view_or_pack,
    mode_regions,
    pin_mutation_order,
)

# Kinds whose waits feed compute (phase 1) and those whose results are only accumulated or
# returned (phase 3).
INPUT_KINDS = frozenset({"broadcast", "all_gather", "ring"})
OUTPUT_KINDS = frozenset({"reduce", "reduce_scatter", "all_reduce"})
# Transfers of an output kind that may be in flight at once (see phase 3 above).
OUTPUT_WINDOWS = {"reduce": 1, "reduce_scatter": 2, "all_reduce": 2}
OUTPUT_TAG = "output"  # the gather of the graph's outputs: not part of the K/V stream
_HOIST_PRIORITY = {"weights": 0, "kv": 1}


@dataclass
class ScheduleReport:
    starts_moved: int = 0
    waits_moved: int = 0
    streams: int = 0
    weight_transfers: int = 0
    kv_gathers: int = 0
    nodes_moved: int = 0
    families: dict[str, int] = field(default_factory=dict)


# --------------------------------------------------------------------------- node order


class _Order:
    """Positions of the graph's nodes as sortable integers, kept valid while nodes move.

    Moving a block of nodes gives them positions inside the gap they land in; when a gap is
    used up every node is renumbered (rare), so comparisons stay O(1) without re-enumerating
    the graph after each move. No move crosses a grad-mode or autocast switch (the switches
    are pinned; each node keeps the stretch between them it was traced in): a softmax hoisted
    out of PhiMoE's ``enable_grad`` stretch into the ``no_grad`` one before it ran without
    recording its gradient (issue 27).
    """

    GAP = 1 << 24

    def __init__(self, graph: fx.Graph):
        self.graph = graph
        self.pos: dict[fx.Node, int] = {}
        self.region = mode_regions(graph)
        self.switches = [n for n in graph.nodes if is_mode_switch(n)]
        self._renumber()

    def _renumber(self) -> None:
        self.pos = {n: (i + 1) * self.GAP for i, n in enumerate(self.graph.nodes)}
        self.end = (len(self.pos) + 1) * self.GAP

    def opener(self, n: fx.Node) -> fx.Node | None:
        """The mode switch that opens ``n``'s stretch (nothing moves above it with ``n``)."""
        r = self.region.get(n, 0)
        return self.switches[r - 1] if r else None

    def closer(self, n: fx.Node) -> fx.Node | None:
        """The mode switch that ends ``n``'s stretch (nothing moves below it with ``n``)."""
        r = self.region.get(n, 0)
        return self.switches[r] if r < len(self.switches) else None

    def __getitem__(self, n: fx.Node) -> int:
        return self.pos[n]

    def _pos_or_end(self, n: fx.Node) -> int:
        return self.pos.get(n, self.end)  # the graph's root sentinel sorts last

    def place_after(self, anchor: fx.Node, block: list[fx.Node]) -> bool:
        """Put ``block`` (in this order) right after ``anchor``; False if already there or
        if a node of ``block`` would leave its grad-mode stretch."""
        if any(self.region.get(b, 0) != self.region.get(anchor, 0) for b in block):
            return False
        inside = set(block)
        cur = anchor
        for b in block:
            if cur.next is not b:
                break
            cur = b
        else:
            return False
        nxt = anchor.next
        while nxt in inside:
            nxt = nxt.next
        lo, hi = self.pos[anchor], self._pos_or_end(nxt)
        if hi - lo <= len(block):
            self._renumber()
            lo, hi = self.pos[anchor], self._pos_or_end(nxt)
        step = (hi - lo) // (len(block) + 1)
        cur = anchor
        for i, b in enumerate(block, 1):
            cur.append(b)
            self.pos[b] = lo + i * step
            cur = b
        return True

    def place_before(self, target: fx.Node, block: list[fx.Node]) -> bool:
        prev = target.prev
        inside = set(block)
        while prev in inside:
            prev = prev.prev
        if prev.op == "root":  # nothing before the target: cannot happen for a wait's user
            return False
        return self.place_after(prev, block)


# --------------------------------------------------------------------------- transfers


@dataclass
class Transfer:
    start: fx.Node
    wait: fx.Node | None
    kind: str
    tag: str
    family: str  # "weights", "kv", or the kind for the others
    # Issued and waited where the code that made it put them (the MLP ring's sub-shard hops):
    # never moved, but still counted in its family's stream, so the transfers after it wait
    # for it.
    fixed: bool = False


def _is_opaque_ring(n: fx.Node) -> bool:
    return n.op == "call_function" and getattr(n.target, "__name__", "") == "ring_mlp"


def _tag_of_ring(n: fx.Node) -> str:
    return n.args[-1] if n.args and isinstance(n.args[-1], str) else ""


def _tag(start: fx.Node) -> str:
    return start.args[-1] if start.args and isinstance(start.args[-1], str) else ""


def _stream_key(start: fx.Node) -> tuple:
    return START_KIND[start.target], _tag(start)


def _leaves(x: fx.Node) -> Iterable[fx.Node]:
    """What a buffer is made of, looking through views and packing copies."""
    seen: set[fx.Node] = set()
    stack = [x]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if _is_view(n) or _is_pack(n):
            stack.extend(n.all_input_nodes)
        else:
            yield n


def transfers(graph: fx.Graph) -> list[Transfer]:
    """Every collective of the graph in issue order, with the stream family it belongs to.

    A ring hop carries weights when its buffer is made of graph inputs (this rank's own shard)
    or of what an earlier weight hop received; otherwise it carries a gradient accumulator.
    """
    out: list[Transfer] = []
    weight_waits: set[fx.Node] = set()
    for n in graph.nodes:
        if _is_opaque_ring(n):
            # The MLP ring before aot_autograd traces it: one node that streams every shard.
            # Weight transfers after it may not be hoisted above it (it would put a third
            # shard in flight during the ring); it never moves itself.
            out.append(Transfer(n, n, "ring_mlp", _tag_of_ring(n), "weights"))
            continue
        if not _is_start(n):
            continue
        kind = START_KIND[n.target]
        tag = _tag(n)
        wait = wait_of(n)
        if kind == "broadcast":
            family = "weights"
        elif kind == "ring":
            x = n.args[0]
            ok = all(
                leaf.op in ("placeholder", "get_attr") or leaf in weight_waits
                for leaf in _leaves(x)
            )
            family = "weights" if ok else "grad_ring"
        elif kind == "all_gather":
            family = "output_gather" if tag == OUTPUT_TAG else "kv"
        else:
            family = kind
        if family == "weights" and wait is not None:
            weight_waits.add(wait)
        out.append(Transfer(n, wait, kind, tag, family, fixed=n.target in FIXED_STARTS))
    return out


# --------------------------------------------------------------------------- the pass


def schedule_overlap(gm: fx.GraphModule, lookahead: int = 1) -> ScheduleReport:
    """Reorder ``gm`` for overlap (module docstring); ``lookahead`` weight transfers (and as
    many K/V head groups) may be in flight beyond the one in use."""
    g = gm.graph
    report = ScheduleReport()
    xfers = transfers(g)
    if not xfers:
        return report
    pin_mutation_order(g)
    order = _Order(g)
    report.streams = len({(t.kind, t.tag) for t in xfers})
    for t in xfers:
        report.families[t.family] = report.families.get(t.family, 0) + 1
    report.weight_transfers = report.families.get("weights", 0)
    report.kv_gathers = report.families.get("kv", 0)
    windows = {"weights": lookahead, "kv": 2 * lookahead}

    # 1. waits on inputs of compute: down to the first real use
    for t in xfers:
        if t.kind not in INPUT_KINDS or t.fixed or t.wait is None or not t.wait.users:
            continue
        if _sink(order, t.wait, _is_view, bound=None):
            report.waits_moved += 1

    # 2. starts: up, with their exclusive producers, within their stream's window
    gates: dict[fx.Node, fx.Node] = {}
    for family, window in windows.items():
        members = [t for t in xfers if t.family == family]
        for i in range(window, len(members)):
            before = members[i - window].wait
            if before is not None:
                gates[members[i].start] = before
    last_placeholder = _last_placeholder(g)
    hoisted: set[fx.Node] = set()
    # Weight transfers claim their place first, then K/V gathers, then the rest: when two
    # starts land behind the same node, the one processed first is issued first.
    for t in sorted(xfers, key=lambda t: _HOIST_PRIORITY.get(t.family, len(_HOIST_PRIORITY))):
        if t.kind == "ring_mlp" or t.fixed:
            continue
        moved = _hoist(order, t.start, gates.get(t.start), last_placeholder, hoisted)
        if moved:
            report.starts_moved += 1
            report.nodes_moved += moved - 1

    # 3. waits on results: down with their cheap consumers, bounded by the next transfers
    for kind, window in OUTPUT_WINDOWS.items():
        # In issue order as phase 2 left it: the window counts transfers as they are issued.
        members = sorted((t for t in xfers if t.kind == kind), key=lambda t: order[t.start])
        for i, t in enumerate(members):
            if t.wait is None:
                continue
            bound = members[i + window].start if i + window < len(members) else None
            if kind == "reduce":
                # A layer's weight-gradient reduce also completes before the next layer's
                # gradients start to travel: else its send and receive buffers stay alive
                # through that layer's MLP ring, beside the ring's accumulators.
                later = [
                    u.start
                    for u in xfers
                    if u.family in ("grad_ring", "reduce")
                    and u.tag != t.tag
                    and order[u.start] > order[t.start]
                ]
                if later:
                    first = _first_producer(order, min(later, key=order.__getitem__), t.start)
                    if bound is None or order[first] < order[bound]:
                        bound = first
            if _sink(order, t.wait, _is_cheap, bound=bound):
                report.waits_moved += 1

    g.lint()
    gm.recompile()
    return report


def _last_placeholder(g: fx.Graph) -> fx.Node:
    last = None
    for n in g.nodes:
        if n.op == "placeholder":
            last = n
    return last if last is not None else next(iter(g.nodes))


def _first_producer(order: _Order, start: fx.Node, after: fx.Node) -> fx.Node:
    """The earliest GEMM (or ``start`` itself) among what ``start`` sends that is computed after
    ``after``, seen back through cheap ops: where the buffers ``start`` sends begin to exist."""
    first, seen, stack = start, {start}, list(start.all_input_nodes)
    while stack:
        n = stack.pop()
        if n in seen or order[n] <= order[after]:
            continue
        seen.add(n)
        if order[n] < order[first]:
            first = n
        if not is_heavy(n):
            stack.extend(n.all_input_nodes)
    return first


def _is_cheap(n: fx.Node) -> bool:
    return not is_heavy(n) and not is_pinned(n)


def _sink(order: _Order, wait: fx.Node, travels, bound: fx.Node | None) -> bool:
    """Move ``wait`` down to just before the first user that does not ``travel`` with it (or
    before ``bound``, if that comes first); the users that travel come along."""
    cone: set[fx.Node] = set()
    stack = [wait]
    while stack:
        n = stack.pop()
        for u in n.users:
            if u not in cone and travels(u) and not is_pinned(u):
                cone.add(u)
                stack.append(u)
    blockers = [u for n in (wait, *cone) for u in n.users if u not in cone]
    if bound is not None:
        blockers.append(bound)
    if (closer := order.closer(wait)) is not None:
        blockers.append(closer)  # a wait stays in its grad-mode stretch
    if not blockers:
        return False
    target = min(blockers, key=order.__getitem__)
    if order[target] <= order[wait]:
        if bound is not None and target is bound and order[bound] < order[wait]:
            # Already later than its window allows (its consumers are late): pull it up, with
            # what it reads that is computed after the bound if that can move; else leave it.
            inputs = _inputs_after(order, wait, bound)
            if inputs is None:
                return False
            return order.place_before(bound, [*inputs, wait])
        return False
    block = [wait] + sorted((c for c in cone if order[c] < order[target]), key=order.__getitem__)
    return order.place_before(target, block)


def _inputs_after(order: _Order, node: fx.Node, bound: fx.Node) -> list[fx.Node] | None:
    """What ``node`` reads, directly or not, that comes after ``bound``, in graph order; None
    if one of those may not move (a transfer, a pinned node)."""
    found: set[fx.Node] = set()
    stack = [i for i in node.all_input_nodes if order[i] > order[bound]]
    while stack:
        n = stack.pop()
        if n in found:
            continue
        if is_pinned(n) or _is_start(n):
            return None
        found.add(n)
        stack.extend(i for i in n.all_input_nodes if order[i] > order[bound])
    return sorted(found, key=order.__getitem__)


def _hoist(
    order: _Order,
    start: fx.Node,
    gate: fx.Node | None,
    floor: fx.Node,
    hoisted: set[fx.Node],
) -> int:
    """Move ``start`` up to just after the latest of its gate and the nodes it needs that
    cannot move; its exclusive producers come along. Returns how many nodes moved."""
    anchor = floor
    if gate is not None and order[gate] > order[anchor]:
        anchor = gate
    if (opener := order.opener(start)) is not None and order[opener] > order[anchor]:
        anchor = opener  # a start and its producers stay in their grad-mode stretch
    if order[anchor] >= order[start]:
        if anchor is gate and order[gate] > order[start]:
            return _delay_to(order, start, gate, hoisted)
        return 0
    cone: set[fx.Node] = set()
    heap = [(-order[i], id(i), i) for i in start.all_input_nodes]
    heapq.heapify(heap)
    seen: set[fx.Node] = set()
    while heap:
        neg, _, n = heap[0]
        if -neg <= order[anchor]:
            break
        heapq.heappop(heap)
        if n in seen:
            continue
        seen.add(n)
        if _may_travel(n, start, cone):
            cone.add(n)
            for i in n.all_input_nodes:
                if i not in seen:
                    heapq.heappush(heap, (-order[i], id(i), i))
        else:
            anchor = n  # the latest node that stays: everything left in the heap is earlier
            break
    # Land after what earlier starts already put behind this anchor, keeping their order.
    at, absorbed = _landing(anchor, cone | {start}, hoisted)
    block = sorted(cone | absorbed, key=order.__getitem__) + [start]
    if not order.place_after(at, block):
        return 0
    hoisted.update(block)
    return len(block)


def _landing(
    anchor: fx.Node, block: set[fx.Node], hoisted: set[fx.Node]
) -> tuple[fx.Node, set[fx.Node]]:
    """Where a block placed "right after ``anchor``" goes: after what earlier starts already
    put there (so they keep their order) and, behind a wait, after the free views that unpack
    what arrived — a wait stays directly followed by its first use. Members of the block met
    on the way are passed (they move with it). Behind a wait, a free view that reads a block
    member joins the block (returned as the second item): one split of a packed buffer feeds
    every weight's view, and the split moving with one projection must not leave the other
    views — and whatever earlier starts put behind them — stranded ahead of the block. Any
    other node that reads a block member stops the walk."""
    at = anchor
    # what arrived and its views (a block member that is one still unpacks it)
    unpacked = {anchor} if _is_wait(anchor) else set()
    absorbed: set[fx.Node] = set()
    members = set(block)
    nxt = anchor.next
    while nxt.op not in ("root", "output"):
        if nxt in members:
            if _is_view(nxt) and any(i in unpacked for i in nxt.all_input_nodes):
                unpacked.add(nxt)
            nxt = nxt.next
            continue
        free_view = _is_view(nxt) and any(i in unpacked for i in nxt.all_input_nodes)
        reads_block = any(i in members for i in nxt.all_input_nodes)
        if free_view and reads_block:
            absorbed.add(nxt)
            members.add(nxt)
            unpacked.add(nxt)
            nxt = nxt.next
            continue
        if not (nxt in hoisted or free_view) or reads_block:
            break
        if free_view:
            unpacked.add(nxt)
        at = nxt
        nxt = nxt.next
    return at, absorbed


def _delay_to(order: _Order, start: fx.Node, gate: fx.Node, hoisted: set[fx.Node]) -> int:
    """A start issued before its window opens (its gate's wait moved below it in phase 1):
    move it down to just after the gate, so that no more than the window is in flight."""
    if any(order[u] <= order[gate] for u in start.users):
        return 0
    at, _ = _landing(gate, {start}, hoisted)  # nothing joins: no view reads a start's handle
    if not order.place_after(at, [start]):
        return 0
    hoisted.add(start)
    return 1


def _may_travel(n: fx.Node, start: fx.Node, cone: set[fx.Node]) -> bool:
    """Whether ``n`` may move up with ``start``: free views, packs of graph inputs, and
    compute whose only consumers are the transfer (or other transfers, or the graph output)."""
    if n.op == "get_attr":
        return True
    if n.op not in ("call_function", "call_method") or is_pinned(n):
        return False
    if _is_view(n):
        return True
    if _is_pack(n) and all(leaf.op in ("placeholder", "get_attr") for leaf in _leaves(n)):
        return True  # a copy of parameters: ready from the top of the graph
    for u in n.users:
        if u in cone or u is start or u.op == "output" or _is_start(u) or _is_wait(u):
            continue
        return False
    return True
