"""bench/memory_moe.py: the quick run of its rows at D = 2 (slow). The hand-written TP+SP and
TP+EP baselines must train the same model as one process (their measured step's loss, after two
AdamW steps, equals one process's), and TSP must run every MoE block expert-parallel; all three
hold less than one process in parameters."""

from __future__ import annotations

import pytest

from bench.memory_moe import QUICK, format_table, run


@pytest.mark.slow
@pytest.mark.extended
def test_quick_moe_rows_train_the_same_model():
    rows = run(QUICK, "train", (2,))
    keys = [(r.key, r.devices) for r, _, _ in rows]
    assert keys == [("one_aot", 1), ("tsp", 2), ("tp_sp", 2), ("tp_ep", 2)]
    (one, (one_loss,), _), (tsp, tsp_losses, tsp_skipped) = rows[:2]
    (tpsp, tpsp_losses, _), (tpep, tpep_losses, _) = rows[2:]
    for loss in tsp_losses + tpsp_losses + tpep_losses:  # after 2 AdamW steps: the same model
        assert loss == pytest.approx(one_loss, rel=1e-5)
    assert tsp.level == "tsp" and tsp_skipped == [0, 0]
    # attention + MoE block of each layer matched
    assert tsp.matched == 2 * QUICK.shape.layers, tsp.matched
    for row in (tsp, tpsp, tpep):  # all shard the experts and the attention: fewer bytes held
        assert row.parts["parameters"] < 0.7 * one.parts["parameters"], row
        assert row.peak < one.peak
    assert "TSP / TP+SP" in format_table(QUICK, "train", rows)
