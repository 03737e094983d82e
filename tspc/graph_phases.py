"""The phases after the graph phase, and what every phase shares: a pass (``Pass``), the
context of the later phases' passes (``GraphContext``) and the loop that runs a phase
(``run_passes``). ``tspc/pipeline.py`` lists every phase (``PHASES``) and runs the graph phase."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.fx as fx

from tspc.passes.aot_graphs import (
    keep_backward_transfers_in_backward,
    mark_transfers_for_recompute,
    split_addmm_across_waits,
    split_recomputed_transfers,
)
from tspc.passes.graph_utils import eliminate_dead_code
from tspc.passes.schedule import schedule_overlap
from tspc.passes.specialize import specialize
from tspc.runtime.compat import joint_graph_cse

from .options import TSPOptions

log = logging.getLogger("tspc")


@dataclass
class GraphContext:
    """What a pass of the phases after ``PIPELINE`` sees: one graph (Dynamo's symbolic graph,
    aot_autograd's joint, forward or backward graph, or Inductor's post-grad graph), the
    options, and what a pass tells the code that runs its phase."""

    graph: fx.Graph
    opts: TSPOptions | None = None
    gm: fx.GraphModule | None = None  # the module that owns ``graph``, where there is one
    example_inputs: list[Any] = field(default_factory=list)
    # JOINT_PIPELINE: False once split_recomputed_transfers made the backward its own copies,
    # which the partitioner's CSE would merge back
    partitioner_cse: bool = True

    def code(self) -> str:
        return self.graph.python_code(root_module="self").src


@dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[[Any], None]  # step(ctx): a PassContext in PIPELINE, else a GraphContext
    applies: Callable[[Any], bool] = lambda ctx: True


def run_passes(
    passes: tuple[Pass, ...],
    ctx: Any,  # a PassContext in PIPELINE, else a GraphContext
    snapshots: list[tuple[str, str]] | None = None,
    where: str = "",
) -> None:
    """Every pass of ``passes`` that applies, in order. With ``snapshots`` (a dump), the code
    after each pass is appended to it, as (pass name, Python code). An error leaves with the
    pass and ``where`` noted on it; whoever runs the phase decides what a failure means (the
    backend falls back to the next level for ``PIPELINE``)."""
    for p in passes:
        if p.applies(ctx):
            log.debug("tspc: pass %s (%s)", p.name, where)
            try:
                p.run(ctx)
            except Exception as e:
                if hasattr(e, "add_note"):  # Python >= 3.11
                    e.add_note(f"tspc: in pass '{p.name}' ({where})")
                raise
        if snapshots is not None:
            snapshots.append((p.name, ctx.code()))


def _specialize(ctx: GraphContext) -> None:
    ctx.gm = specialize(ctx.gm, ctx.example_inputs)  # a new, static graph
    ctx.graph = ctx.gm.graph


SPECIALIZE: tuple[Pass, ...] = (Pass("specialize", _specialize),)


def _keep_backward_transfers_in_backward(ctx: GraphContext) -> None:
    keep_backward_transfers_in_backward(ctx.graph)


def _mark_transfers_for_recompute(ctx: GraphContext) -> None:
    mark_transfers_for_recompute(ctx.graph)


def _has_recomputed_regions(ctx: GraphContext) -> bool:
    return any(n.meta.get("ac_graph_id", 0) > 0 for n in ctx.graph.nodes)


def _split_recomputed_transfers(ctx: GraphContext) -> None:
    # Recomputed regions: the backward fetches its own weights and K/V. The partitioner's CSE
    # would merge those copies back, so CSE runs here, before they are made, and not again.
    gm = ctx.gm
    eliminate_dead_code(gm.graph)
    gm.graph = ctx.graph = joint_graph_cse(gm.graph)
    if split_recomputed_transfers(gm.graph):
        gm.recompile()
        ctx.partitioner_cse = False


JOINT_PIPELINE: tuple[Pass, ...] = (
    Pass("keep_backward_transfers_in_backward", _keep_backward_transfers_in_backward),
    Pass("mark_transfers_for_recompute", _mark_transfers_for_recompute),
    Pass("split_recomputed_transfers", _split_recomputed_transfers, _has_recomputed_regions),
)


def _schedule_aot_graph(ctx: GraphContext) -> None:
    schedule_overlap(ctx.gm)


AOT_GRAPH_PIPELINE: tuple[Pass, ...] = (
    Pass("schedule", _schedule_aot_graph, lambda ctx: ctx.opts.overlap),
)


def _split_addmm_across_waits(ctx: GraphContext) -> None:
    split_addmm_across_waits(ctx.graph)


POST_GRAD_PIPELINE: tuple[Pass, ...] = (
    Pass("split_addmm_across_waits", _split_addmm_across_waits),
)
