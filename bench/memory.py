"""Per-rank peak memory: one process vs TSP, SP, TP and TP+SP at D = 2 and 4, measured.

    python bench/memory.py                        # every configuration, forward and training
    python bench/memory.py --config both --mode train
    python bench/memory.py --quick                # tiny shapes, seconds per row (the test's run)
    python bench/memory.py --config weights --mode train --devices 4 --recompute \
        --schemes tsp_rc tp_sp_rc                 # only some rows

One model, one sequence length, one table per configuration and mode. Every row is a real
gloo run (``tspc.launch.spawn``, one intra-op thread per process) of the reference model
wrapped with its cross-entropy loss (``tspc.tools.measure.LossModel``: the loss is part of the
compiled program, so TSP and SP reduce it over their local tokens instead of gathering logits):

* ``one process (aot_eager)``: the model compiled with ``backend="aot_eager"`` on one process.
  This is the reference of the ratios and of the bound: TSP's inner compiler is aot_eager with
  the same min-cut partitioner, and the TP baselines are compiled the same way, so a ratio
  shows what the parallel layout saves, not what a partitioner's rematerialisation saves.
* ``one process (eager)``: the uncompiled model, for reference (what autograd alone keeps).
* ``TSP``: ``torch.compile(model, backend="tsp")``, default options.
* ``SP``: ``backend="tsp"`` with ``options={"schedules": "sp"}``: tokens sharded (zigzag),
  weights replicated, K/V all-gathered.
* ``TP`` / ``TP+SP``: torch's ``parallelize_module`` plans of ``bench/baselines.py``
  (colwise/rowwise; plus ``SequenceParallel`` norms and sequence-sharded residuals for TP+SP),
  compiled with ``aot_eager`` (``--baseline-backend eager`` runs them uncompiled).

Measurement (``tspc.tools.memory``): a ``MemoryTracker`` is started *before* the model is built, so
every CPU allocation of the process is seen — weights (including full weights a backend keeps
or releases), shards, gradients, optimizer state, activations, communication buffers. The
first two steps warm up (the first compiles and creates the optimizer state; TSP's release of
the full weights makes Dynamo recompile once at the second); then the tracker's peak window is
reset — it starts at everything the process holds at that point — and the third step is
measured. ``breakdown`` splits the peak into parameters (with buffers and shards),
gradients, optimizer state, communication buffers and activations (everything else live at the
peak: saved activations, the working set, logits). Nothing is subtracted or special-cased.

A training step is ``zero_grad(set_to_none=True)``, forward + loss, backward, ``AdamW.step()``;
a forward step is the loss under ``torch.no_grad()``. TSP's optimizer owns this rank's shards
plus the unmatched parameters (``model.parameters()``: DTensors after the first call).

The must-show bound, checked for the TSP rows: per-rank peak <= 1.25 * (one-process peak / D)
+ 2 weight shards, where a weight shard is one layer's matched weights / D (the attention
projections and the gated MLP, in the model dtype): the shard a rank computes with while the
next one is in flight.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from tspc.tools.plan import ModelShape

MB = 1e6
BOUND_FACTOR = 1.25
BOUND_SHARDS = 2
MODES = ("forward", "train")
# Steps before the measured one: the first compiles (and TSP cuts its shards and releases the
# full weights, which changes their class, so Dynamo recompiles once at the second).
WARMUP_STEPS = 2
DEVICES = (2, 4)


@dataclass(frozen=True)
class BenchConfig:
    """A reference-model shape and one sequence length (fp32, micro-batch ``batch``)."""

    name: str
    description: str
    model: ModelShape
    seq: int
    batch: int = 1

    def shard_bytes(self, devices: int, elem: int = 4) -> float:
        """One weight shard: one layer's matched weights / D, in bytes (fp32)."""
        return self.model.layer_params / devices * elem

    def quick(self) -> BenchConfig:
        """The same configuration scaled down for a smoke run (seconds per row): half the
        width, two layers of four heads (no GQA), a vocabulary of 256, a quarter of the
        sequence."""
        m = self.model
        return BenchConfig(
            self.name,
            f"{self.description} (quick)",
            ModelShape(
                hidden=m.hidden // 2, layers=2, heads=4, kv_heads=4,
                intermediate=m.intermediate // 2, vocab=256,
            ),
            seq=self.seq // 4,
            batch=self.batch,
        )  # fmt: skip

    def summary(self) -> str:
        m = self.model
        return (
            f"h={m.hidden} I={m.intermediate} L={m.layers} heads={m.heads}/"
            f"{m.kv_heads}kv vocab={m.vocab} B={self.batch} S={self.seq} fp32"
        )


CONFIGS: dict[str, BenchConfig] = {
    c.name: c
    for c in (
        BenchConfig(
            "weights", "weight-dominated: short sequence, wide model",
            ModelShape(hidden=512, layers=4, heads=8, kv_heads=8, intermediate=2048, vocab=1024),
            seq=128,
        ),
        BenchConfig(
            "both", "weights and activations both matter",
            ModelShape(hidden=256, layers=4, heads=8, kv_heads=4, intermediate=1024, vocab=512),
            seq=1024,
        ),
        BenchConfig(
            "activations", "activation-dominated: long sequence, narrow model",
            ModelShape(hidden=128, layers=2, heads=4, kv_heads=4, intermediate=512, vocab=512),
            seq=4096,
        ),
    )
}  # fmt: skip
QUICK_CONFIGS: dict[str, BenchConfig] = {name: c.quick() for name, c in CONFIGS.items()}


@dataclass(frozen=True)
class Scheme:
    key: str
    label: str
    devices: int


RECOMPUTE_SUFFIX = "_rc"
SCHEME_KEYS = ("one_aot", "one_eager", "tsp", "sp", "tp", "tp_sp") + tuple(
    k + RECOMPUTE_SUFFIX for k in ("tsp", "sp", "tp", "tp_sp")
)


def schemes(devices: tuple[int, ...] = DEVICES, recompute: bool = False) -> list[Scheme]:
    """The rows; with ``recompute`` also every parallel scheme with full activation
    recomputation (key suffix ``_rc``): TSP and SP with ``options={"recompute": "full"}``, TP
    and TP+SP with each decoder block under ``torch.utils.checkpoint`` (what their users run)."""
    rows = [
        Scheme("one_aot", "one process (aot_eager)", 1),
        Scheme("one_eager", "one process (eager)", 1),
    ]
    for d in devices:
        rows += [
            Scheme("tsp", "TSP", d),
            Scheme("sp", "SP", d),
            Scheme("tp", "TP", d),
            Scheme("tp_sp", "TP+SP", d),
        ]
        if recompute:
            rows += [
                Scheme("tsp" + RECOMPUTE_SUFFIX, "TSP, recompute", d),
                Scheme("sp" + RECOMPUTE_SUFFIX, "SP, recompute", d),
                Scheme("tp" + RECOMPUTE_SUFFIX, "TP, recompute (eager)", d),
                Scheme("tp_sp" + RECOMPUTE_SUFFIX, "TP+SP, recompute (eager)", d),
            ]
    return rows


# --------------------------------------------------------------------------------------------
# One rank (runs in a spawned gloo process)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    config: BenchConfig
    scheme: str
    mode: str
    baseline_backend: str = "aot_eager"


def _data(config: BenchConfig) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.model.vocab, (config.batch, config.seq), generator=g)
    targets = torch.randint(0, config.model.vocab, (config.batch, config.seq), generator=g)
    return ids, targets


def _checkpoint_blocks(model: torch.nn.Module) -> None:
    """Every decoder block of the reference model under ``torch.utils.checkpoint``."""
    from torch.utils.checkpoint import checkpoint

    for layer in model.layers:
        forward = layer.forward
        layer.forward = lambda *a, f=forward: checkpoint(f, *a, use_reentrant=False)


def _build(job: Job) -> tuple[torch.nn.Module, Any]:
    """The (loss-wrapped) model and the callable a step runs."""
    from bench.baselines import build_tp, build_tp_sp
    from tspc.tools.measure import LossModel, reference_model

    recompute = job.scheme.endswith(RECOMPUTE_SUFFIX)
    scheme = job.scheme.removesuffix(RECOMPUTE_SUFFIX)
    base = reference_model(job.config.model)
    if scheme == "tp":
        base = build_tp(base)
    elif scheme == "tp_sp":
        base = build_tp_sp(base)
    if recompute and scheme in ("tp", "tp_sp"):
        _checkpoint_blocks(base)
    model = LossModel(base)
    if scheme == "one_eager":
        return model, model
    if scheme in ("tsp", "sp"):
        # aot_eager, like the TP baselines (see the module doc)
        options = (
            {"schedules": "sp", "inner": "aot_eager"} if scheme == "sp" else {"inner": "aot_eager"}
        )
        if recompute:
            options["recompute"] = "full"
        return model, torch.compile(model, backend="tsp", options=options)
    if scheme in ("tp", "tp_sp") and (job.baseline_backend == "eager" or recompute):
        # torch.utils.checkpoint over DTensor blocks does not compile under aot_eager in
        # torch 2.13 (a DeviceMesh among the saved tensors): the checkpointed TP baselines run
        # uncompiled, as their users run them
        return model, model
    return model, torch.compile(model, backend="aot_eager")


def _optimizer(job: Job, model: torch.nn.Module) -> torch.optim.Optimizer:
    from bench.baselines import param_groups

    scheme = job.scheme.removesuffix(RECOMPUTE_SUFFIX)
    if scheme == "tsp":
        params: Any = list(model.parameters())
    elif scheme in ("tp", "tp_sp"):
        params = param_groups(model)  # DTensor and plain parameters in separate groups
    else:
        params = model.parameters()
    return torch.optim.AdamW(params, lr=1e-4)


def measure_rank(rank: int, world_size: int, job: Job) -> dict[str, Any]:
    """One rank's measured step (a ``spawn`` worker: returns plain data)."""
    import tspc
    from tspc.tools.measure import is_matched_param, measured_step, shards_of, warm_up
    from tspc.tools.memory import MemoryTracker, breakdown, storage_bytes

    torch.manual_seed(0)
    last_id = tspc.report.last_graph_id()
    t0 = time.perf_counter()
    with MemoryTracker() as tracker:  # before anything is built: everything is seen
        ids, targets = _data(job.config)
        model, step = _build(job)
        optimizer = warm_up(
            step, ids, targets, job.mode, WARMUP_STEPS, lambda: _optimizer(job, model)
        )
        t1 = time.perf_counter()
        tracker.reset_peak()  # the window starts at everything held now
        loss = measured_step(step, ids, targets, job.mode, optimizer)
        t2 = time.perf_counter()
        shards = shards_of(model)
        result = breakdown(model, optimizer, extra_params=shards, tracker=tracker)
        # Full matched weights still held: the stand-ins the graphs receive (0 bytes once the
        # backend released them after sharding; the module holds DTensors of the slices).
        from tspc.runtime.tsp_params import tsp_param_of

        result["full_weights"] = storage_bytes(
            tsp_param_of(p).handle for p in model.parameters() if is_matched_param(p)
        )
        result["shards"] = storage_bytes(shards)
    reports = tspc.report.reports_after(last_id)
    report = reports[-1] if reports else None
    result.update(
        loss=float(loss.detach()),
        warmup_s=t1 - t0,
        step_s=t2 - t1,
        level=report.level if report else None,
        matched=len(report.matched) if report else 0,
        skipped=len(report.skipped) if report else 0,
    )
    return result


# --------------------------------------------------------------------------------------------
# Rows and the table
# --------------------------------------------------------------------------------------------


@dataclass
class Row:
    """One scheme at one D: the rank with the highest peak, and every rank's peak."""

    key: str
    label: str
    devices: int
    peak: float
    rank_peaks: list[float]
    parts: dict[str, float]  # the highest rank's breakdown
    level: str | None = None
    matched: int = 0
    loss: float = float("nan")
    seconds: float = 0.0


def make_row(scheme: Scheme, per_rank: list[dict[str, Any]], seconds: float = 0.0) -> Row:
    peaks = [float(r["peak"]) for r in per_rank]
    top = per_rank[max(range(len(peaks)), key=peaks.__getitem__)]
    return Row(
        key=scheme.key,
        label=scheme.label,
        devices=scheme.devices,
        peak=max(peaks),
        rank_peaks=peaks,
        parts={k: float(v) for k, v in top.items() if isinstance(v, (int, float))},
        level=top.get("level"),
        matched=int(top.get("matched", 0)),
        loss=float(top.get("loss", float("nan"))),
        seconds=seconds,
    )


@dataclass
class Table:
    config: BenchConfig
    mode: str
    rows: list[Row] = field(default_factory=list)

    def row(self, key: str, devices: int) -> Row | None:
        return next((r for r in self.rows if r.key == key and r.devices == devices), None)

    @property
    def reference(self) -> Row:
        ref = self.reference_or_none
        if ref is None:
            raise ValueError("no one-process row")
        return ref

    @property
    def reference_or_none(self) -> Row | None:
        """The one-process row the ratios and the bound refer to (absent when ``--schemes``
        left both one-process rows out)."""
        return self.row("one_aot", 1) or self.row("one_eager", 1)

    def bound(self, devices: int) -> float:
        """The must-show bound for TSP at D: 1.25 * (one-process peak / D) + 2 weight shards."""
        return (
            BOUND_FACTOR * self.reference.peak / devices
            + BOUND_SHARDS * self.config.shard_bytes(devices)
        )

    def checks(self) -> list[tuple[str, bool]]:
        """(statement, holds) for the must-show checks, per D: the bound, and — in the
        configuration where weights and activations both matter — TSP below every baseline at
        D = 4 (the issue's must-show; the other comparisons are printed for information).
        (Where weights dominate, TP keeps no shard in flight and may well be lower; where
        activations dominate, SP may be: those comparisons are in ``comparisons``.)"""
        out = []
        for d in sorted({r.devices for r in self.rows if r.devices > 1}):
            tsp = self.row("tsp", d)
            if tsp is not None and self.reference_or_none is not None:
                bound = self.bound(d)
                out.append(
                    (
                        f"TSP D={d}: peak {tsp.peak / MB:.2f} MB <= {BOUND_FACTOR} x one/{d} + "
                        f"{BOUND_SHARDS} shards = {bound / MB:.2f} MB",
                        tsp.peak <= bound,
                    )
                )
            others = [
                r
                for r in self.rows
                if r.devices == d and r.key != "tsp" and not r.key.endswith(RECOMPUTE_SUFFIX)
            ]
            tsp_rc = self.row("tsp" + RECOMPUTE_SUFFIX, d)
            rc_others = [
                r
                for r in self.rows
                if r.devices == d and r.key.endswith(RECOMPUTE_SUFFIX) and r is not tsp_rc
            ]
            if tsp_rc is not None and rc_others and d == 4:
                low = min(rc_others, key=lambda r: r.peak)
                out.append(
                    (
                        f"TSP with recompute D={d} ({tsp_rc.peak / MB:.2f} MB) below every "
                        f"baseline with recompute at D={d} (lowest: {low.label} "
                        f"{low.peak / MB:.2f} MB)",
                        all(tsp_rc.peak < r.peak for r in rc_others),
                    )
                )
            if tsp is not None and others and self.config.name == "both" and d == 4:
                worst = min(others, key=lambda r: r.peak)
                out.append(
                    (
                        f"TSP D={d} below every baseline at D={d} (lowest: {worst.label} "
                        f"{worst.peak / MB:.2f} MB)",
                        all(tsp.peak < r.peak for r in others),
                    )
                )
        return out


COLUMNS = (
    ("params", "parameters"),  # with buffers (added below) and shards
    ("full wts", "full_weights"),
    ("grads", "gradients"),
    ("optim", "optimizer_state"),
    ("activ", "activations"),
    ("comm", "communication"),
)


def format_table(table: Table) -> str:
    cfg = table.config
    what = (
        "training step (forward + loss + backward + AdamW)"
        if table.mode == "train"
        else "forward (loss under no_grad)"
    )
    ref = table.reference_or_none
    lines = [
        f"config '{cfg.name}' ({cfg.description}): {cfg.summary()}; {what}",
        "per-rank peak in MB (1e6 B), max over ranks; the columns split that rank's peak; "
        f"x one: peak / one-process peak ({ref.label if ref else 'not run'}); "
        "x(one/D): peak / (one-process peak / D)",
    ]
    headers = ["scheme", "D", "peak", "x one", "x(one/D)"] + [c for c, _ in COLUMNS]
    rows = [row_cells(r, ref) for r in table.rows]
    widths = [max(len(x[i]) for x in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        return "  " + "  ".join(
            [cells[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(cells[1:], widths[1:])]
        )

    lines += [line(headers)] + [line(r) for r in rows]
    lines.append(
        "  weight shard = one layer's matched weights / D = "
        + ", ".join(f"{cfg.shard_bytes(d) / MB:.2f} MB at D={d}" for d in _devices_in(table))
    )
    for text, ok in table.checks():
        lines.append(f"  {'holds' if ok else 'FAILS'}: {text}")
    for d in _devices_in(table):
        if table.config.name != "both" or d != 4:
            tsp = table.row("tsp", d)
            others = [
                r
                for r in table.rows
                if r.devices == d and r.key != "tsp" and not r.key.endswith(RECOMPUTE_SUFFIX)
            ]
            if tsp is not None and others:
                low = min(others, key=lambda r: r.peak)
                lines.append(
                    f"  (for information) TSP D={d} vs the lowest baseline, {low.label}: "
                    f"{tsp.peak / low.peak:.2f}x"
                )
    return "\n".join(lines)


def _ratios(row: Row, ref: Row | None) -> list[str]:
    """x one and x(one/D), or dashes when the one-process row was not run."""
    if ref is None:
        return ["-", "-"]
    return [f"{row.peak / ref.peak:.3f}", f"{row.peak / (ref.peak / row.devices):.2f}"]


def _devices_in(table: Table) -> list[int]:
    return sorted({r.devices for r in table.rows if r.devices > 1})


def row_cells(row: Row, ref: Row | None) -> list[str]:
    """One row's cells: scheme, D, peak, the two ratios to ``ref``, then ``COLUMNS`` (in MB;
    parameters with buffers and shards)."""
    parts = dict(row.parts)
    parts["parameters"] = parts.get("parameters", 0.0) + parts.get("buffers", 0.0)
    cells = [row.label, str(row.devices), f"{row.peak / MB:.2f}", *_ratios(row, ref)]
    return cells + [f"{parts.get(k, 0.0) / MB:.2f}" for _, k in COLUMNS]


def markdown_rows(rows: list[Row], ref: Row | None) -> str:
    """Rows as a GitHub markdown table (scheme, D, peak, ratios, ``COLUMNS``)."""
    head = "| scheme | D | peak MB | x one | x(one/D) | " + " | ".join(c for c, _ in COLUMNS) + " |"
    lines = [head, "|" + "---|" * (5 + len(COLUMNS))]
    lines += ["| " + " | ".join(row_cells(r, ref)) + " |" for r in rows]
    return "\n".join(lines)


def markdown_table(table: Table) -> str:
    """The same table as GitHub markdown (for docs/memory.md)."""
    return markdown_rows(table.rows, table.reference_or_none)


# --------------------------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------------------------


def run_table(
    config: BenchConfig,
    mode: str,
    devices: tuple[int, ...] = DEVICES,
    baseline_backend: str = "aot_eager",
    only: tuple[str, ...] | None = None,
    timeout: float = 900.0,
    progress: Any = None,
    recompute: bool = False,
) -> Table:
    """Every row of one table (one spawn per scheme and D)."""
    from tspc.launch import spawn

    table = Table(config, mode)
    for scheme in schemes(devices, recompute=recompute and mode == "train"):
        if only is not None and scheme.key not in only:
            continue
        t = time.perf_counter()
        job = Job(config, scheme.key, mode, baseline_backend)
        per_rank = spawn(measure_rank, scheme.devices, job, timeout=timeout)
        row = make_row(scheme, per_rank, time.perf_counter() - t)
        table.rows.append(row)
        if progress is not None:
            progress(row)
    return table


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python bench/memory.py",
        description="Per-rank peak memory of one process, TSP, SP, TP and TP+SP (measured).",
    )
    parser.add_argument(
        "--config", choices=[*CONFIGS, "all"], default="all", help="which configuration (all)"
    )
    parser.add_argument("--mode", choices=[*MODES, "all"], default="all", help="(all)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (seconds per row)")
    parser.add_argument(
        "--devices", type=int, nargs="+", default=list(DEVICES), help="D values (2 4)"
    )
    parser.add_argument("--seq", type=int, default=None, help="override the sequence length")
    parser.add_argument("--layers", type=int, default=None, help="override the layer count")
    parser.add_argument("--hidden", type=int, default=None, help="override the hidden size")
    parser.add_argument(
        "--intermediate", type=int, default=None, help="override the MLP intermediate size"
    )
    parser.add_argument("--batch", type=int, default=None, help="override the micro-batch")
    parser.add_argument(
        "--baseline-backend", choices=("aot_eager", "eager"), default="aot_eager",
        help="how TP and TP+SP run (aot_eager, like TSP's inner compiler)",
    )  # fmt: skip
    parser.add_argument(
        "--recompute", action="store_true",
        help="training tables also get every parallel scheme with full activation "
        "recomputation (TSP/SP: options recompute='full'; TP, TP+SP: torch.utils.checkpoint "
        "per decoder block)",
    )  # fmt: skip
    parser.add_argument(
        "--schemes", nargs="+", default=None, metavar="KEY",
        help="run only these rows (keys: " + ", ".join(SCHEME_KEYS) + "; e.g. "
        "'--recompute --schemes tsp_rc tp_sp_rc'); ratios and the bound need a one-process row",
    )  # fmt: skip
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--markdown", action="store_true", help="print markdown tables too")
    return parser


def configs_from_args(args: argparse.Namespace) -> list[BenchConfig]:
    source = QUICK_CONFIGS if args.quick else CONFIGS
    names = list(source) if args.config == "all" else [args.config]
    out = []
    for name in names:
        cfg = source[name]
        given = {k: getattr(args, k) for k in ("seq", "layers", "hidden", "intermediate", "batch")}
        given = {k: v for k, v in given.items() if v is not None}
        shape = {k: given.pop(k) for k in ("layers", "hidden", "intermediate") if k in given}
        out.append(replace(cfg, model=replace(cfg.model, **shape), **given))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    modes = list(MODES) if args.mode == "all" else [args.mode]
    devices = tuple(args.devices)
    if any(d < 2 for d in devices):
        parser.error("--devices must be >= 2 (the one-process rows are always included)")
    only = tuple(args.schemes) if args.schemes else None
    unknown = sorted(set(only or ()) - set(SCHEME_KEYS))
    if unknown:
        parser.error(f"unknown --schemes {unknown}; known: {', '.join(SCHEME_KEYS)}")
    if only and not args.recompute and any(k.endswith(RECOMPUTE_SUFFIX) for k in only):
        parser.error("the *_rc rows need --recompute")
    results = []
    for cfg in configs_from_args(args):
        for mode in modes:
            print(f"\n== {cfg.name} / {mode}: {cfg.summary()}", flush=True)
            table = run_table(
                cfg,
                mode,
                devices,
                args.baseline_backend,
                only=only,
                recompute=args.recompute,
                progress=lambda r: print(
                    f"   {r.label} D={r.devices}: {r.peak / MB:.2f} MB ({r.seconds:.0f} s)",
                    flush=True,
                ),
            )
            print(format_table(table), flush=True)
            if args.markdown:
                print(markdown_table(table))
            results.append(table)
    if args.json:
        args.json.write_text(
            json.dumps(
                [
                    {
                        "config": asdict(t.config),
                        "mode": t.mode,
                        "rows": [asdict(r) for r in t.rows],
                        "checks": t.checks(),
                    }
                    for t in results
                ],
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    # Run the importable module's main, so that what is pickled for the spawned ranks (the
    # worker, the job) refers to ``bench.memory`` rather than to this script's ``__main__``.
    from bench.memory import main as _main

    raise SystemExit(_main())
