"""`tspc plan`: the command line of the memory and communication planner for DP, TP, SP,
TP+SP and TSP.

This file is the CLI only. The model lives below it: shapes and units in
:mod:`tspc.tools.shapes`, the memory and communication model in :mod:`tspc.tools.plan_memory`,
its output in :mod:`tspc.tools.plan_report`, the fake-tensor measurement (`--measure`) in
:mod:`tspc.tools.measure`. The names they define are re-exported here for callers of
``tspc.tools.plan``.

Everything here is arithmetic on a model shape and a cluster shape: no torch, no process group.
The memory model and the per-layer communication formulas are the ones in
``shared/PAPER_NOTES.md``; the default assumptions are the set that reproduces the paper's
7B figures (TSP 38.8 GB vs TP 70.0 GB per GPU at 128K tokens on 8 GPUs, ~31.0 vs ~31.5 at 16K).
Every assumption is a field of :class:`PlanInputs` and is printed with the numbers, because a
memory estimate without its assumptions cannot be checked.

Units: GB = 1e9 bytes and MB = 1e6 bytes (the paper's figures reproduce in 1e9; in GiB the
model-state term alone would be 19.9 instead of 21.37).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tspc.tools import plan_dp
from tspc.tools.plan_memory import (  # noqa: F401  (re-exported)
    REPORTED_7B_D8_GB,
    Crossover,
    LayerComm,
    MemoryBreakdown,
    Plan,
    SchemePlan,
    assumptions,
    crossover,
    layer_comm,
    make_plan,
    memory_breakdown,
    reported_comparison,
)
from tspc.tools.plan_report import format_table, plot_memory_vs_seq, to_json
from tspc.tools.shapes import (  # noqa: F401  (re-exported)
    DEFAULT_A_REP_PER_H,
    DEFAULT_KAPPA,
    DEFAULT_OVERHEAD_GB,
    DTYPE_BYTES,
    EMBEDDING_PLACEMENTS,
    GB,
    MB,
    PRESETS,
    RECOMPUTE_POLICIES,
    ModelShape,
    PlanInputs,
)

# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

_TOKENS = re.compile(r"^\s*(\d+)\s*([kKmM]?)\s*$")


def parse_tokens(text: str) -> int:
    """'16K' -> 16384, '128k' -> 131072, '1M' -> 1048576, '4096' -> 4096 (K = 1024)."""
    match = _TOKENS.match(text)
    if not match:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a token count (write e.g. 4096, 16K or 128K; K = 1024)"
        )
    value = int(match.group(1)) * {"": 1, "k": 1024, "m": 1024 * 1024}[match.group(2).lower()]
    if value < 1:
        raise argparse.ArgumentTypeError(f"sequence length must be positive, got {text!r}")
    return value


def _checked(cast: type, what: str, ok: Callable[[Any], bool], requirement: str):
    """An argparse type: ``text`` as ``cast``, refused with a one-line reason unless ``ok``."""

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not ok(value):  # a comparison with nan is False: nan is refused too
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {text}")
        return value

    return parse


_positive_int = _checked(int, "an integer", lambda v: v >= 1, "a positive integer")
_non_negative_int = _checked(int, "an integer", lambda v: v >= 0, ">= 0")
_non_negative_float = _checked(float, "a number", lambda v: v >= 0, ">= 0")


def build_parser() -> argparse.ArgumentParser:
    """The `tspc plan` parser. Later flags (`--measure`, `--plot`) are added to this parser."""
    parser = argparse.ArgumentParser(
        prog="tspc plan",
        description="Per-device memory and per-layer communication of DP, TP, SP, TP+SP and "
        "TSP for a model and a cluster shape (analytic; every assumption is printed).",
    )
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--preset", choices=sorted(PRESETS), help="a built-in model shape")
    model.add_argument(
        "--config", type=Path, help="a transformers config.json (or a directory holding one)"
    )
    parser.add_argument(
        "--devices", "-D", type=_positive_int, required=True, help="D: devices on the axis"
    )
    parser.add_argument(
        "--seq", type=parse_tokens, required=True, help="sequence length S: 4096, 16K, 128K"
    )
    parser.add_argument("--micro-batch", "-B", type=_positive_int, default=1, help="B (1)")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16")
    parser.add_argument("--recompute", choices=RECOMPUTE_POLICIES, default="full")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")

    assume = parser.add_argument_group("memory-model assumptions (defaults reproduce the paper)")
    assume.add_argument(
        "--kappa", type=_non_negative_float, default=DEFAULT_KAPPA, help="bytes/param (16)"
    )
    assume.add_argument(
        "--a-rep", type=_non_negative_float, default=DEFAULT_A_REP_PER_H,
        help="replicated activations per token per layer, in units of h (5)",
    )  # fmt: skip
    assume.add_argument(
        "--a-sh", type=_non_negative_float, default=None,
        help="head/column-split activations per token per layer, in units of h "
        "(default: derived, 2q + 2h_kv + 4I)",
    )  # fmt: skip
    assume.add_argument(
        "--overhead-gb", type=_non_negative_float, default=DEFAULT_OVERHEAD_GB,
        help="c0, fixed per-device overhead in GB (8.54)",
    )  # fmt: skip
    assume.add_argument(
        "--logits-dtype", choices=sorted(DTYPE_BYTES), default=None, help="(default: --dtype)"
    )
    assume.add_argument(
        "--tsp-embeddings", choices=EMBEDDING_PLACEMENTS, default="replicated",
        help="embeddings under TSP (replicated)",
    )  # fmt: skip
    assume.add_argument(
        "--inflight-shards", type=_non_negative_int, default=0, metavar="N",
        help="TSP weight shards in flight to count explicitly (0: inside c0)",
    )  # fmt: skip

    measure = parser.add_argument_group(
        "measurement: run the real TSP graph on fake tensors (no real memory, fake collectives)"
    )
    measure.add_argument(
        "--measure", action="store_true",
        help="compile the Llama-style reference model of this shape (a MoE preset: its "
        "transformers model) with backend='tsp' as each "
        "rank of D on the 'fake' process group, run one step on fake tensors and report each "
        "rank's peak live bytes next to the analytic TSP figure",
    )  # fmt: skip
    measure.add_argument(
        "--measure-mode", choices=("train", "forward"), default="train",
        help="train: forward + loss + backward + AdamW (default); forward: loss under no_grad",
    )  # fmt: skip
    measure.add_argument(
        "--measure-layers", type=_layers_arg, default=2, metavar="N|all",
        help="trace N and N+1 layers and extrapolate linearly to the model's depth (default 2: "
        "the smallest depth whose step has the full model's structure; tracing costs ~5-8 s "
        "per layer and rank at D=8 on 2 cores); 'all' traces the full depth",
    )  # fmt: skip
    measure.add_argument(
        "--measure-ranks", type=_ranks_arg, default=None, metavar="all|R[,R...]",
        help="which ranks to measure (default: all; a MoE model: the first and the last)",
    )  # fmt: skip
    parser.add_argument(
        "--plot", type=Path, default=None, metavar="FILE.png",
        help="also plot per-device memory vs sequence length for every scheme (analytic; "
        "needs matplotlib)",
    )  # fmt: skip
    from tspc.tools.timemodel.cli import add_time_arguments

    add_time_arguments(parser)
    plan_dp.add_arguments(parser)
    return parser


def _layers_arg(text: str) -> int | None:
    if text.strip().lower() in ("all", "full"):
        return None
    return _positive_int(text)


def _ranks_arg(text: str) -> list[int] | None:
    if text.strip().lower() == "all":
        return None
    try:
        ranks = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not 'all' or a list like 0,3") from None
    if not ranks or any(r < 0 for r in ranks):
        raise argparse.ArgumentTypeError(f"{text!r} is not 'all' or a list like 0,3")
    return ranks


def inputs_from_args(args: argparse.Namespace) -> tuple[ModelShape, PlanInputs]:
    """Turn parsed arguments into the model and the plan inputs (ValueError on bad values)."""
    model = PRESETS[args.preset] if args.preset else ModelShape.from_hf_config(args.config)
    inputs = PlanInputs(
        devices=args.devices,
        seq_len=args.seq,
        micro_batch=args.micro_batch,
        dtype=args.dtype,
        recompute=args.recompute,
        kappa=args.kappa,
        a_rep_per_h=args.a_rep,
        a_sh_per_h=args.a_sh,
        overhead_gb=args.overhead_gb,
        logits_dtype=args.logits_dtype,
        tsp_embeddings=args.tsp_embeddings,
        tsp_inflight_shards=args.inflight_shards,
    )
    return model, inputs


def main(argv: list[str] | None = None) -> int:
    """`tspc plan ...`: print the table (or `--json`). Bad input exits 2 with the reason.
    `tspc plan --calibrate ...` and `tspc plan --crossover ...` are the time model's own
    commands (:mod:`tspc.tools.timemodel.cli`): they need no model or cluster shape."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--calibrate" in argv or "--crossover" in argv:
        from tspc.tools.timemodel.cli import standalone_main

        return standalone_main(argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        model, inputs = inputs_from_args(args)
        plan_dp.check_shard(args.dp, args.dp_shard)
    except ValueError as err:
        parser.error(str(err))
    plan = make_plan(model, inputs)
    if args.plot is not None:
        try:
            plot_memory_vs_seq(model, inputs, args.plot)
        except ImportError as err:
            parser.error(str(err))
    measured = None
    if args.measure:
        if args.measure_ranks is not None and max(args.measure_ranks) >= inputs.devices:
            parser.error(f"--measure-ranks: ranks must be below D = {inputs.devices}")
        measured = _run_measure(args, model, inputs, quiet=args.json)
    timed = None
    if args.time:
        from tspc.tools.timemodel.cli import run_time

        try:
            timed = run_time(args, model, inputs, quiet=args.json)
        except ValueError as err:
            parser.error(str(err))
    dp_text, dp_json = plan_dp.report(plan, args)
    if args.json:
        out = to_json(plan)
        out["data_parallel"] = dp_json
        if measured is not None:
            out["measured"] = measured[1]
        if timed is not None:
            out["time"] = timed[1]
        json.dump(out, sys.stdout, indent=2, ensure_ascii=False)
        sys.stdout.write("\n")
    else:
        print(format_table(plan))
        if dp_text:
            print(dp_text)
        if measured is not None:
            print(measured[0])
        if timed is not None:
            print(timed[0])
        if args.plot is not None:
            print(f"\nplot written to {args.plot}")
    return 0


def _run_measure(
    args: argparse.Namespace, model: ModelShape, inputs: PlanInputs, quiet: bool
) -> tuple[str, dict[str, Any]]:
    """Run ``tspc.tools.measure`` for the plan's TSP layout; (text section, JSON section)."""
    import time
    import warnings

    from tspc.tools.fake_moe import ROUTING_ASSUMPTION
    from tspc.tools.measure import CATEGORIES, analytic_as_measured, format_measurement, measure

    # transformers' MoE dispatch checks the torch version through lru_cache'd helpers, which
    # Dynamo warns about at every trace; the warning says nothing about the measurement
    warnings.filterwarnings("ignore", message="Dynamo detected a call to a `functools.lru_cache`")

    def progress(r: Any) -> None:
        if not quiet:
            print(
                f"tspc plan --measure: rank {r.rank}/{r.world}, {r.layers} layer(s): "
                f"peak {r.peak / GB:.3f} GB (traced in {r.compile_seconds:.0f} s)",
                file=sys.stderr,
                flush=True,
            )

    ranks = args.measure_ranks
    if ranks is None and model.is_moe:
        # a MoE trace costs ~40 s (Mixtral-8x7B's 2 layers at D = 8 on 2 cores); under the
        # balanced routing the measurement assumes, ranks differ by the experts they own: the
        # first c each, the last what is left (fewer when D does not divide E)
        ranks = sorted({0, inputs.devices - 1})
        if not quiet:
            print(
                f"tspc plan --measure: MoE model, measuring ranks {ranks} (the first and the "
                "last expert owner; --measure-ranks all for every rank)",
                file=sys.stderr,
            )
    start = time.perf_counter()
    meas = measure(
        model,
        devices=inputs.devices,
        seq_len=inputs.seq_len,
        micro_batch=inputs.micro_batch,
        dtype=inputs.dtype,
        mode=args.measure_mode,
        layers=args.measure_layers,
        ranks=ranks,
        recompute=args.recompute,
        progress=progress,
        dp=args.dp,
        data_parallel=args.data_parallel,
        dp_shard=args.dp_shard,
    )
    seconds = time.perf_counter() - start
    ranks = [r.rank for r in meas.runs[meas.measured_layers[0]]]
    as_measured = analytic_as_measured(model, inputs, meas.mode, meas.recompute)
    data = {
        "mode": meas.mode,
        "recompute": meas.recompute,
        "data_parallel": meas.data_parallel,
        "dp": meas.dp,
        "layers_traced": list(meas.measured_layers),
        "extrapolated": meas.extrapolated,
        "per_rank_bytes": {
            str(rank): {c: meas.full[i][c] for c in CATEGORIES} | {"peak": meas.peak(i)}
            for i, rank in enumerate(ranks)
        },
        "max_peak_bytes": meas.max_peak,
        "analytic_tsp_bytes": make_plan(model, inputs)
        .scheme(f"TSP(D={inputs.devices})")
        .memory.total,
        "analytic_as_measured_bytes": as_measured.total,
        "seconds": seconds,
        "routing": ROUTING_ASSUMPTION if model.is_moe else None,
        "traces": [
            {
                "layers": r.layers,
                "rank": r.rank,
                "peak": r.peak,
                "level": r.level,
                "matched_attention": r.matched_attention,
                "matched_mlp": r.matched_mlp,
                "matched_moe": r.matched_moe,
                "trace_seconds": r.compile_seconds,
            }
            for runs in meas.runs.values()
            for r in runs
        ],
    }
    return format_measurement(meas, model, inputs, seconds), data


if __name__ == "__main__":
    raise SystemExit(main())
