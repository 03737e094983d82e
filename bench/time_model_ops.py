"""Where the time model's step time goes wrong: measured time per op (torch's profiler) beside predicted.

    python bench/time_model_ops.py --scheme tsp --tokens short   # ~1 min on 2 cores

One configuration of ``bench/time_model.py`` (``bench/throughput.py``'s model at D = 2,
aot_eager): two gloo ranks run a few steps, then rank 0 runs one step under
``torch.profiler``; in this process the compute microbenchmarks of ``tspc plan --calibrate``
(no collectives: the table is about compute) and the time model's trace of the same step on
fake tensors give the predicted time of every op. Printed per ATen op name: the profiler's
self CPU time and call count, the prediction's time and count, and the total of each, with
the measured step's wall time. What is neither (the step's wall time minus the ATen ops'
self time) is Python, waits and dispatch outside ATen, which no microbenchmark here measures.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.throughput import FULL


def profile_worker(rank: int, world: int, scheme: str, row: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from bench.throughput import _data, _prepare_process, build_runner

    _prepare_process()
    tokens = getattr(FULL, row)
    runner = build_runner(scheme, FULL.model, FULL.inner)
    ids, targets = _data(tokens, FULL.model.vocab, "cpu")
    for _ in range(3):  # compile, then warm up
        dist.barrier()
        runner.step(ids, targets)
    dist.barrier()
    t0 = time.perf_counter()
    runner.step(ids, targets)
    wall = time.perf_counter() - t0
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        runner.step(ids, targets)
    self_us: dict[str, float] = collections.Counter()
    calls: dict[str, int] = collections.Counter()
    for e in prof.key_averages():
        if e.key.startswith("aten::") or e.key.startswith("tspc::"):
            self_us[e.key] += e.self_cpu_time_total
            calls[e.key] += e.count
    return {"self_us": dict(self_us), "calls": dict(calls), "wall": wall}


def predicted_by_op(scheme: str, row: str) -> tuple[dict[str, float], dict[str, int]]:
    from tspc.tools.timemodel.calibrate import compute_constants
    from tspc.tools.timemodel.hardware import Hardware, Link
    from tspc.tools.timemodel.replay import compute_time
    from tspc.tools.timemodel.schemes import trace_step

    c = compute_constants("fp32")
    hw = Hardware(
        name="this machine (compute only)", peak_flops=c["peak_flops"],
        memory_bandwidth=c["memory_bandwidth"], links={"intra": Link(1.0, 1.0)},
        gemm_efficiency=1.0, attention_efficiency=c["attention_efficiency"],
        memory_efficiency=1.0, op_overhead=c["op_overhead"], view_overhead=c["view_overhead"],
        gemm_curve=c["gemm_curve"], memory_curve=c["memory_curve"],
        attention_curve=c["attention_curve"],
    )  # fmt: skip
    tokens = getattr(FULL, row)
    ops = trace_step(
        FULL.model, scheme, devices=2, seq_len=tokens.seq, micro_batch=tokens.batch,
        dtype="fp32",
    )  # fmt: skip
    seconds: dict[str, float] = collections.Counter()
    calls: dict[str, int] = collections.Counter()
    for op in ops:
        if op.kind == "compute":
            seconds[op.name] += compute_time(hw, op)
            calls[op.name] += 1
    return dict(seconds), dict(calls)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/time_model_ops.py")
    p.add_argument("--scheme", default="tsp", choices=("tsp", "tp_sp", "tp"))
    p.add_argument("--tokens", default="short", choices=("short", "long"))
    p.add_argument("--top", type=int, default=25)
    a = p.parse_args(argv)
    from tspc.launch import spawn

    measured = spawn(profile_worker, 2, a.scheme, a.tokens, timeout=1800)[0]
    pred_s, pred_n = predicted_by_op(a.scheme, a.tokens)
    meas_ms = {k.split("::", 1)[1]: v / 1e3 for k, v in measured["self_us"].items()}
    meas_n = {k.split("::", 1)[1]: v for k, v in measured["calls"].items()}
    pred_ms = {k: 1e3 * v for k, v in pred_s.items()}
    names = sorted(
        set(meas_ms) | set(pred_ms), key=lambda k: -max(meas_ms.get(k, 0), pred_ms.get(k, 0))
    )
    tok = getattr(FULL, a.tokens)
    print(f"{a.scheme}, B·S = {tok.batch}x{tok.seq}, D = 2, aot_eager, rank 0\n")
    print("| op | measured self ms | calls | predicted ms | calls |\n|---|---:|---:|---:|---:|")
    for k in names[: a.top]:
        print(
            f"| {k} | {meas_ms.get(k, 0):.2f} | {meas_n.get(k, 0)} | {pred_ms.get(k, 0):.2f} | "
            f"{pred_n.get(k, 0)} |"
        )
    aten = sum(v for k, v in measured["self_us"].items() if k.startswith("aten::")) / 1e3
    custom = sum(v for k, v in measured["self_us"].items() if k.startswith("tspc::")) / 1e3
    print(
        f"\nstep wall {1e3 * measured['wall']:.1f} ms; ATen ops' self time {aten:.1f} ms, "
        f"tspc ops' own Python {custom:.1f} ms; predicted compute {sum(pred_ms.values()):.1f} ms"
    )
    return 0


if __name__ == "__main__":
    from bench.time_model_ops import main as _main

    sys.exit(_main())
