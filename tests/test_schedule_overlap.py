"""The overlap schedule, on the forward and backward graphs aot_autograd produces (rank r of D,
fake process group): what is issued when, what is waited when, and what is in flight.

* the next weight transfer (broadcast or ring hop, across layers) is issued after the current
  one arrived and before the compute that uses it; waits come as late as possible;
* at most two weight shards (one in use, one in flight) and two K/V head groups exist at once;
* K/V gathers and weight-gradient reduces overlap GEMMs; nothing a layer sends is exposed;
* every rank issues the same collectives in the same order.
"""

from __future__ import annotations

import operator

import pytest
import torch
import torch.distributed as dist
import torch.fx as fx

from tests.helpers import compile_reference_step
from tspc.graph_comm import read_schedule
from tspc.passes.schedule import is_heavy, is_view_or_pack, transfers

pytestmark = pytest.mark.slow  # whole-model compiles in this process: seconds each

WORLD = 4


def _compile(world: int, rank: int, **model_kw):
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        cg = compile_reference_step(**model_kw)
        return cg.aot.forward_gms[0], cg.aot.backward_gms[0]
    finally:
        dist.destroy_process_group()
        torch.compiler.reset()


@pytest.fixture(scope="module")
def graphs():
    """Forward and backward graphs of rank 1 of 4 (one K/V head per head group)."""
    return _compile(WORLD, 1, num_kv_heads=4)


def _positions(gm: fx.GraphModule) -> dict[fx.Node, int]:
    return {n: i for i, n in enumerate(gm.graph.nodes)}


def _data_users(node: fx.Node) -> list[fx.Node]:
    """Users of ``node``'s buffer, looking through views and packing copies (the buffer's
    readers; a gathered buffer reaches attention through its zigzag reordering's ``cat``)."""
    out, stack, seen = [], [node], set()
    while stack:
        n = stack.pop()
        for u in n.users:
            if u in seen:
                continue
            seen.add(u)
            out.append(u)
            is_call = u.op == "call_function"
            if is_call and (is_view_or_pack(u) or u.target is operator.getitem):
                stack.append(u)
    return out


def _first_heavy_use(wait: fx.Node, pos) -> fx.Node:
    heavy = [u for u in _data_users(wait) if is_heavy(u)]
    assert heavy, f"{wait.name} feeds no GEMM"
    return min(heavy, key=pos.__getitem__)


def _max_in_flight(gm: fx.GraphModule, family: str) -> int:
    """Most buffers of ``family`` that exist at once: received and still read, or in flight."""
    pos = _positions(gm)
    xs = [t for t in transfers(gm.graph) if t.family == family]
    worst = 0
    for t in xs:
        p = pos[t.start]
        n = 1  # the one being issued
        for o in xs:
            if o is t or o.wait is None:
                continue
            in_flight = pos[o.start] < p < pos[o.wait]
            last = max((pos[u] for u in _data_users(o.wait)), default=pos[o.wait])
            alive = pos[o.wait] < p < last
            n += in_flight or alive
        worst = max(worst, n)
    return worst


@pytest.mark.parametrize("which", ["forward", "backward"])
def test_next_weights_issued_after_current_arrived_and_before_its_compute(graphs, which):
    gm = graphs[0] if which == "forward" else graphs[1]
    pos = _positions(gm)
    weights = [t for t in transfers(gm.graph) if t.family == "weights"]
    assert len(weights) >= 2 * (WORLD + WORLD - 1) - 2
    for prev, nxt in zip(weights, weights[1:]):
        assert pos[prev.wait] < pos[nxt.start], f"{nxt.start.name} issued before {prev.wait.name}"
        use = _first_heavy_use(prev.wait, pos)
        assert pos[nxt.start] < pos[use], (
            f"{which}: {nxt.start.name} ({nxt.tag}) is issued after {use.name}, the first GEMM "
            f"on what {prev.wait.name} ({prev.tag}) received"
        )


@pytest.mark.parametrize("which", ["forward", "backward"])
def test_at_most_two_weight_shards_and_two_kv_groups(graphs, which):
    gm = graphs[0] if which == "forward" else graphs[1]
    assert _max_in_flight(gm, "weights") <= 2
    assert _max_in_flight(gm, "kv") <= 4  # a K/V head group in use, the next in flight


def test_layers_prefetch_across_their_boundary(graphs):
    fwd, bwd = graphs
    for gm, first_kind in ((fwd, "broadcast"), (bwd, "ring")):
        pos = _positions(gm)
        weights = [t for t in transfers(gm.graph) if t.family == "weights"]
        for prev, nxt in zip(weights, weights[1:]):
            if prev.tag != nxt.tag:  # the first transfer of the next layer: during this one
                assert pos[nxt.start] < pos[_first_heavy_use(prev.wait, pos)]
        first = next(t for t in weights if t.kind == first_kind)
        # the graph's first weight transfer has no transfer before it: it goes at the top
        assert pos[first.start] < min(pos[n] for n in gm.graph.nodes if is_heavy(n))


@pytest.mark.parametrize("which", ["forward", "backward"])
def test_waits_come_as_late_as_possible(graphs, which):
    gm = graphs[0] if which == "forward" else graphs[1]
    pos = _positions(gm)
    nodes = list(gm.graph.nodes)
    for t in transfers(gm.graph):
        if t.kind not in ("broadcast", "all_gather", "ring") or t.tag == "output":
            continue
        use = _first_heavy_use(t.wait, pos) if t.family != "grad_ring" else None
        if use is None:
            continue
        between = nodes[pos[t.wait] + 1 : pos[use]]
        assert not [b.name for b in between if is_heavy(b)], (
            f"{t.wait.name} waits before GEMMs that do not need it"
        )


def test_no_forward_transfer_of_a_layer_is_exposed(graphs):
    sched = read_schedule(graphs[0], rank=1, label="forward")
    layer_transfers = [t for t in sched.transfers if t.tag != "output"]
    assert layer_transfers
    for t in layer_transfers[1:]:  # the first hides behind the embedding (no GEMM before it)
        assert t.heavy_overlapped, f"{t.kind} {t.start} ({t.tag}) overlaps no GEMM"
    gathers = [t for t in layer_transfers if t.kind == "all_gather"]
    assert len(gathers) == 2 * WORLD * 2
    for t in gathers:  # K while V and Q are projected, V while Q is
        assert t.heavy_overlapped, f"K/V gather {t.start} overlaps no GEMM"


def test_backward_gradient_transfers_overlap_and_stay_bounded(graphs):
    bwd = graphs[1]
    pos = _positions(bwd)
    sched = read_schedule(bwd, rank=1, label="backward")
    for t in sched.transfers:
        if t.kind in ("broadcast", "all_gather", "ring", "reduce", "reduce_scatter"):
            assert t.overlapped, f"{t.kind} {t.start} ({t.tag}) is exposed"
    reduces = [t for t in transfers(bwd.graph) if t.kind == "reduce"]
    assert len(reduces) == 2 * WORLD
    for prev, nxt in zip(reduces, reduces[1:]):  # one weight-gradient shard in flight
        assert pos[prev.wait] < pos[nxt.start]
    heavy_between = [
        any(is_heavy(n) for n in list(bwd.graph.nodes)[pos[t.start] : pos[t.wait]])
        for t in reduces[:-1]
    ]
    assert all(heavy_between), "a weight-gradient reduce overlaps no GEMM"


@pytest.mark.parametrize("world,kv_heads", [(2, 2)])
def test_collective_order_is_identical_on_every_rank(world, kv_heads):
    orders = []
    for rank in range(world):
        fwd, bwd = _compile(world, rank, num_kv_heads=kv_heads)
        orders.append(
            [
                (t.kind, *(a for a in t.start.args[1:] if not isinstance(a, fx.Node)))
                for gm in (fwd, bwd)
                for t in transfers(gm.graph)
            ]
        )
    assert all(o == orders[0] for o in orders[1:])
