"""bench/memory.py: the table machinery (fast) and a quick real run of every row (slow)."""

from __future__ import annotations

import pytest

from bench.memory import (
    CONFIGS,
    MB,
    QUICK_CONFIGS,
    Row,
    Table,
    format_table,
    markdown_table,
    run_table,
    schemes,
)
from tspc.tools.measure import reference_model


def _row(key: str, devices: int, peak_mb: float) -> Row:
    parts = {"parameters": peak_mb * MB / 2, "activations": peak_mb * MB / 2}
    return Row(key, key, devices, peak_mb * MB, [peak_mb * MB] * devices, parts)


def test_bound_and_baseline_checks():
    cfg = QUICK_CONFIGS["both"]
    table = Table(cfg, "train")
    table.rows = [_row("one_aot", 1, 100.0), _row("one_eager", 1, 120.0)]
    table.rows += [_row("tsp", 4, 30.0), _row("tp", 4, 31.0), _row("tp_sp", 4, 40.0)]
    shard = cfg.shard_bytes(4)
    assert table.bound(4) == pytest.approx(1.25 * 100.0 * MB / 4 + 2 * shard)
    checks = dict(table.checks())
    assert len(checks) == 2 and all(checks.values())
    table.rows[2] = _row("tsp", 4, 32.0)  # above the bound (31.25 MB + 2 shards) and above TP
    assert table.bound(4) < 32.0 * MB
    assert not any(dict(table.checks()).values())
    text = format_table(table)
    assert "FAILS" in text and "one_aot" in text
    assert markdown_table(table).count("\n") == len(table.rows) + 1


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_shard_size_counts_the_matched_weights(name):
    cfg = CONFIGS[name]
    model = reference_model(cfg.model)
    matched = sum(p.numel() for n, p in model.named_parameters() if n.endswith("_proj.weight"))
    assert cfg.model.layer_params * cfg.model.layers == matched
    assert cfg.shard_bytes(4) == matched / cfg.model.layers / 4 * 4  # D = 4, fp32
    assert cfg.seq % (2 * 4) == 0 and cfg.model.heads % 4 == 0 and cfg.model.kv_heads % 4 == 0


def test_every_scheme_at_every_d():
    keys = [(s.key, s.devices) for s in schemes((2, 4))]
    assert keys[:2] == [("one_aot", 1), ("one_eager", 1)]
    for d in (2, 4):
        assert {k for k, dd in keys if dd == d} == {"tsp", "sp", "tp", "tp_sp"}


@pytest.mark.slow
@pytest.mark.extended
def test_quick_run_produces_every_row():
    cfg = QUICK_CONFIGS["both"]
    table = run_table(cfg, "forward", devices=(2, 4))
    assert [(r.key, r.devices) for r in table.rows] == [(s.key, s.devices) for s in schemes((2, 4))]
    one = table.reference
    for r in table.rows:
        assert r.peak > 0 and len(r.rank_peaks) == r.devices
        # Every scheme computes the same loss (same weights, same tokens).
        assert r.loss == pytest.approx(one.loss, rel=1e-4), r.label
        assert r.parts["parameters"] > 0 and r.parts["activations"] > 0
    for d in (2, 4):
        tsp, sp, tp = table.row("tsp", d), table.row("sp", d), table.row("tp", d)
        assert (
            tsp.level == "tsp" and tsp.matched == 2 * cfg.model.layers
        )  # attention + MLP per layer
        assert sp.level == "sp"
        assert sp.parts["parameters"] == one.parts["parameters"]  # SP replicates the weights
        assert tp.parts["parameters"] < one.parts["parameters"]
        assert tsp.parts["shards"] > 0
        assert tsp.peak < one.peak
    assert "TSP" in format_table(table)


def test_recompute_rows_and_their_check():
    keys = {(s.key, s.devices) for s in schemes((4,), recompute=True)}
    assert {k for k, d in keys if d == 4} == {
        "tsp", "sp", "tp", "tp_sp", "tsp_rc", "sp_rc", "tp_rc", "tp_sp_rc",
    }  # fmt: skip
    table = Table(QUICK_CONFIGS["weights"], "train")
    table.rows = [_row("one_aot", 1, 100.0), _row("tsp", 4, 30.0), _row("tsp_rc", 4, 20.0)]
    table.rows += [_row("sp_rc", 4, 60.0), _row("tp_rc", 4, 21.0), _row("tp_sp_rc", 4, 25.0)]
    (statement, holds), *_ = [c for c in table.checks() if "recompute" in c[0]]
    assert holds and "TSP with recompute D=4" in statement
    table.rows[4] = _row("tp_rc", 4, 19.0)
    assert not [ok for text, ok in table.checks() if "recompute" in text][0]


def test_only_some_rows_without_a_one_process_row():
    from bench.memory import main

    table = Table(QUICK_CONFIGS["weights"], "train")
    table.rows = [_row("tsp_rc", 4, 20.0), _row("tp_sp_rc", 4, 25.0)]
    (statement, holds), *rest = table.checks()  # no bound without the one-process row
    assert holds and "TSP with recompute D=4" in statement and not rest
    text, md = format_table(table), markdown_table(table)
    assert "not run" in text and "| tsp_rc | 4 | 20.00 | - | - |" in md
    for bad in (["--schemes", "tsp_rcx"], ["--schemes", "tsp_rc"]):  # unknown; _rc needs it
        with pytest.raises(SystemExit):
            main(bad)
