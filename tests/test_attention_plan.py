"""The attention rewrite's plan (``passes/attention_plan.py``) without a graph: what each step's
broadcast packs, checked against the weights' shapes (every used weight row moves exactly once,
from the rank that owns it) and the bytes against the paper's formula written out here."""

from __future__ import annotations

import pytest

from tspc.passes.attention_plan import AttentionSpec, ProjectionSlots, plan_attention

HIDDEN, HEAD_DIM, BATCH, SEQ, ELEM = 64, 8, 2, 16, 4


def spec(world: int, rank: int, q_heads: int = 8, kv_heads: int = 8, cross=()) -> AttentionSpec:
    """Separate Q, K, V projections (Linear, ``[out, in]``, Q with a bias) and an O."""

    def proj(heads: int, kv_only: bool, bias: bool, name: str) -> ProjectionSlots:
        rows = heads * HEAD_DIM
        return ProjectionSlots(heads, 0, rows, (rows, HIDDEN), 0, bias, kv_only, name)

    return AttentionSpec(
        module="layers.0.attn",
        world=world,
        rank=rank,
        q_heads=q_heads,
        kv_heads=kv_heads,
        head_dim=HEAD_DIM,
        projections=(
            proj(q_heads, False, True, "q.weight"),
            proj(kv_heads, True, False, "k.weight"),
            proj(kv_heads, True, False, "v.weight"),
        ),
        o_shape=(HIDDEN, q_heads * HEAD_DIM),
        o_transposed=False,
        elem_size=ELEM,
        k_numel=BATCH * kv_heads * SEQ // world * HEAD_DIM,  # this rank's keys
        k_elem_size=ELEM,
        kernel="zigzag_causal",
        cross=cross,
    )


def covered(plan, name: str) -> list[tuple[int, int]]:
    """The [start, stop) slices of one tensor over all steps, sorted."""
    return sorted(
        (c.spec.start, c.spec.stop) for step in plan.steps for c in step if c.name == name
    )


@pytest.mark.parametrize("world", [1, 2, 4])
def test_every_weight_row_moves_once(world):
    plan = plan_attention(spec(world, 0))
    rows = HEAD_DIM * 8
    for name in ("p0_w", "p0_b", "p1_w", "p2_w", "o_w"):
        slices = covered(plan, name)
        assert len(slices) == world, (name, slices)
        assert slices[0][0] == 0 and slices[-1][1] == rows, (name, slices)
        assert all(a[1] == b[0] for a, b in zip(slices, slices[1:])), (name, slices)
    assert not plan.shared_kv and plan.replicated_kv == () and plan.sweeps == 1
    r = plan.report
    assert (r.steps, r.local_heads, r.local_kv_heads) == (world, 8 // world, 8 // world)
    assert (r.broadcasts, r.kv_gathers) == ((world, 2 * world) if world > 1 else (0, 0))


@pytest.mark.parametrize("rank", [0, 3])
def test_bytes_received_are_the_formula(rank):
    """PAPER_NOTES' per-layer attention traffic: (D-1)/D of the layer's weights, and
    2 (D-1)/D B S h_kv d elements of keys and values."""
    world = 4
    plan = plan_attention(spec(world, rank))
    weights = 3 * HIDDEN * HIDDEN + HIDDEN  # q (with bias), k, v
    weights += HIDDEN * HIDDEN  # o
    kv = 2 * (world - 1) * BATCH * SEQ * 8 * HEAD_DIM // world
    expected = (weights * (world - 1) // world + kv) * ELEM
    assert plan.report.predicted_recv_bytes == expected
    assert plan.report.shard_numel == weights // world


def test_fewer_kv_heads_than_ranks_share_them_and_hold_kv_weights_whole():
    plan = plan_attention(spec(4, 1, q_heads=8, kv_heads=2))
    assert plan.shared_kv and plan.span == 2 and plan.replicated_kv == (1, 2)
    assert [plan.primary(r) for r in range(4)] == [True, False, True, False]
    assert [plan.reuses_kv(r) for r in range(4)] == [False, True, False, True]
    # separate K/V weights are in no pack; Q and O still split four ways
    assert covered(plan, "p1_w") == covered(plan, "p2_w") == []
    assert len(covered(plan, "o_w")) == 4
    reason, fix = plan.report.held_whole
    assert "k.weight, v.weight" in reason and "fewer than D=4" in reason and fix
    assert plan.report.kv_gathers == 2 * 2  # one gather of K and V per KV head


def test_statistics_over_all_heads_take_two_sweeps():
    plan = plan_attention(spec(2, 0, cross=(("sum_1", "mean"),)))
    assert plan.sweeps == 2 and plan.report.steps == plan.report.broadcasts == 4
    for r in range(2):
        first, second = plan.sweep_part(r, 0), plan.sweep_part(r, 1)
        assert [c.name for c in second] == ["o_w"]
        assert "o_w" not in [c.name for c in first]
        assert first + second == plan.steps[r]
    assert "two sweeps" in plan.report.notes[0] and "'sum_1' (mean)" in plan.report.notes[0]
