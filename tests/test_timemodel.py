"""The time model (tspc/tools/timemodel): α–β formulas against hand values, the two-stream
replay against hand-computed schedules, and the trace pipeline on tiny shapes against torch's
own FLOP counter and the collective counts bench/baselines.py documents."""

from __future__ import annotations

import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tspc.tools.shapes import ModelShape
from tspc.tools.timemodel.collectives import alpha_beta_time, fit_link
from tspc.tools.timemodel.hardware import PRESETS, Hardware, Link, load_hardware, save_hardware
from tspc.tools.timemodel.replay import replay, replay_timed
from tspc.tools.timemodel.trace import Op

LINK = Link(alpha=1e-5, bandwidth=1e9)
MB4 = 4e6


@pytest.mark.parametrize(
    ("kind", "devices", "expected"),
    [
        ("all_gather", 4, 3 * (1e-5 + 1e6 / 1e9)),  # 3 steps of n/4
        ("reduce_scatter", 4, 3 * (1e-5 + 1e6 / 1e9)),
        ("all_reduce", 4, 6 * (1e-5 + 1e6 / 1e9)),  # reduce-scatter + all-gather
        ("broadcast", 4, 3e-5 + 4e-3),  # pipelined chain
        ("reduce", 4, 3e-5 + 4e-3),
        ("all_to_all", 4, 3e-5 + 3e-3),  # 3/4 of the data leaves each rank
        ("p2p", 4, 1e-5 + 4e-3),
        ("all_reduce", 1, 0.0),  # nothing moves
    ],
)
def test_alpha_beta_hand_values(kind: str, devices: int, expected: float) -> None:
    assert alpha_beta_time(kind, MB4, devices, LINK) == pytest.approx(expected)


def test_alpha_beta_rejects_unknown_kind() -> None:
    with pytest.raises(ValueError, match="unknown collective kind 'gather'"):
        alpha_beta_time("gather", 1.0, 2, LINK)


def test_fit_link_recovers_alpha_and_bandwidth() -> None:
    # all-gather over 4 ranks with α = 20 us, b = 2 GB/s: t = 3·α + (3/4)·n/b, written by hand
    points = [(n, 3 * 20e-6 + 0.75 * n / 2e9) for n in (1e4, 1e5, 1e6, 1e7)]
    link = fit_link("all_gather", 4, points)
    assert link.alpha == pytest.approx(20e-6, rel=1e-6)
    assert link.bandwidth == pytest.approx(2e9, rel=1e-6)


def c(seconds: float) -> tuple[Op, float]:
    return Op("mm", "compute", "gemm"), seconds


def start(handle: int, seconds: float) -> tuple[Op, float]:
    return Op("x_start", "start", collective="p2p", handle=handle), seconds


def wait(handle: int) -> tuple[Op, float]:
    return Op("wait_tensor", "wait", handle=handle), 0.0


def run(schedule, overlap: float = 1.0):
    ops, costs = zip(*schedule)
    return replay_timed(ops, costs, overlap)


def test_replay_overlap_hides_a_transfer() -> None:
    # compute 2 | start X (3 s, runs 2..5) | compute 4 (2..6) | wait X (done) | compute 1
    r = run([c(2), start(1, 3), c(4), wait(1), c(1)])
    assert r.step == pytest.approx(7.0)
    assert r.exposed == pytest.approx(0.0)
    assert r.compute == pytest.approx(7.0) and r.communication == pytest.approx(3.0)


def test_replay_wait_exposes_a_transfer() -> None:
    # compute 1 | start X (3 s: 1..4) | wait X: compute blocked 1..4 | compute 1 -> 5
    r = run([c(1), start(1, 3), wait(1), c(1)])
    assert r.step == pytest.approx(5.0)
    assert r.exposed == pytest.approx(3.0)


def test_replay_transfers_share_one_stream() -> None:
    # X 0..2, Y queued behind it 2..4; compute 1 (0..1); wait Y blocks 1..4; wait X is done
    r = run([start(1, 2), start(2, 2), c(1), wait(2), wait(1), c(1)])
    assert r.step == pytest.approx(5.0)
    assert r.exposed == pytest.approx(3.0)


def test_replay_start_waits_for_its_inputs_and_sync_blocks() -> None:
    # compute 3 first: X cannot start before 3 (its input is computed then); ends 4; a sync of
    # 2 s then runs 4..6 with compute blocked
    sync = (Op("allreduce_", "sync", collective="all_reduce"), 2.0)
    r = run([c(3), start(1, 1), wait(1), sync, c(1)])
    assert r.step == pytest.approx(7.0)
    assert r.exposed == pytest.approx(3.0)


def test_replay_partial_overlap_slows_compute() -> None:
    # X 0..2 under a 4 s compute; with overlap 0.5 half of the 2 shared seconds are added
    r = run([start(1, 2), c(4), wait(1)], overlap=0.5)
    assert r.step == pytest.approx(5.0)


def test_hardware_json_round_trip_and_errors(tmp_path) -> None:
    path = tmp_path / "hw.json"
    save_hardware(PRESETS["h100"], path)
    assert load_hardware(path) == PRESETS["h100"]
    data = json.loads(path.read_text()) | {"bogus": 1}
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="unknown keys \\['bogus'\\]"):
        load_hardware(path)
    with pytest.raises(ValueError, match="neither a preset"):
        load_hardware(tmp_path / "missing.json")
    with pytest.raises(ValueError, match="gemm_efficiency"):
        Hardware("x", {"bf16": 1.0}, 1.0, {"intra": LINK}, gemm_efficiency=1.5)


TINY = ModelShape(hidden=64, layers=2, heads=4, kv_heads=4, intermediate=128, vocab=128)


def _one_process_gemm_flops(batch: int, seq: int) -> float:
    """GEMM FLOPs of one forward + backward of the plain model, by torch's FlopCounterMode."""
    from tspc.tools.fake_run import LossModel, reference_model

    model = LossModel(reference_model(TINY))
    ids = torch.randint(0, TINY.vocab, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        model(ids, ids).backward()
    counts = counter.get_flop_counts()["Global"]
    return float(
        sum(v for k, v in counts.items() if str(k).split(".")[-1] in ("mm", "addmm", "bmm"))
    )


@pytest.mark.parametrize(
    ("scheme", "expected"),
    # bench/baselines.py: TP 2 all-reduces per layer each way; TP+SP, for two layers, 5
    # all-gathers + 4 reduce-scatters forward and the same backward
    [("tp", {"all_reduce": 8}), ("tp_sp", {"all_gather": 10, "reduce_scatter": 8})],
)
def test_baseline_traces_have_the_documented_collectives(scheme: str, expected: dict) -> None:
    from tspc.tools.timemodel.schemes import trace_step

    ops = trace_step(TINY, scheme, devices=2, seq_len=64, dtype="fp32")
    got: dict[str, int] = {}
    for op in ops:
        if op.kind == "start":
            got[op.collective] = got.get(op.collective, 0) + 1
    assert got == expected
    waited = {op.handle for op in ops if op.kind == "wait"}
    assert waited == {op.handle for op in ops if op.kind == "start"}  # every start is waited
    r = replay(ops, PRESETS["h100"])
    assert r.step >= max(r.compute, r.communication)
    assert 0 <= r.exposed <= r.communication * (1 + 1e-9)  # all exposed at most (rounding)


@pytest.mark.slow
def test_tsp_trace_gemm_flops_are_one_process_over_d() -> None:
    from tspc.tools.timemodel.schemes import trace_step

    ops = trace_step(TINY, "tsp", devices=2, seq_len=64, dtype="fp32")
    gemm = sum(op.flops for op in ops if op.cls == "gemm")
    # GEMMs split exactly: each rank runs every weight on its own half of the tokens
    assert 2 * gemm == pytest.approx(_one_process_gemm_flops(1, 64), rel=1e-6)
    kinds = {op.collective for op in ops if op.kind == "start"}
    assert {"broadcast", "all_gather", "p2p", "reduce", "reduce_scatter"} <= kinds


def test_plan_time_cli_on_a_tiny_config(tmp_path, capsys) -> None:
    from tspc.tools.plan import main

    config = {
        "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 128,
    }  # fmt: skip
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    argv = ["--config", str(path), "--devices", "2", "--seq", "128", "--dtype", "fp32"]
    main([*argv, "--time", "--time-schemes", "tp_sp,tp", "--time-recompute", "none",
          "--hardware", "h100", "--json"])  # fmt: skip
    out = json.loads(capsys.readouterr().out)["time"]
    assert out["hardware"] == "h100"
    assert [r["scheme"] for r in out["results"]] == ["tp_sp", "tp"]
    for r in out["results"]:
        assert r["step_s"] >= r["compute_s"] > 0 and 0 < r["mfu"] < 1
    with pytest.raises(SystemExit):  # a scheme name that does not exist: a clear usage error
        main([*argv, "--time", "--time-schemes", "tsp,megatron"])
    assert "megatron" in capsys.readouterr().err


def _zigzag_step(q, k, v, rank: int) -> None:
    out, _ = torch.ops.tspc.zigzag_causal_attention(q, k, v, rank, 2, 0.25)
    out.sum().backward()


def test_zigzag_kernel_is_recorded_as_the_ops_it_runs() -> None:
    """The recorder replaces tspc's zigzag op by the block SDPAs its Python runs: as many as
    torch's profiler sees in a real call, and the two ranks' forward FLOPs together are one
    process's causal attention."""
    from torch.profiler import profile

    import tspc.ops.zigzag_attention  # noqa: F401 - registers the op
    from tspc.runtime.compat import FakeTensorMode
    from tspc.tools.timemodel.trace import OpRecorder

    b, h, s, d = 1, 2, 32, 8

    def inputs():
        q = torch.randn(b, h, s // 2, d, requires_grad=True)
        k, v = (torch.randn(b, h, s, d, requires_grad=True) for _ in range(2))
        return q, k, v

    total = 0.0
    for rank in range(2):
        with profile() as prof:
            _zigzag_step(*inputs(), rank)
        real = sum(
            e.count for e in prof.key_averages()
            if e.key.startswith("aten::_scaled_dot_product_flash_attention_for_cpu")
        )  # fmt: skip
        with FakeTensorMode():
            fake = inputs()
            with OpRecorder(2) as rec:
                _zigzag_step(*fake, rank)
        sdpa = [op for op in rec.ops if op.name.startswith("_scaled_dot_product_flash")]
        assert len(sdpa) == real > 0
        assert not any(op.name.startswith("zigzag") for op in rec.ops)
        assert all(op.head_dim == d for op in sdpa)
        total += sum(op.flops for op in sdpa if not op.name.endswith("_backward"))
    assert total == pytest.approx(4.0 * b * h * s * s * d * 0.5)


def test_attention_curve_picks_forward_or_backward_by_head_size() -> None:
    from tspc.tools.timemodel.replay import compute_time

    hw = Hardware(
        name="t", peak_flops={"fp32": 1e12}, memory_bandwidth=1e12, links={"intra": LINK},
        op_overhead=0.0, attention_curve=[[16.0, 1e9, 5e8], [64.0, 4e9, 2e9]],
    )  # fmt: skip
    fwd = Op(
        "_scaled_dot_product_flash_attention_for_cpu", "compute", "attention", 1e9, head_dim=16
    )
    bwd = Op(
        "_scaled_dot_product_flash_attention_for_cpu_backward", "compute", "attention", 1e9,
        head_dim=64,
    )  # fmt: skip
    assert compute_time(hw, fwd) == pytest.approx(1.0)  # 1 GFLOP at 1 GFLOP/s
    assert compute_time(hw, bwd) == pytest.approx(0.5)  # at 2 GFLOP/s
    mid = Op(fwd.name, "compute", "attention", 1e9, head_dim=32)  # log-log between the two
    assert compute_time(hw, mid) == pytest.approx(0.5)
