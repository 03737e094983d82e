"""The time model against this machine: calibrate, predict bench/throughput.py's rows, measure them.

    python bench/time_model.py            # ~10-20 min on 2 shared cores
    python bench/time_model.py --quick    # smoke run: tiny shapes, few steps

1. ``tspc plan --calibrate``'s microbenchmarks (GEMMs, elementwise, gloo collectives over two
   processes; no model, no step) give this machine's hardware description.
2. The time model traces TSP, TP and TP+SP for ``bench/throughput.py``'s model and token counts
   (B·S above and below 8h) at D = 2 on fake tensors and replays them on that description.
3. The same configurations run for real, as ``bench/throughput.py`` section (b) runs them (two
   gloo processes, inner compiler and baselines' compiler aot_eager, taking turns step by step;
   a step is the slowest rank's, a row is the median), in the same run.

The table gives predicted and measured step times, their ratio and whether the model ranks the
three schemes as the measurement does. The machine is shared: the load average before and after
is printed with the table.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.throughput import FULL, QUICK, Plan, Tokens, step_ms

SCHEMES = ("tsp", "tp_sp", "tp")
LABELS = {"tsp": "TSP", "tp_sp": "TP+SP", "tp": "TP"}


def measure_worker(rank: int, world: int, plan: Plan) -> dict[str, Any]:
    """bench/throughput.py's section (b) configurations, TSP / TP+SP / TP, at one D."""
    import torch
    import torch.distributed as dist

    from bench.throughput import _prepare_process, build_runner, time_round_robin

    _prepare_process()
    out = {}
    for tokens in (plan.long, plan.short):
        torch.compiler.reset()
        runners = [build_runner(k, plan.model, plan.inner) for k in SCHEMES]
        time_round_robin(runners, tokens, plan.model.vocab, plan, barrier=dist.barrier)
        out[tokens.name] = {r.key: {"times": r.times} for r in runners}
    return out


def predicted_ms(plan: Plan, hw: Any, tokens: Tokens, devices: int) -> dict[str, float]:
    from tspc.tools.timemodel.predict import predict

    res = predict(
        plan.model, hw, devices=devices, seq_len=tokens.seq, micro_batch=tokens.batch,
        dtype="fp32", schemes=SCHEMES, recompute=("none",),
    )  # fmt: skip
    return {r.scheme: 1e3 * r.step.step for r in res}


def _ranking(times: dict[str, float]) -> list[str]:
    return sorted(times, key=times.get)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python bench/time_model.py")
    p.add_argument("--quick", action="store_true", help="tiny shapes, few steps")
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--hardware", type=Path, default=None, help="also save the calibration here")
    args = p.parse_args(argv)
    plan = replace(QUICK if args.quick else FULL, inner="aot_eager")
    d = args.devices
    from tspc.launch import spawn
    from tspc.tools.timemodel.calibrate import calibrate
    from tspc.tools.timemodel.hardware import save_hardware

    load0 = os.getloadavg()
    t0 = time.perf_counter()
    hw = calibrate(devices=d, quick=args.quick)
    if args.hardware:
        save_hardware(hw, args.hardware)
    print(f"calibrated in {time.perf_counter() - t0:.0f} s: GEMM peak "
          f"{hw.peak_flops['fp32'] / 1e9:.1f} GFLOP/s, memory {hw.memory_bandwidth / 1e9:.1f} "
          f"GB/s, overlap {hw.overlap:.2f}, p2p α {1e6 * hw.collectives['p2p'].alpha:.0f} us "
          f"b {hw.collectives['p2p'].bandwidth / 1e9:.2f} GB/s", flush=True)  # fmt: skip
    t1 = time.perf_counter()
    predicted = {t.name: predicted_ms(plan, hw, t, d) for t in (plan.long, plan.short)}
    print(f"predicted in {time.perf_counter() - t1:.0f} s", flush=True)
    t2 = time.perf_counter()
    per_rank = spawn(measure_worker, d, plan, timeout=3600)
    print(f"measured in {time.perf_counter() - t2:.0f} s", flush=True)
    load1 = os.getloadavg()

    cmd = "python bench/time_model.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"\n$ {cmd.strip()}")
    print(f"model h={plan.model.hidden}, {plan.model.layers} layers, fp32, D = {d}, aot_eager; "
          f"{plan.iters} timed steps per row; load average {load0[0]:.1f} before, "
          f"{load1[0]:.1f} after (the machine is shared)")  # fmt: skip
    print("| tokens | scheme | predicted ms | measured ms | predicted / measured | ranking right |")
    print("|---|---|---:|---:|---:|---|")
    worst = 0.0
    for tokens in (plan.long, plan.short):
        res = [r[tokens.name] for r in per_rank]
        measured = {k: step_ms(res, k) for k in SCHEMES}
        pred = predicted[tokens.name]
        right = _ranking(pred) == _ranking(measured)
        for k in SCHEMES:
            ratio = pred[k] / measured[k]
            worst = max(worst, abs(ratio - 1))
            print(f"| {tokens.describe(plan.model.hidden)} | {LABELS[k]} | {pred[k]:.1f} | "
                  f"{measured[k]:.1f} | {ratio:.2f} | {'yes' if right else 'no'} |")  # fmt: skip
    print(f"largest deviation {worst:.0%} (issue 28 asks for <= 25% and every ranking right)")
    return 0


if __name__ == "__main__":
    from bench.time_model import main as _main

    sys.exit(_main())
