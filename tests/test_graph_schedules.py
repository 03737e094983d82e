"""Graph-only checks of the TSP schedules, as rank r of D on the fake process group.

The compiled graphs run with fake collectives (no peers), which is enough to build and inspect
the forward and backward graphs aot_autograd produces.
"""

from __future__ import annotations

import pytest
import torch

from samples.reference_model import build_reference_model
from tests.helpers import compile_reference_step, count_collectives
from tspc.backend import COMPILED
from tspc.passes.schedule import is_view_or_pack
from tspc.runtime.comm import is_transfer, is_transfer_wait

pytestmark = pytest.mark.slow  # whole-model compiles in this process: seconds each

aten = torch.ops.aten


_COMPILED: dict[tuple, object] = {}


def compile_and_run(world: int, rank: int, fake_group, **model_kw):
    """One compile per (D, rank, model) for the whole module: the tests only read the graphs."""
    key = (world, rank, tuple(sorted(model_kw.items())))
    if key not in _COMPILED:
        fake_group(rank, world)
        _COMPILED[key] = compile_reference_step(**model_kw)
    return _COMPILED[key]


def per_tag(counter, op):
    return {tag: n for (name, tag), n in counter.items() if name == op}


def _counts_cases():
    """(world, kv_heads, last_rank): rank 0 and the last rank at D = 2; at D = 4 each head
    split (4, 2 and 1 K/V heads) once, alternating the rank, in the suite; the other rank of
    each in the extended tier."""
    for i, (world, kv_heads) in enumerate([(2, 2), (4, 4), (4, 2), (4, 1)]):
        for last_rank in (False, True):
            marks = [pytest.mark.extended] if world == 4 and last_rank != bool(i % 2) else []
            yield pytest.param(world, kv_heads, last_rank, marks=marks)


@pytest.mark.parametrize("world,kv_heads,last_rank", list(_counts_cases()))
def test_forward_schedule_counts_per_layer(world, kv_heads, last_rank, fake_group):
    rank = world - 1 if last_rank else 0
    cg = compile_and_run(world, rank, fake_group, num_kv_heads=kv_heads)
    assert {e.module for e in cg.report.matched} == {
        "layers.0.attn",
        "layers.0.mlp",
        "layers.1.attn",
        "layers.1.mlp",
    }
    (fwd,) = cg.aot.forward_gms
    c = count_collectives(fwd)
    attn = ["layers.0.attn", "layers.1.attn"]
    mlp = ["layers.0.mlp", "layers.1.mlp"]
    kv_groups = world if kv_heads % world == 0 else kv_heads
    for op, want, tags in [
        ("broadcast_start", world, attn),
        ("broadcast_wait", world, attn),
        ("all_gather_start", 2 * kv_groups, attn),
        ("ring_start", world - 1, mlp),
        ("ring_wait", world - 1, mlp),
    ]:
        assert per_tag(c, op) == dict.fromkeys(tags, want) | {
            k: v for k, v in per_tag(c, op).items() if k not in attn + mlp
        }, op
    # no all-reduce, reduce or reduce-scatter anywhere in a layer's forward
    for op in ("all_reduce_start", "reduce_start", "reduce_scatter_start"):
        assert not per_tag(c, op), op
    # the only other collective is the output gather of the logits
    assert per_tag(c, "all_gather_start").get("output") == 1


@pytest.mark.parametrize("world", [2, 4])
def test_backward_restreams_weights_and_routes_gradients_to_owners(world, fake_group):
    cg = compile_and_run(world, world - 1, fake_group, num_kv_heads=world)
    (bwd,) = cg.aot.backward_gms
    c = count_collectives(bwd)
    for tag in ("layers.0.attn", "layers.1.attn"):
        assert c[("broadcast_start", tag)] == world  # weights re-streamed, not saved
        assert c[("reduce_start", tag)] == world  # each shard's gradient to its owner
        assert c[("all_gather_start", tag)] == 2 * world  # K/V re-gathered
        assert c[("reduce_scatter_start", tag)] == 2 * world  # dK/dV to the token owners
    for tag in ("layers.0.mlp", "layers.1.mlp"):
        assert c[("ring_start", tag)] == 2 * (world - 1)  # weights + gradient accumulators
    replicated = {"embed.weight", "norm.weight", "lm_head.weight"}
    assert replicated <= set(per_tag(c, "all_reduce_start"))


def _transfer_waits_read(n):
    """The transfer waits whose results ``n`` reads, directly or through views and the
    zigzag reordering of a gathered buffer (narrow / cat / view)."""
    out, stack, seen = [], list(n.all_input_nodes), set()
    while stack:
        a = stack.pop()
        if a in seen:
            continue
        seen.add(a)
        if is_transfer_wait(a):
            out.append(a)
        elif is_view_or_pack(a):
            stack.extend(a.all_input_nodes)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_forward_saves_no_broadcast_weights_nor_gathered_kv(world, fake_group):
    cg = compile_and_run(world, 0, fake_group, num_kv_heads=world)
    (fwd,) = cg.aot.forward_gms
    output = next(n for n in fwd.graph.nodes if n.op == "output")
    produced_by_transfer = set()
    for n in fwd.graph.nodes:
        if is_transfer_wait(n):
            produced_by_transfer.add(n)
    # follow views of transferred buffers (and the zigzag reordering of gathered ones)
    frontier = list(produced_by_transfer)
    while frontier:
        n = frontier.pop()
        for u in n.users:
            is_view = u.op == "call_function" and any(
                k in str(u.target) for k in ("view", "slice", "getitem", "t.default", "cat")
            )
            if is_view and u not in produced_by_transfer:
                produced_by_transfer.add(u)
                frontier.append(u)
    saved = [a for a in output.args[0] if hasattr(a, "op")]
    logits = saved[0]
    leaked = [a.name for a in saved[1:] if a in produced_by_transfer and a is not logits]
    assert not leaked, f"forward saves transferred data for backward: {leaked}"


def test_collective_order_is_identical_on_every_rank(fake_group):
    world = 4
    orders = []
    for rank in range(world):
        cg = compile_and_run(world, rank, fake_group, num_kv_heads=2)
        seq = []
        for gm in cg.aot.forward_gms + cg.aot.backward_gms:
            for n in gm.graph.nodes:
                if (
                    n.op == "call_function"
                    and str(n.target).startswith("tspc.")
                    and (n.target._opname.endswith("_start"))
                ):
                    seq.append((n.target._opname, n.args[-1]))
        orders.append(seq)
    assert all(o == orders[0] for o in orders[1:])


def test_schedule_requests_next_weights_before_current_compute(fake_group):
    world = 4
    cg = compile_and_run(world, 2, fake_group, num_kv_heads=4)
    (fwd,) = cg.aot.forward_gms
    nodes = list(fwd.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    for tag in ("layers.0.attn", "layers.1.attn"):
        starts = [
            n
            for n in nodes
            if n.op == "call_function"
            and str(n.target) == "tspc.broadcast_start.default"
            and n.args[-1] == tag
        ]
        kernels = [
            n
            for n in nodes
            if n.op == "call_function"
            and str(n.target) == "tspc.zigzag_causal_attention.default"
            and any(
                w.args[0].target is torch.ops.tspc.all_gather_start.default
                and w.args[0].args[-1] == tag
                for w in _transfer_waits_read(n)
            )
        ]
        assert len(starts) == world and len(kernels) == world
        for r in range(world - 1):
            assert pos[starts[r + 1]] < pos[kernels[r]], f"step {r + 1} not prefetched"

    # Every wait sits right before the first use of what it returns: between them only other
    # collectives (later waits, the next transfer issued as soon as this one arrived) and the
    # packing of this rank's own shards that such a transfer sends (copies of parameters).
    def is_collective(b):
        return is_transfer(b)

    def packs_parameters(b):
        if b.op == "placeholder":
            return True
        return b.target in (aten.view.default, aten.cat.default) and all(
            packs_parameters(i) for i in b.all_input_nodes
        )

    for n in nodes:
        if is_transfer_wait(n) and n.users:
            first = min(n.users, key=pos.__getitem__)
            between = nodes[pos[n] + 1 : pos[first]]
            assert all(is_collective(b) or packs_parameters(b) for b in between), (
                n.name,
                [b.name for b in between],
            )


def test_world_size_one_has_no_communication():
    model = build_reference_model(num_layers=2)
    ref = build_reference_model(num_layers=2)
    ids = torch.randint(0, 256, (1, 24))
    COMPILED.clear()
    out = torch.compile(model, backend="tsp")(ids)
    torch.testing.assert_close(out, ref(ids), atol=0, rtol=0)
    (cg,) = COMPILED
    assert len(cg.report.matched) == 4
    assert not count_collectives(cg.aot.forward_gms[0])
