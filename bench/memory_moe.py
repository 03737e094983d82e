"""Per-rank peak memory of a mixture-of-experts model: one process vs TSP, TP+SP and TP+EP, measured.

    python bench/memory_moe.py                 # training step, D = 2 and 4
    python bench/memory_moe.py --quick         # tiny shapes, seconds per row (the test's run)
    python bench/memory_moe.py --mode forward

The model is transformers' Mixtral built from a small config (random weights, sdpa attention),
wrapped with its cross-entropy loss (``tspc.tools.measure.LossModel``). Every row is a real gloo
run (``tspc.launch.spawn``), measured as ``bench/memory.py`` measures (a ``MemoryTracker``
started before the model is built; two warm-up steps, the third measured):

* ``one process (aot_eager)``: the reference of the ratios.
* ``TSP``: ``torch.compile(model, backend="tsp", options={"inner": "aot_eager"})``: attention
  and experts 1/D per rank on one axis, tokens 1/D, the pairs routed by all-to-all
  (``docs/moe.md``).
* ``TP+SP``: Megatron-SP with tensor-parallel experts (``tspc/tools/baselines_moe.py``'s
  ``build_tp_sp``: S/D tokens between the blocks, attention heads / D, every expert's
  intermediate dim / D, reduce-scatters back to the tokens), compiled with ``aot_eager``.
* ``TP+EP``: the hand-written baseline of ``tspc/tools/baselines_moe.py`` (torch's
  ``ColwiseParallel`` / ``RowwiseParallel`` on the attention, each rank's E/D experts on every
  token, one all-reduce per MoE layer), compiled with ``aot_eager``.

Every row also prints the loss of its measured (third) step: both parallel rows must equal the
one-process loss (``loss vs one`` column, the largest relative difference over ranks) — a row
that trains a different model would not be a baseline.

"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from bench.memory import COLUMNS, MB, WARMUP_STEPS, Scheme, make_row, markdown_rows, row_cells
from tspc.tools.shapes import ModelShape


@dataclass(frozen=True)
class MoeConfig:
    """A Mixtral shape and one sequence length (fp32). The shape is the planner's ``ModelShape``
    and the model is built from it as ``tspc plan --measure`` builds one (``hf_moe_config``), so
    the bench and the planner's measurement run the same transformers config for a shape."""

    shape: ModelShape
    seq: int = 512
    batch: int = 1

    def hf_config(self) -> Any:
        from tspc.tools.fake_moe import hf_moe_config

        return hf_moe_config(self.shape)

    def summary(self) -> str:
        m = self.shape
        return (
            f"Mixtral h={m.hidden} L={m.layers} heads={m.heads}/{m.kv_heads}kv "
            f"E={m.experts} top-{m.experts_per_token} F={m.expert_intermediate} "
            f"vocab={m.vocab} B={self.batch} S={self.seq} fp32"
        )


FULL = MoeConfig(
    ModelShape(
        hidden=256,
        layers=2,
        heads=8,
        kv_heads=4,
        intermediate=512,  # unused: every layer is MoE
        vocab=512,
        experts=8,
        experts_per_token=2,
        expert_intermediate=512,
        family="mixtral",
        name="mixtral (bench)",
    )
)
QUICK = MoeConfig(
    replace(
        FULL.shape, hidden=64, heads=4, kv_heads=4, experts=4, expert_intermediate=128, vocab=256
    ),
    seq=64,
)


def schemes(devices: tuple[int, ...]) -> list[Scheme]:
    rows = [Scheme("one_aot", "one process (aot_eager)", 1)]
    for d in devices:
        rows += [Scheme("tsp", "TSP", d), Scheme("tp_sp", "TP+SP", d), Scheme("tp_ep", "TP+EP", d)]
    return rows


@dataclass(frozen=True)
class Job:
    config: MoeConfig
    scheme: str
    mode: str


def _build(job: Job) -> tuple[torch.nn.Module, Any]:
    from tspc.tools.baselines_moe import build_tp_ep, build_tp_sp
    from tspc.tools.fake_moe import build_moe_model
    from tspc.tools.measure import LossModel

    model = LossModel(build_moe_model(job.config.hf_config()))
    if job.scheme == "tsp":
        return model, torch.compile(model, backend="tsp", options={"inner": "aot_eager"})
    if job.scheme == "tp_ep":
        build_tp_ep(model.model.model)
    elif job.scheme == "tp_sp":
        build_tp_sp(model.model.model)
    return model, torch.compile(model, backend="aot_eager")


def measure_rank(rank: int, world_size: int, job: Job) -> dict[str, Any]:
    """One rank's measured step (a ``spawn`` worker)."""
    import logging
    import warnings

    import tspc
    from tspc.tools.baselines import param_groups
    from tspc.tools.measure import measured_step, shards_of, warm_up
    from tspc.tools.memory import MemoryTracker, breakdown

    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(0)
    last_id = tspc.report.last_graph_id()
    cfg = job.config
    g = torch.Generator().manual_seed(1)
    with MemoryTracker() as tracker:
        ids = torch.randint(0, cfg.shape.vocab, (cfg.batch, cfg.seq), generator=g)
        targets = torch.randint(0, cfg.shape.vocab, (cfg.batch, cfg.seq), generator=g)
        model, step = _build(job)

        def make_optimizer():
            params = (
                param_groups(model)
                if job.scheme in ("tp_ep", "tp_sp")
                else list(model.parameters())
            )
            return torch.optim.AdamW(params, lr=1e-3)

        optimizer = warm_up(step, ids, targets, job.mode, WARMUP_STEPS, make_optimizer)
        tracker.reset_peak()
        loss = measured_step(step, ids, targets, job.mode, optimizer)
        result = breakdown(model, optimizer, extra_params=shards_of(model), tracker=tracker)
    reports = tspc.report.reports_after(last_id)
    report = reports[-1] if reports else None
    skipped = [e for e in report.entries if e.status != "matched"] if report else []
    result.update(
        loss=float(loss.detach()),
        level=report.level if report else None,
        matched=len(report.matched) if report else 0,
        skipped=len(skipped),
    )
    return result


def run(config: MoeConfig, mode: str, devices: tuple[int, ...], timeout: float = 900) -> list:
    """Every row: (Row, the losses of its ranks)."""
    from tspc.launch import spawn

    out = []
    for scheme in schemes(devices):
        t = time.perf_counter()
        per_rank = spawn(
            measure_rank, scheme.devices, Job(config, scheme.key, mode), timeout=timeout
        )
        row = make_row(scheme, per_rank, time.perf_counter() - t)
        out.append((row, [r["loss"] for r in per_rank], [r["skipped"] for r in per_rank]))
        print(f"   {row.label} D={row.devices}: {row.peak / MB:.2f} MB ({row.seconds:.0f} s)")
    return out


def format_table(config: MoeConfig, mode: str, rows: list) -> str:
    ref = rows[0][0]
    ref_loss = rows[0][1][0]
    what = "training step (forward + loss + backward + AdamW)" if mode == "train" else "forward"
    lines = [
        f"{config.summary()}; {what}",
        "per-rank peak in MB (1e6 B), max over ranks; x one: peak / one-process peak; "
        "x(one/D): peak / (one-process peak / D); loss vs one: the measured step's loss, "
        "largest relative difference over ranks",
    ]
    headers = ["scheme", "D", "peak", "x one", "x(one/D)", "loss vs one"] + [c for c, _ in COLUMNS]
    cells = []
    for row, losses, _ in rows:
        diff = max(abs(x - ref_loss) / abs(ref_loss) for x in losses)
        own = row_cells(row, ref)
        cells.append([*own[:5], f"{diff:.1e}", *own[5:]])  # the loss after the ratios
    widths = [max(len(x[i]) for x in [headers, *cells]) for i in range(len(headers))]
    for c in [headers, *cells]:
        lines.append(
            "  "
            + "  ".join([c[0].ljust(widths[0])] + [x.rjust(w) for x, w in zip(c[1:], widths[1:])])
        )
    for d in sorted({r.devices for r, _, _ in rows if r.devices > 1}):
        by = {r.key: r for r, _, _ in rows if r.devices == d}
        lines.append(
            f"  D={d}: TSP / TP+SP peak = {by['tsp'].peak / by['tp_sp'].peak:.2f}, "
            f"TSP / TP+EP peak = {by['tsp'].peak / by['tp_ep'].peak:.2f}"
        )
    return "\n".join(lines)


def markdown(rows: list) -> str:
    return markdown_rows([row for row, _, _ in rows], rows[0][0])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/memory_moe.py", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="tiny shapes (seconds per row)")
    parser.add_argument("--mode", choices=("train", "forward"), default="train")
    parser.add_argument("--devices", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--markdown", action="store_true", help="also print a markdown table")
    args = parser.parse_args(argv)
    if any(d < 2 for d in args.devices):
        parser.error("--devices must be >= 2 (the one-process row is always included)")
    config = QUICK if args.quick else FULL
    print(f"== {config.summary()} / {args.mode}", flush=True)
    rows = run(config, args.mode, tuple(args.devices))
    print(format_table(config, args.mode, rows))
    if args.markdown:
        print(markdown(rows))
    return 0


if __name__ == "__main__":
    from bench.memory_moe import main as _main  # pickled workers refer to bench.memory_moe

    raise SystemExit(_main())
