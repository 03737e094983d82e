"""`tspc plan --dp N --data-parallel replicate|fsdp|hsdp`: per-rank memory of TSP(D) with N
data-parallel replicas of it on a 2-D (dp, tsp) mesh, or a 3-D (rep, shard, tsp) one for hsdp
(``docs/cluster.md``).

Only the model state changes with dp (activations, gathered K/V, logits, weights in flight and
the fixed overhead are those of one TSP(D) axis):

* ``replicate``: every dp rank keeps TSP's 1/D of the model state (``runtime/data_parallel.py``);
* ``fsdp``: the model state is split over all dp x D ranks (``runtime/dp_shard.py``: layer
  weights 1/D over tsp and 1/dp over dp, embeddings and norms over the whole mesh), and a call
  gathers the TSP-local weights (1/D of the model, in the weight dtype) and, before the
  reduce-scatter, holds their unreduced gradients (the same bytes again: an upper bound, the
  compiled backward hands the gradients over together).
* ``hsdp``: as ``fsdp`` within shard groups of ``--dp-shard S`` ranks (the model state over
  S x D ranks), replicated across the dp / S groups.

``tspc plan --measure`` with ``fsdp`` or ``hsdp`` runs the real graphs on that mesh of fake
ranks (``tspc/tools/measure.py``) and prints the measured split beside these rows.
"""

from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from typing import Any

MODES = ("replicate", "fsdp", "hsdp")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("data parallelism on top of the TSP axis (docs/cluster.md)")
    group.add_argument(
        "--dp", type=_dp_size, default=1, help="N: data-parallel replicas of the TSP axis (1)"
    )
    group.add_argument(
        "--data-parallel",
        choices=MODES,
        default="replicate",
        help="what the dp axis does with the model state (replicate)",
    )
    group.add_argument(
        "--dp-shard", type=_dp_size, default=None, metavar="S",
        help="hsdp: ranks of the dp axis in one shard group (default: all of dp, as fsdp)",
    )  # fmt: skip


def _dp_size(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"--dp must be a positive integer, got {text!r}")
    return value


@dataclass(frozen=True)
class DPMemory:
    """Per-rank bytes of TSP(D) under one data-parallel mode."""

    mode: str
    model_state: float
    gathered: float  # fsdp: TSP-local weights of a call + their gradients before reduce-scatter
    rest: float  # activations, gathered K/V, logits, weights in flight, overhead

    @property
    def total(self) -> float:
        return self.model_state + self.gathered + self.rest


@dataclass(frozen=True)
class TSPAxis:
    """What the plan says of one TSP(D) axis: its per-rank model state and total, and the
    model's whole model state (kappa bytes per parameter)."""

    model_state: float
    total: float
    full_model_state: float
    kappa: float
    weight_bytes: int
    devices: int


def dp_memory(axis: TSPAxis, dp: int, mode: str, shard: int | None = None) -> DPMemory:
    """Per-rank memory of ``axis`` with ``dp`` replicas under ``mode`` (hsdp: shard groups of
    ``shard`` ranks, default all of dp)."""
    rest = axis.total - axis.model_state
    if mode == "replicate" or dp == 1:
        return DPMemory(mode, axis.model_state, 0.0, rest)
    local_params = axis.model_state / axis.kappa if axis.kappa else 0.0
    spread = dp if mode == "fsdp" else (shard or dp)
    state = axis.full_model_state / (spread * axis.devices)
    return DPMemory(mode, state, 2 * local_params * axis.weight_bytes, rest)


def dp_rows(axis: TSPAxis, dp: int, shard: int | None = None) -> list[DPMemory]:
    return [dp_memory(axis, dp, m, shard) for m in MODES]


def format_dp(
    rows: list[DPMemory], devices: int, dp: int, chosen: str, shard: int | None = None
) -> str:
    gb = 1e9
    groups = f", hsdp shard groups of {shard}" if shard and shard != dp else ""
    lines = [
        "",
        f"Data parallelism: dp = {dp} replicas of TSP(D={devices}) = {dp * devices} ranks "
        f"(--data-parallel {chosen}{groups}); per rank, GB:",
        f"  {'':44}" + "".join(f"{r.mode:>12}" for r in rows),
    ]
    for label, key in (
        ("model state (weights, grads, optimizer)", "model_state"),
        ("weights gathered for a call + their grads", "gathered"),
        ("activations, K/V, logits, overhead", "rest"),
        ("total", "total"),
    ):
        lines.append(f"  {label:44}" + "".join(f"{getattr(r, key) / gb:>12.2f}" for r in rows))
    return "\n".join(lines)


def dp_json(rows: list[DPMemory], dp: int, chosen: str, shard: int | None = None) -> dict[str, Any]:
    return {
        "dp": dp,
        "dp_shard": shard or dp,
        "chosen": chosen,
        "per_rank_bytes": {r.mode: {**asdict(r), "total": r.total} for r in rows},
    }


def report(plan: Any, args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """The text section (empty at ``--dp 1``) and JSON section for a ``tspc plan`` run."""
    model, inputs = plan.model, plan.inputs
    tsp = plan.scheme(f"TSP(D={inputs.devices})").memory
    axis = TSPAxis(
        tsp.model_state, tsp.total, inputs.kappa * model.total_params, inputs.kappa,
        inputs.act_bytes, inputs.devices,
    )  # fmt: skip
    shard = check_shard(args.dp, args.dp_shard)
    rows = dp_rows(axis, args.dp, shard)
    text = (
        format_dp(rows, inputs.devices, args.dp, args.data_parallel, shard) if args.dp > 1 else ""
    )
    return text, dp_json(rows, args.dp, args.data_parallel, shard)


def check_shard(dp: int, shard: int | None) -> int | None:
    """``--dp-shard``, checked against ``--dp``: a ValueError naming the fix."""
    if shard is not None and dp % shard:
        raise ValueError(f"--dp-shard {shard} must divide --dp {dp} (the replicas of a group)")
    return shard
