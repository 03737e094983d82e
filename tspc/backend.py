"""The ``tsp`` torch.compile backend.

Registered through the ``torch_dynamo_backends`` entry point, so ``backend="tsp"`` resolves
without importing tspc. Dynamo calls ``tsp_backend(gm, example_inputs, options=...)`` once per
captured graph; the backend runs the pass pipeline (``tspc/pipeline.py``) and hands the result to
the inner compiler (``tspc/inner.py``).

A graph traced with symbolic sizes (Dynamo marks a dimension dynamic once it has seen two
values) is compiled per concrete shape at its first call with that shape: the passes bake the
local sequence length into shapes, and every rank sees the same shapes in the same order, so all
ranks compile the same forward graphs (the backward graphs differ: the weight broadcast's source
alone keeps the reduced gradient; every rank shares the order of the collectives). With
``dynamic_seq`` (the default) the first such length that is a multiple of 2D is compiled once
for every length of that kind instead (``tspc/length_family.py``).
"""

from __future__ import annotations

import itertools
import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from tspc.passes.analyse import analyse
from tspc.passes.schedule import transfers
from tspc.passes.shard_sequence import find_sequence_length
from tspc.runtime import comm
from tspc.runtime.autograd_glue import plain_tangents
from tspc.runtime.compat import tracing_context
from tspc.runtime.context import RuntimeContext
from tspc.runtime.data_parallel import average_grads_over
from tspc.runtime.dp_shard import whole_over_dp
from tspc.runtime.errors import TSPConfigError, TSPHeldWholeWarning
from tspc.runtime.group import TSPGroup, resolve_group
from tspc.runtime.optimizers import watch as watch_optimizers
from tspc.runtime.presharded import over_own_parameters, refuse_presharded
from tspc.runtime.rank_check import RankCheck, communicates, program_signature
from tspc.runtime.release import tspc_internal
from tspc.runtime.shard_store import STORE
from tspc.runtime.tsp_params import (
    adopt,
    bind_to_replicated,
    create_sharded_dparam,
    graph_input,
    layout_placement,
    local_views,
    prepare,
    tsp_param_of,
)

from . import compiles
from .dump import write_dump
from .errors import ReleasedWeightsNeededError, TSPCompileError  # noqa: F401 - re-exported
from .fallback import compile_over_own_parameters, fall_back, warn_level_failed
from .inner import AotGraphs, compile_inner
from .later_graphs import gather_inputs, level_cause, plan_gathers
from .length_family import (
    LengthFamily,
    LengthNotGeneralizable,
    LengthProbe,
    family_key,
    sequence_input,
)
from .options import TSPOptions
from .outside_graphs import first_call
from .pipeline import LEVELS, SPECIALIZE, GraphContext, PipelineResult, run_passes, run_pipeline
from .report import CompileReport, last_graph_id, remember

log = logging.getLogger("tspc")
_GRAPH_IDS = itertools.count()


@dataclass
class CompiledGraph:
    """Everything one compile produced: the report, the pass-by-pass graphs, the aot graphs."""

    report: CompileReport
    pipeline: PipelineResult
    aot: AotGraphs


COMPILED: list[CompiledGraph] = []  # the latest graphs compiled, oldest first (dumps, tests)
KEEP_COMPILED = 16  # at most: a long run that recompiles does not keep every graph it made


@compiles.gc_paused
def _compile_static(
    gm: fx.GraphModule,
    example_inputs: list[Any],
    group: TSPGroup,
    opts: TSPOptions,
    why: tuple[str, str],
    dynamo_compile_id: str | None,
    graph_id: int,
    probe: LengthProbe | None = None,
) -> Callable:
    """Run the passes and the inner compiler on a graph with static shapes. ``why`` is the
    kind and the words of the reason for this compile (``tspc/compiles.py``). With ``probe``
    (``dynamic_seq``), the inner compiler gets the rewritten graph generalised over the
    sequence length when that works (``tspc/length_family.py``; ``probe.failed`` says why
    not). Raises whatever fails: the callers fall back (``tspc/fallback.py``)."""
    t0 = time.perf_counter()
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
            warn_level_failed(graph_id, level, LEVELS[LEVELS.index(level) + 1 :], e)
    if result is None:  # even the replicated level failed: nothing tspc could run
        raise TSPCompileError(
            f"tspc: every pipeline level failed on graph {graph_id}, so it cannot run this "
            "graph at all:\n  " + "\n  ".join(errors) + "\nThe last level only traces and "
            "runs the graph unchanged, so this is a tspc bug (please report it with "
            "options={'dump_dir': ...}); compile with backend='inductor' meanwhile."
        )
    report = result.report
    report.fallbacks = errors
    gathers = plan_gathers(result.gm, gm, example_inputs, report, level_cause(report, errors))
    if opts.strict:
        skipped = report.skipped
        if skipped:
            lines = "\n".join(f"  {e.kind} {e.module}: {e.reason}" for e in skipped)
            raise TSPCompileError(
                "tspc (strict): these modules would not run the TSP schedules:\n" + lines
            )
    for message in report.held_whole():  # not only in the report: memory is not 1/D
        warnings.warn(message, TSPHeldWholeWarning, stacklevel=2)
    event = compiles.CompileEvent(graph_id, why[0], why[1], dynamo_compile_id)
    event.seconds["passes"] = time.perf_counter() - t0
    report.compile_reason = why[1]
    report.compile_seconds = event.seconds  # the same dict: the backward's time lands in both
    remember(report)
    log.info("%s", report.summary())
    graphs = AotGraphs(compile_seconds=event.seconds)
    COMPILED.append(CompiledGraph(report, result, graphs))
    del COMPILED[:-KEEP_COMPILED]
    full_inputs = _static_shard_examples(result.example_inputs(example_inputs), len(example_inputs))
    compiled = None
    if probe is not None:
        compiled = _compile_for_lengths(probe, result, full_inputs, group, opts, event)
        if compiled is None:  # compiled for this length alone
            graphs = COMPILED[-1].aot = AotGraphs(compile_seconds=event.seconds)
    if compiled is None:
        t1 = time.perf_counter()
        compiled = compile_inner(result.gm, full_inputs, opts, graphs)
        # aot_autograd's trace and partition and the forward's inner compile; the backward's
        # inner compile runs at the first backward (``AotGraphs.compile_seconds["backward"]``)
        event.seconds["aot+forward"] = time.perf_counter() - t1
    compiles.record(event)
    for failure in COMPILED[-1].aot.inductor_failures:
        report.notes.append(
            f"Inductor failed on the rewritten {failure}; that graph runs the same schedules "
            "with its local compute unfused (as inner='aot_eager')"
        )
    if opts.dump_dir:
        # Writes the dump now; the wrapper rewrites it after the first call and around the
        # first backward (measured counters, the backward graph): see tspc/dump.py.
        compiled = write_dump(opts.dump_dir, result, graphs, group, compiled, full_inputs, opts)
    for s in result.shard_inputs:
        s.example = None  # the compiled graph has what it needs; don't hold slices of weights
    releasable, kept, held = _releasable_parameters(result.gm, example_inputs)
    for name in kept:
        report.notes.append(
            f"{name} is sharded but still used whole by this graph: not released, held as a "
            "Replicate() DTensor"
        )
    for name in held:
        report.notes.append(
            f"{name} is sharded here but read whole by a graph that fell back to a plain "
            "compile: not released, held as a Replicate() DTensor"
        )
    info = analyse(gm, example_inputs)
    for i in sorted({s.param_index for s in result.shard_inputs}):
        entry = STORE.get(example_inputs[i])
        if layout_placement(entry.layout, tuple(entry.full_shape)) == ("replicate",):
            report.notes.append(
                f"{info.inputs[i].fqn}: its slices per rank are no DTensor placement (fused "
                "parts of unequal sizes, or an uneven split); held whole on every rank as a "
                "Replicate() DTensor, gradient summed over the group (memory not 1/D)"
            )
    rank_check = None  # ranks that disagree matter only to a graph that communicates
    if group.size > 1 and (result.shard_inputs or communicates(result.gm)):
        kinds = [(inp.kind, inp.fqn) for inp in info.inputs]
        rank_check = RankCheck.of_graph(group, kinds, opts.check_inputs, opts.sync_module_states)
        rank_check.program = program_signature(report.entries, transfers(result.gm.graph))
    params = [i for i, inp in enumerate(info.inputs) if inp.kind == "parameter"]
    layouts = {
        s.param_index: STORE.get(example_inputs[s.param_index]).layout for s in result.shard_inputs
    }
    return _CompiledTSPGraph(
        compiled,
        result.shard_inputs,
        layouts,
        releasable,
        params,
        rank_check,
        group,
        opts.comm_timeout,
        gathers,
        result.runtime,
    )


def _compile_for_lengths(
    probe: LengthProbe,
    result: PipelineResult,
    full_inputs: list[Any],
    group: TSPGroup,
    opts: TSPOptions,
    event: compiles.CompileEvent,
) -> Callable | None:
    """The inner compile of the rewritten graph generalised over the sequence length, or None
    (``probe.failed`` says why; the report notes it) when the graph is not one program for
    every length or its symbolic trace fails."""
    report = result.report
    t0 = time.perf_counter()
    try:
        general, inputs = probe.prepare(result, full_inputs, group, opts, report.level)
    except LengthNotGeneralizable as e:
        probe.failed = str(e)
    except Exception as e:  # noqa: BLE001 - reported; the static compile runs instead
        probe.failed = f"generalising the graph failed: {type(e).__name__}: {e}"
        log.warning("tspc: dynamic_seq: %s", probe.failed)
    event.seconds["length probes"] = time.perf_counter() - t0
    if probe.failed is None:
        t1 = time.perf_counter()
        try:
            compiled = compile_inner(general, inputs, opts, COMPILED[-1].aot)
        except Exception as e:  # noqa: BLE001 - reported; the static compile runs instead
            probe.failed = (
                f"the symbolic trace of the inner compiler failed: {type(e).__name__}: {e}"
            )
            log.warning("tspc: dynamic_seq: %s", probe.failed)
        else:
            event.seconds["aot+forward"] = time.perf_counter() - t1
            report.serves_lengths = f"every length that is a multiple of {probe.chunks}" + (
                f" up to {probe.longest}" if probe.longest is not None else ""
            )
            lengths = ", ".join(str(n) for n in probe.lengths)
            report.notes.append(
                f"dynamic_seq: one program for every length that is a multiple of {probe.chunks} "
                f"(the rewritten graphs at lengths {lengths} generalised; the inner compiler "
                "traced it with a symbolic length)"
            )
            return compiled
    report.notes.append(f"dynamic_seq: compiled for this length only: {probe.failed}")
    compiles.log.info("tspc: dynamic_seq: compiled for this length only: %s", probe.failed)
    return None


def _static_shard_examples(inputs: list[Any], n_original: int) -> list[Any]:
    """The shard inputs as fake tensors of Dynamo's fake mode, with static shapes.

    Inputs without a Dynamo source would otherwise get symbolic sizes from the shape
    environment aot_autograd shares with Dynamo; the passes specialised every shape."""
    ctx = tracing_context()
    fake_mode = getattr(ctx, "fake_mode", None)
    if fake_mode is None:
        return inputs
    return inputs[:n_original] + [
        fake_mode.from_tensor(t, static_shapes=True) for t in inputs[n_original:]
    ]


def _releasable_parameters(
    gm: fx.GraphModule, example_inputs: list[Any]
) -> tuple[list, list, list]:
    """Positions of full parameters this graph no longer reads (only their shards), the names
    of sharded ones it still reads whole, and of those a plain (fallback) graph reads whole
    (both kept; ``_CompiledTSPGraph`` also checks the latter at its first call)."""
    releasable, kept, held = [], [], []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for i, (node, ex) in enumerate(zip(placeholders, example_inputs)):
        if not (isinstance(ex, torch.Tensor) and STORE.get(ex) is not None):
            continue
        if STORE.get(ex).released:  # gathered per call (``tspc/later_graphs.py``)
            continue
        if node.users:
            kept.append(node.name)
        elif STORE.held_whole(ex):
            held.append(node.name)
        else:
            releasable.append(i)
    return releasable, kept, held


class _CompiledTSPGraph:
    """The compiled graph, as Dynamo calls it, with what the runtime adds around it: each call
    appends this rank's shards of the parameters passed (``passes/shard_inputs.py``: views of
    the local tensor of each weight's DTensor, so gradients land on the DTensors; Dynamo may
    run one graph for several modules); the first call cuts the DTensors from the full
    weights, then the modules hold them and the full weights are released
    (``runtime/tsp_params.py``); with data parallelism the parameters get their averaging
    hook; before a call the ranks check that they agree (``runtime/rank_check.py``: module
    states at the first call, input shapes at the first call and when they change)."""

    def __init__(
        self,
        fn: Callable,
        shard_inputs: list,
        layouts: dict,
        releasable: list[int],
        params: list[int],
        rank_check: RankCheck | None,
        group: TSPGroup,
        comm_timeout: float | None = None,
        gathers: list[tuple[int, str]] = (),
        runtime: RuntimeContext | None = None,
    ):
        self.fn = fn
        # what the passes handed to the runtime (the rings' chains): it lives as this graph does
        self.runtime = runtime if runtime is not None else RuntimeContext()
        self.gathers = list(gathers)  # released weights read whole: gathered at every call
        self.comm_timeout = comm_timeout  # this graph's own (options["comm_timeout"])
        self.releasable = set(releasable)
        self.params = params  # positions of the module parameters among the graph's inputs
        # (position of the full parameter, [its slices the graph reads, in input order])
        by_param: dict[int, list] = {}
        for s in shard_inputs:
            by_param.setdefault(s.param_index, []).append(s.spec)
        self.shard_inputs = list(by_param.items())
        # the graph's shard placeholders in their own order (one parameter's slices need not
        # be adjacent: a fused gate_up weight's two slices with its bias's between them)
        self.shard_order = [(s.param_index, s.spec) for s in shard_inputs]
        # every rank's slices of the weight at each position: Dynamo may run this graph for
        # another module (one block compiled for every layer), its weights declared here
        self.layouts = layouts
        self.rank_check = rank_check
        self.group = group
        # every weight input, for the first call's record (None after it: outside_graphs.py)
        self.received: list | None = [*params, *by_param, *(i for i, _ in self.gathers)]

    def __call__(self, *args):  # as Dynamo calls it: the graph's inputs, positional
        flat = list(args)
        g = self.group
        if self.rank_check is not None:  # before any transfer, and before weights are cut
            self.rank_check(flat)
        if self.received is not None:  # the first call: what it receives, and what it does not
            first_call(flat, self.received, g)
            self.received = None
        with tspc_internal():  # the inputs include the stand-ins of sharded weights
            views = {}
            for i, specs in self.shard_inputs:
                entry = STORE.get(flat[i])
                if entry is None:
                    entry = STORE.declare(flat[i], self.layouts[i], g.name, g.rank, g.size)
                earlier = tsp_param_of(flat[i]) if entry.dparam is None else None
                if earlier is not None and earlier.entry is None:  # read whole by a TSP graph
                    bind_to_replicated(entry, earlier)
                elif entry.dparam is None:  # the first call: cut this rank's slices
                    # kept whole: this graph reads it whole, or a plain (fallback) graph does
                    keep = i not in self.releasable or STORE.held_whole(flat[i])
                    create_sharded_dparam(flat[i], entry, keep_whole=keep)
                views.update(zip(((i, s) for s in specs), local_views(entry, specs)))
            shards = [views[key] for key in self.shard_order]
            tps = []
            if g.size > 1:
                for i in self.params:
                    tp = prepare(flat[i], g.name, g.size)
                    flat[i] = graph_input(tp)
                    tps.append(tp)
            if g.dp_size > 1:  # data_parallel="fsdp": its 2-D parameters average themselves
                dp_params = [tp.dparam for tp in tps] or [flat[i] for i in self.params]
                average_grads_over(whole_over_dp(dp_params), g.dp_name, g.dp_size)
            gather_inputs(flat, self.gathers)
            with comm.timeout_scope(self.comm_timeout):
                out = self.fn(*flat, *shards)
        if tps:
            adopt(tps)
            watch_optimizers(tps)  # optimizers built before this call hold the originals
        return plain_tangents(out)  # code after the graph may mix the output with DTensors


MAX_FAMILIES = 2
"""Programs for every length one symbolic graph may get (``dynamic_seq``): the second serves the
lengths beyond what the first's masks hold at (a sliding window narrower than them)."""


class _PerShapeCompiler:
    """Compiles a symbolic-shape graph once per concrete input shape, at first use.

    The passes bake the local sequence length into shapes (chunk boundaries, views, the zigzag
    reorder), so each new length is one compile of the passes and the inner compiler; Dynamo's
    symbolic graph itself is not traced again. Each compile is counted and logged with the
    inputs whose sizes changed (``tspc/compiles.py``)."""

    def __init__(
        self, gm: fx.GraphModule, group: TSPGroup, opts: TSPOptions, dynamo_id: str | None
    ):
        self.gm = gm
        self.group = group
        self.opts = opts
        self.dynamo_id = dynamo_id
        self.cache: dict[tuple, Callable] = {}
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        self.names = [n.name for n in placeholders]
        # 0-d inputs whose value ``specialize`` bakes in (Dynamo reads a module's float
        # attribute, a norm's eps, with ``.item()`` when shapes are dynamic): only their values
        # are part of the key; any other 0-d tensor (a temperature, a loss scale) may change
        # from call to call without a recompile.
        self.baked = {
            i
            for i, n in enumerate(placeholders)
            if any(u.op == "call_method" and u.target == "item" for u in n.users)
        }
        # dynamic_seq: the programs compiled for every length of a family (a second one for
        # lengths beyond the first's ``longest``), and whether an attempt failed (a graph that
        # is no family compiles per length from then on)
        self.families: list[LengthFamily] = []
        self.family_failed = False
        # what raised when tspc compiled a shape of this graph: every shape then runs a plain
        # compile (``tspc/fallback.py``), without trying the passes again
        self.fell_back: BaseException | None = None
        self.compiling: int | None = None  # the id of the graph being compiled

    def __call__(self, *args):
        key = compiles.shape_key(args, self.baked)
        fn = self.cache.get(key)
        if fn is None:
            why = compiles.shape_change(key, list(self.cache), self.names, self.baked)
            family = next((f for f in self.families if f.covers(args)), None)
            if family is not None:
                fn = family.fn
                compiles.log.info(
                    "tspc: no compile for the %s: the program compiled for every length "
                    "(graph %d) runs it",
                    why[1].split(";")[0],
                    family.graph_id,
                )
                compiles.count_family_run()
                self.cache[key] = fn
                return fn(*args)
            with tspc_internal():
                self.compiling = None
                try:
                    if self.fell_back is not None:  # an earlier shape's compile raised
                        raise self.fell_back
                    fn = self._compile_shape(args, why)
                except Exception as e:
                    graph_id = self.compiling if self.compiling is not None else next(_GRAPH_IDS)
                    _drop_compiled(graph_id)
                    first = self.fell_back is None
                    self.fell_back = e
                    fn = fall_back(
                        e,
                        self.gm,
                        list(args),
                        self.group,
                        self.opts,
                        graph_id,
                        why,
                        self.dynamo_id,
                        warn=first,
                    )
            self.cache[key] = fn
        return fn(*args)

    def _compile_shape(self, args: tuple, why: tuple[str, str]) -> Callable:
        shape = GraphContext(self.gm.graph, self.opts, self.gm, list(args))
        run_passes(SPECIALIZE, shape, None, "symbolic graph")
        static = shape.gm
        # the length Dynamo first traced with static shapes (before it saw a second
        # one) comes back here: its compile is reused, not repeated
        reused = compiles.reuse_for(
            compiles.graph_signature(static, list(args)),
            self.names,
            _reuse_key(self.group, self.opts, self.dynamo_id),
        )
        if reused is not None:
            fn, reused_id = reused
            compiles.log.info(
                "tspc: no compile for the %s: the graph compiled for Dynamo's static "
                "trace of the same shapes (graph %d) runs it",
                why[1].split(";")[0],
                reused_id,
            )
            return fn
        probe = self._probe(static, list(args))
        self.compiling = graph_id = next(_GRAPH_IDS)
        fn = _compile_static(
            static, list(args), self.group, self.opts, why, self.dynamo_id, graph_id, probe
        )
        if probe is not None and probe.failed is not None:
            self.family_failed = True
        elif probe is not None:
            # the probe's own graph and arguments are not kept: only what ``covers`` reads
            self.families.append(
                LengthFamily(
                    fn,
                    last_graph_id(),
                    probe.seq,
                    probe.chunks,
                    family_key(args, self.baked, probe.seq),
                    self.baked,
                    probe.shape_env,
                    probe.symbol,
                    probe.lengths,
                    probe.longest,
                )
            )
        return fn

    def _probe(self, static: fx.GraphModule, args: list[Any]) -> LengthProbe | None:
        """An attempt at one program for every length (``dynamic_seq``), or None. Made at the
        graph's first length that splits into 2D chunks, and once more for a length beyond the
        first program's ``longest``; never again after an attempt failed."""
        if not self.opts.dynamic_seq or self.family_failed or len(self.families) >= MAX_FAMILIES:
            return None
        try:
            seq = sequence_input(self.gm, args, find_sequence_length(static))
        except LengthNotGeneralizable as e:
            self.family_failed = True
            compiles.log.info("tspc: dynamic_seq: compiled for this length only: %s", e)
            return None
        chunks = 2 * self.group.size
        if args[seq.index] % chunks:
            compiles.log.info(
                "tspc: dynamic_seq: length %d is padded to a multiple of 2D = %d: compiled for "
                "this length only (the program for every length is made at the first length "
                "that is a multiple)",
                args[seq.index],
                chunks,
            )
            return None
        return LengthProbe(self.gm, args, seq, chunks, run_pipeline)


def tsp_backend(
    gm: fx.GraphModule, example_inputs: list[Any], *, options: dict | None = None
) -> Callable:
    """Compile one Dynamo graph with Tensor-and-Sequence Parallel schedules."""
    with tspc_internal():
        compiled = _tsp_backend(gm, example_inputs, options)
    from .generate import route_from_backend  # generate() of the model being compiled

    route_from_backend(options)
    return compiled


def _tsp_backend(gm, example_inputs, options):
    opts = TSPOptions.from_dict(options)
    group = resolve_group(opts.group, opts.mesh_dim, opts.data_parallel)
    dynamo_id = compiles.dynamo_compile_id()
    why = (compiles.NEW_GRAPH, "a graph Dynamo traced with static shapes")
    if over_own_parameters(example_inputs):  # an optimizer step over tspc's DTensors
        return compile_over_own_parameters(gm, example_inputs, group, opts.inner, next(_GRAPH_IDS))
    refuse_presharded(list(example_inputs), gm)
    graph_id = None
    try:
        info = analyse(gm, example_inputs)
        if info.has_symbolic_inputs:
            log.info("tspc: symbolic shapes: compiling per concrete shape at first use")
            return _PerShapeCompiler(gm, group, opts, dynamo_id)
        graph_id = next(_GRAPH_IDS)
        fn = _compile_static(gm, list(example_inputs), group, opts, why, dynamo_id, graph_id)
    except Exception as e:  # before a weight was released: the plain compile stands in,
        # or the error that says why none can (symbolic sizes and all)
        if graph_id is None:
            graph_id = next(_GRAPH_IDS)
            why = (compiles.NEW_GRAPH, "a graph Dynamo traced")
        _drop_compiled(graph_id)
        return fall_back(e, gm, list(example_inputs), group, opts, graph_id, why, dynamo_id)
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    signature = compiles.graph_signature(gm, list(example_inputs))
    compiles.remember_static(
        signature, _reuse_key(group, opts, dynamo_id), fn, names, last_graph_id()
    )
    return fn


def _drop_compiled(graph_id: int) -> None:
    """Forget what a compile that raised kept (the fallback reports it, tspc/fallback.py)."""
    COMPILED[:] = [c for c in COMPILED if c.report.graph_id != graph_id]


def _reuse_key(group: TSPGroup, opts: TSPOptions, dynamo_id: str | None) -> tuple:
    """What besides the graph a compile depends on: the TSP group and the options; and the
    Dynamo frame it was traced from ("3/0" -> "3"): a compile is reused only for a recompile of
    the same frame (its symbolic trace), never for another model that happens to trace the same
    graph (its report would be missing)."""
    frame = dynamo_id.split("/")[0] if dynamo_id else None
    return (group.name, group.size, group.rank, group.dp_name, group.dp_size, opts, frame)
