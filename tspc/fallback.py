"""No crash where a plain ``torch.compile`` would have run: the plain compile stands in.

When anything in tspc's compile of a graph raises — a pass, aot_autograd's trace, the
partitioner, the inner compiler of the forward or of the backward (compiled with the forward,
``tspc/inner.py``) — the backend compiles the graph as Dynamo gave it with the inner compiler
the user chose and no tspc pass (``compile_plain``): what ``torch.compile(model,
backend=inner)`` runs. Every rank then computes the whole graph on the full batch it was given,
which is what one process computes; gradients are the full ones on every rank (averaged over a
data-parallel axis, as tspc's own graphs are). Every rank warns with the cause, and the report
says level ``'fallback'`` with it. A weight an earlier graph sharded and released is gathered
whole at every call of the plain graph (``tspc/later_graphs.py``).

Not when it would be wrong or cannot work; then tspc raises instead:

* ``strict``: the cause, as a ``TSPCompileError``;
* a configuration error (``TSPConfigError``): the user's to fix, no fallback is right;
* ``outputs='sharded'``: the caller expects its zigzag tokens, a plain graph returns them all;

A failure at a compiled graph's first *call* is not covered: the first call releases the full
weights before it runs the graph, so nothing whole is left to fall back on.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch.fx as fx
from torch import nn

from tspc.runtime.data_parallel import average_grads_over
from tspc.runtime.errors import TSPConfigError, describe_error
from tspc.runtime.group import TSPGroup
from tspc.runtime.release import tspc_internal
from tspc.runtime.shard_store import STORE

from . import compiles
from .errors import REPORT_HINT, FallbackWarning, ReleasedWeightsNeededError, TSPCompileError
from .inner import compile_plain
from .later_graphs import gather_inputs, plan_gathers, released_inputs
from .options import TSPOptions
from .outside_graphs import first_call
from .report import CompileReport, forget_report, remember

log = logging.getLogger("tspc")


def warn_level_failed(graph_id: int, level: str, later: tuple[str, ...], error: Exception) -> None:
    """The warning of a pass level that raised (the backend then runs the next, or falls back
    to a plain compile after the last)."""
    warnings.warn(
        f"tspc: graph {graph_id}: the '{level}' passes failed ({describe_error(error)}); "
        + (
            f"level '{later[0]}' runs the graph instead (it shards less memory)"
            if later
            else "a plain compile runs the graph instead"
        )
        + f". The numbers are unchanged. This is a tspc bug: {REPORT_HINT}.",
        FallbackWarning,
        stacklevel=3,
    )


class _PlainGraph:
    """The plain compiled graph, as Dynamo calls it; with a data-parallel axis, its parameters
    get the gradient-averaging hook tspc's own graphs install (``runtime/data_parallel.py``)."""

    def __init__(
        self, fn: Callable, params: list[int], group: TSPGroup, gathers: list[tuple[int, str]]
    ):
        self.fn = fn
        self.params = params
        self.group = group
        self.gathers = gathers  # released weights read whole: gathered at every call
        self.first = True

    def __call__(self, *args):
        g = self.group
        if self.first:  # what the graph receives, and what it does not (outside_graphs.py)
            self.first = False
            first_call(list(args), self.params, g)
        if g.dp_size > 1:
            average_grads_over([args[i] for i in self.params], g.dp_name, g.dp_size)
        if self.gathers:
            args = list(args)
            with tspc_internal():
                gather_inputs(args, self.gathers)
        return self.fn(*args)


def fall_back(
    cause: BaseException,
    dynamo_gm: fx.GraphModule,
    example_inputs: list[Any],
    group: TSPGroup,
    opts: TSPOptions,
    graph_id: int,
    why: tuple[str, str],
    dynamo_compile_id: str | None,
    warn: bool = True,
) -> Callable:
    """The plain compile of ``dynamo_gm`` standing in for tspc's, which raised ``cause``; or the
    error that says why none can (module docstring). ``warn=False``: another shape of the same
    graph already warned of this cause."""
    if isinstance(cause, (TSPConfigError, ReleasedWeightsNeededError)):
        raise cause
    what = describe_error(cause)
    if opts.strict:
        if isinstance(cause, TSPCompileError):
            raise cause
        raise TSPCompileError(
            f"tspc (strict): compiling graph {graph_id} with the TSP schedules failed: {what}"
        ) from cause
    if group.dp_size > 1 and released_inputs(dynamo_gm, example_inputs, plain=True):
        # gather-on-use covers the TSP axis only: a weight also split over the data-parallel
        # axis (data_parallel="fsdp") has no whole value to hand a plain graph here
        names = [n.name for n in dynamo_gm.graph.find_nodes(op="placeholder")]
        raise ReleasedWeightsNeededError(
            f"tspc: compiling graph {graph_id} with the TSP schedules failed ({what}), and a "
            "plain compile cannot stand in with a data-parallel axis: it reads the whole "
            f"weights {', '.join(names[i] for i in released_inputs(dynamo_gm, example_inputs, plain=True))}, "
            "which an earlier graph sharded and released. Compile with "
            f"options={{'schedules': 'sp'}} (no weight sharding) meanwhile; {REPORT_HINT}."
        ) from cause
    if opts.outputs == "sharded":
        raise TSPCompileError(
            f"tspc: compiling graph {graph_id} with the TSP schedules failed ({what}); a plain "
            "compile cannot stand in with options={'outputs': 'sharded'} (it returns every "
            "token, not this rank's zigzag part). Use outputs='gathered' for this model; "
            f"{REPORT_HINT}."
        ) from cause
    STORE.forget(example_inputs)  # layouts this compile declared: nothing will cut them
    # the plain graph reads these whole: a later TSP graph must not release them
    placeholders = dynamo_gm.graph.find_nodes(op="placeholder")
    STORE.hold_whole(
        x for n, x in zip(placeholders, example_inputs) if n.users and isinstance(x, nn.Parameter)
    )
    if warn:
        warnings.warn(
            f"tspc: compiling graph {graph_id} with the TSP schedules failed ({what}); it runs as "
            f"a plain torch.compile with backend='{opts.inner}' instead: every rank computes the "
            "whole graph with whole weights (the numbers of one process, none of TSP's memory "
            f"saving). This is a tspc bug: {REPORT_HINT}; options={{'strict': True}} makes it an "
            "error.",
            FallbackWarning,
            stacklevel=2,
        )
    # the warning has the cause; the traceback is for a report (logger "tspc" at INFO)
    log.info("tspc: graph %d falls back to a plain compile", graph_id, exc_info=cause)
    t0 = time.perf_counter()
    fn = compile_plain(dynamo_gm, example_inputs, opts.inner)
    report = CompileReport(rank=group.rank, world=group.size, level="fallback", graph_id=graph_id)
    report.fallbacks = [f"plain compile (backend='{opts.inner}'): {what}"]
    gathers = plan_gathers(dynamo_gm, dynamo_gm, example_inputs, report, "a plain compile")
    report.compile_reason = why[1]
    report.compile_seconds = {"plain compile": time.perf_counter() - t0}
    forget_report(graph_id)  # the report of the attempt that failed, if it got that far
    remember(report)
    if not any(e.graph_id == graph_id for e in compiles.EVENTS):  # one record per graph
        event = compiles.CompileEvent(graph_id, why[0], why[1], dynamo_compile_id)
        event.seconds = report.compile_seconds
        compiles.record(event)
    params = [i for i, x in enumerate(example_inputs) if isinstance(x, nn.Parameter)]
    return _PlainGraph(fn, params, group, gathers)


def compile_over_own_parameters(gm: fx.GraphModule, inputs: list, group, inner, graph_id: int):
    """A graph over the DTensor parameters tspc made, with their gradients and optimizer state
    (``torch.compile`` of a training step whose optimizer step Dynamo traces as a graph of its
    own): nothing in it to shard — DTensor's own ops run it on each rank's shards — so the
    inner compiler takes it as it is, as ``torch.compile(backend=inner)`` would. No report:
    ``tspc.last_report()`` stays the model's."""
    log.info("tspc: graph %d reads tspc's DTensor parameters: a plain compile", graph_id)
    t0 = time.perf_counter()
    fn = compile_plain(gm, inputs, inner)
    why = "a graph over tspc's DTensor parameters (an optimizer step), compiled plainly"
    event = compiles.CompileEvent(graph_id, compiles.NEW_GRAPH, why, compiles.dynamo_compile_id())
    event.seconds = {"plain compile": time.perf_counter() - t0}
    compiles.record(event)
    params = [i for i, x in enumerate(inputs) if isinstance(x, nn.Parameter)]
    return _PlainGraph(fn, params, group, [])
