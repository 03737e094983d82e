"""The ``tsp`` torch.compile backend.

Registered through the ``torch_dynamo_backends`` entry point, so ``backend="tsp"`` resolves
without importing tspc. Dynamo calls ``tsp_backend(gm, example_inputs, options=...)`` once per
captured graph; the backend runs the pass pipeline (``tspc/pipeline.py``) and hands the result to
the inner compiler (``tspc/inner.py``).

A graph traced with symbolic sizes (Dynamo marks a dimension dynamic once it has seen two
values) is compiled per concrete shape at its first call with that shape: the passes bake the
local sequence length into shapes, and every rank sees the same shapes in the same order, so all
ranks compile the same graphs.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from tspc.passes.analyse import analyse
from tspc.passes.specialize import specialize
from tspc.runtime import comm
from tspc.runtime.data_parallel import average_grads_over
from tspc.runtime.errors import TSPConfigError
from tspc.runtime.group import TSPGroup, resolve_group
from tspc.runtime.input_check import check_same_inputs
from tspc.runtime.release import release, tspc_internal
from tspc.runtime.shard_store import STORE

from .dump import write_dump
from .inner import AotGraphs, compile_inner
from .options import TSPOptions
from .pipeline import LEVELS, PipelineResult, run_pipeline
from .report import REPORTS, CompileReport

log = logging.getLogger("tspc")
_GRAPH_IDS = itertools.count()


@dataclass
class CompiledGraph:
    """Everything one compile produced: the report, the pass-by-pass graphs, the aot graphs."""

    report: CompileReport
    pipeline: PipelineResult
    aot: AotGraphs


COMPILED: list[CompiledGraph] = []
"""Every graph compiled in this process, oldest first (for dumps and tests)."""


class TSPCompileError(RuntimeError):
    """The passes could not handle the model and ``strict`` was requested."""


def _compile_static(
    gm: fx.GraphModule, example_inputs: list[Any], group: TSPGroup, opts: TSPOptions
) -> Callable:
    graph_id = next(_GRAPH_IDS)
    start = {"tsp": "tsp", "sp": "sp", "none": "replicated"}[opts.schedules]
    errors: list[str] = []
    result: PipelineResult | None = None
    for level in LEVELS[LEVELS.index(start) :]:
        try:
            result = run_pipeline(gm, example_inputs, group, opts, level, graph_id)
            break
        except TSPConfigError:
            raise  # a configuration the user must change: no fallback would be right
        except Exception as e:  # noqa: BLE001 - reported, then the next level runs
            if opts.strict:
                raise TSPCompileError(
                    f"tspc (strict): the '{level}' pipeline failed on graph {graph_id}: {e}"
                ) from e
            log.warning("tspc: the '%s' pipeline failed (%s); falling back", level, e)
            errors.append(f"'{level}' failed: {type(e).__name__}: {e}")
    assert result is not None
    report = result.report
    report.fallbacks = errors
    if opts.strict:
        skipped = report.skipped
        if skipped:
            lines = "\n".join(f"  {e.kind} {e.module}: {e.reason}" for e in skipped)
            raise TSPCompileError(
                "tspc (strict): these modules would not run the TSP schedules:\n" + lines
            )
    REPORTS.append(report)
    log.info("%s", report.summary())
    graphs = AotGraphs()
    COMPILED.append(CompiledGraph(report, result, graphs))
    compiled = compile_inner(result.gm, example_inputs, opts, graphs)
    if opts.dump_dir:
        # Writes the dump now; the wrapper rewrites it after the first call and around the
        # first backward (measured counters, the backward graph): see tspc/dump.py.
        compiled = write_dump(opts.dump_dir, result, graphs, group, compiled, example_inputs, opts)
    releasable, kept = _releasable_parameters(result.gm, example_inputs)
    for name in kept:
        report.notes.append(f"{name} is sharded but still used whole by this graph; not released")
    if group.dp_size > 1:
        _average_over_data_parallel(result.gm, example_inputs, group)
    checked = None
    if opts.check_inputs and group.size > 1:
        info = analyse(gm, example_inputs)
        checked = [
            (i, inp.node.name)
            for i, inp in enumerate(info.inputs)
            if inp.kind == "input" and isinstance(inp.example, torch.Tensor)
        ]
    return _ReleaseAfterFirstCall(compiled, releasable, checked, group)


def _releasable_parameters(gm: fx.GraphModule, example_inputs: list[Any]):
    """Full parameters this graph no longer reads (only its shards): they can be released."""
    releasable, kept = [], []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, ex in zip(placeholders, example_inputs):
        entry = STORE.get(ex) if isinstance(ex, torch.Tensor) else None
        if entry is None:
            continue
        if node.users:
            kept.append(node.name)
        else:
            releasable.append(ex)
    return releasable, kept


def _average_over_data_parallel(gm, example_inputs, group: TSPGroup) -> None:
    params = []
    for ex in example_inputs:
        if isinstance(ex, torch.nn.Parameter):
            entry = STORE.get(ex)
            params += list(entry.shards.values()) if entry is not None else [ex]
    average_grads_over(params, group.dp_name, group.dp_size)


class _ReleaseAfterFirstCall:
    """The compiled graph; after its first call the full sharded parameters are released.

    Not before: the first call may be the one Dynamo uses to check the graph, and releasing at
    compile time would free weights while the original module could still run eagerly between
    ``torch.compile`` and the first call.
    """

    def __init__(
        self,
        fn: Callable,
        releasable: list[torch.Tensor],
        checked_inputs: list[tuple[int, str]] | None = None,
        group: TSPGroup | None = None,
    ):
        self.fn = fn
        self.releasable = releasable
        self.checked_inputs = checked_inputs
        self.group = group
        if getattr(fn, "_boxed_call", False):
            self._boxed_call = True

    def __call__(self, *args):
        if self.checked_inputs:
            flat = args[0] if getattr(self, "_boxed_call", False) else args
            check_same_inputs(
                [(name, flat[i]) for i, name in self.checked_inputs],
                self.group.name,
                self.group.size,
            )
        with tspc_internal():  # the graph's inputs include the released parameters, unread
            out = self.fn(*args)
        if self.releasable:
            release(self.releasable)
            self.releasable = []
        return out


class _PerShapeCompiler:
    """Compiles a symbolic-shape graph once per concrete input shape, at first use."""

    def __init__(self, gm: fx.GraphModule, group: TSPGroup, opts: TSPOptions):
        self.gm = gm
        self.group = group
        self.opts = opts
        self.cache: dict[tuple, Callable] = {}

    def __call__(self, *args):
        key = tuple(
            (a.item() if a.dim() == 0 and not a.requires_grad else tuple(a.shape))
            if isinstance(a, torch.Tensor)
            else (a if isinstance(a, int) else None)
            for a in args
        )
        fn = self.cache.get(key)
        if fn is None:
            with tspc_internal():
                static = specialize(self.gm, list(args))
                fn = _compile_static(static, list(args), self.group, self.opts)
            self.cache[key] = fn
        return fn(*args)


def tsp_backend(
    gm: fx.GraphModule, example_inputs: list[Any], *, options: dict | None = None
) -> Callable:
    """Compile one Dynamo graph with Tensor-and-Sequence Parallel schedules."""
    with tspc_internal():
        return _tsp_backend(gm, example_inputs, options)


def _refuse_presharded(example_inputs: list[Any], gm: fx.GraphModule) -> None:
    """A model already sharded by FSDP or DTensor-based TP: tspc must see the plain model."""
    from torch.distributed.tensor import DTensor

    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    for name, ex in zip(names, example_inputs):
        kind = None
        if isinstance(ex, DTensor):
            kind = "a DTensor (FSDP2 fully_shard or tensor-parallel parallelize_module)"
        elif type(ex).__name__ == "FlatParameter" or "_fsdp_wrapped_module" in name:
            kind = "an FSDP flat parameter"
        if kind:
            raise TSPConfigError(
                f"tspc: input '{name}' is {kind}: the model is already sharded. tspc shards "
                "weights and tokens itself; compile the unwrapped model with backend='tsp' "
                "(combine with data parallelism through a 2-D mesh, see the README)."
            )


def _tsp_backend(gm, example_inputs, options):
    opts = TSPOptions.from_dict(options)
    _refuse_presharded(list(example_inputs), gm)
    group = resolve_group(opts.group, opts.mesh_dim)
    if opts.comm_timeout is not None:
        comm.SETTINGS.timeout_s = float(opts.comm_timeout)
    info = analyse(gm, example_inputs)
    if info.has_symbolic_inputs:
        log.info("tspc: symbolic shapes: compiling per concrete shape at first use")
        return _PerShapeCompiler(gm, group, opts)
    return _compile_static(gm, list(example_inputs), group, opts)
