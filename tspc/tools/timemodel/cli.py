"""The time model's flags of ``tspc plan``: ``--time`` (with a model and cluster shape),
``--calibrate`` and ``--crossover`` (standalone)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from tspc.tools.timemodel.hardware import PRESETS, load_hardware, save_hardware
from tspc.tools.timemodel.schemes import RECOMPUTE, SCHEMES


def add_time_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "time model: replay the real per-rank graphs (fake tensors) on a hardware description"
    )
    group.add_argument(
        "--time", action="store_true",
        help="trace one training step of each scheme and print step time, tokens/s, MFU and "
        "exposed communication per layer (docs/speed.md)",
    )  # fmt: skip
    _hardware_argument(group)
    group.add_argument(
        "--time-schemes", default="tsp,tp_sp,tp,cp", metavar="LIST",
        help=f"schemes to time, from {','.join(SCHEMES)} (default: all)",
    )  # fmt: skip
    group.add_argument(
        "--time-recompute", default="none,full", metavar="LIST",
        help="recompute policies to time: none, full or both (default none,full)",
    )  # fmt: skip


def _hardware_argument(group: Any) -> None:
    group.add_argument(
        "--hardware", default="mi300x", metavar="PRESET|FILE.json",
        help=f"a preset ({', '.join(sorted(PRESETS))}) or a hardware JSON (default mi300x)",
    )  # fmt: skip


def _list(text: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in allowed]
    if bad or not items:
        raise ValueError(f"{what}: {bad or text!r} not among {', '.join(allowed)}")
    return items


def run_time(args: argparse.Namespace, model: Any, inputs: Any, quiet: bool = False):
    """(text section, JSON section) of ``tspc plan --time``."""
    from tspc.tools.timemodel.predict import format_times, predict, to_json

    hw = load_hardware(args.hardware)
    schemes = _list(args.time_schemes, SCHEMES, "--time-schemes")
    recompute = _list(args.time_recompute, RECOMPUTE, "--time-recompute")
    start = time.perf_counter()

    def progress(msg: str) -> None:
        if not quiet:
            print(f"tspc plan --time: {msg}", file=sys.stderr, flush=True)

    results = predict(
        model, hw, devices=inputs.devices, seq_len=inputs.seq_len,
        micro_batch=inputs.micro_batch, dtype=inputs.dtype, schemes=schemes,
        recompute=recompute, progress=progress,
    )  # fmt: skip
    seconds = time.perf_counter() - start
    text = format_times(results, hw, model, inputs.seq_len, seconds)
    return text, {"hardware": hw.name, "results": to_json(results), "seconds": seconds}


def standalone_main(argv: list[str]) -> int:
    """``tspc plan --calibrate [--save F.json] [--quick]`` and ``tspc plan --crossover
    [--hardware H] [--png F.png]``."""
    parser = argparse.ArgumentParser(prog="tspc plan")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--calibrate", action="store_true", help="measure this machine")
    mode.add_argument("--crossover", action="store_true", help="TSP / TP+SP over S x h x D")
    parser.add_argument("--save", type=Path, default=None, help="calibration JSON to write")
    parser.add_argument("--quick", action="store_true", help="fewer sizes (smoke run)")
    parser.add_argument("--devices", type=int, default=2, help="gloo processes (2)")
    parser.add_argument("--png", type=Path, default=None, help="crossover plot (matplotlib)")
    _hardware_argument(parser)
    args = parser.parse_args(argv)
    if args.calibrate:
        from tspc.tools.timemodel.calibrate import calibrate

        hw = calibrate(devices=args.devices, quick=args.quick)
        if args.save:
            save_hardware(hw, args.save)
            print(f"hardware written to {args.save}", file=sys.stderr)
        json.dump(hw.to_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    from tspc.tools.timemodel.crossover import crossover_table, format_crossover, plot_crossover

    try:
        hw = load_hardware(args.hardware)
    except ValueError as err:
        parser.error(str(err))
    rows = crossover_table(hw, quick=args.quick)
    print(format_crossover(rows, hw))
    if args.png:
        try:
            plot_crossover(rows, args.png)
        except ImportError as err:
            parser.error(str(err))
        print(f"plot written to {args.png}")
    return 0
