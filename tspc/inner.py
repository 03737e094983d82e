"""The inner compiler: what runs the rewritten graph's local compute.

* ``aot_eager`` — aot_autograd traces the rewritten graph (custom ops and the ring's
  autograd.Function included) into forward and backward graphs of aten ops and runs them
  eagerly. The partitioner is told to *recompute* the weight broadcasts and the K/V all-gathers
  in backward rather than save their results, so neither a layer's full weights nor the full
  K/V are kept alive between forward and backward (``tsp_partition``).
* ``inductor`` — the same, with Inductor compiling the local compute of both graphs; the
  collectives stay where the schedule placed them: each start an Inductor collective kernel
  (``runtime/comm.py``'s ``lowered_for_inductor``), each wait torch's ``wait_tensor``. Left alone, Inductor
  would undo the schedule: it fuses elementwise kernels of different head groups that read the
  same tables (RoPE's cos/sin), which drags group r+1's projections — and the wait for its
  weights — in front of group r's attention, and it reorders nodes for memory and locality.
  So our graphs are compiled with no fusion across a collective (``_FenceChoices``), without
  those two reorderings, and with a GEMM that its ``mm + add -> addmm`` pattern moved past a
  wait put back before it (``passes/aot_graphs.split_addmm_across_waits``); within the compute between two
  collectives Inductor fuses freely.
  Inductor's FX graph cache serves these graphs too: its key holds the scheduled graph, and
  the choices handler and the post-grad pass each name tspc's sources in it (``tspc_source_hash``),
  so a warm hit returns the code a cold compile of the same sources would generate.
  AOTAutograd's cache is left off: ``aot_module_simplified`` looks it up only for a forward
  compiler that is a ``SerializableAOTDispatchCompiler`` returning Inductor's bare output, and
  its key does not hold tspc's partitioner and joint-graph passes (``compile_inner``).
* ``eager`` — the rewritten graph as a Python function; autograd records it op by op (debugging;
  backward then keeps the broadcast weights alive).

Both aot variants run the phases of ``tspc/pipeline.py`` that follow ``PIPELINE``:
``JOINT_PIPELINE`` on the joint graph before the partitioner (``tsp_partition``),
``AOT_GRAPH_PIPELINE`` (the overlap scheduler) on the forward and the backward graph, and,
with Inductor, ``POST_GRAD_PIPELINE`` as its post-grad custom pass. The passes themselves are
in ``passes/aot_graphs.py`` and ``passes/schedule.py``.
"""

from __future__ import annotations

import functools
import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.fx as fx

from tspc.passes.tag_origin import tags_in_error, torch_words
from tspc.runtime import comm
from tspc.runtime.comm import is_transfer
from tspc.runtime.compat import (
    autograd_cache_off,
    donate_no_saved_buffers,
    eager_backward_compile,
    is_inductor_codegen_error,
    partitioner_without_cse,
)

from .errors import REPORT_HINT, InductorFallbackWarning, PartitionerTagError
from .options import TSPOptions
from .pipeline import (
    AOT_GRAPH_PIPELINE,
    JOINT_PIPELINE,
    POST_GRAD_PIPELINE,
    GraphContext,
    run_passes,
)

compile_log = logging.getLogger("tspc.compiles")


def tsp_partition(
    joint_module: fx.GraphModule,
    joint_inputs,
    *,
    opts: TSPOptions | None = None,
    graphs: AotGraphs | None = None,
    **kwargs,
):
    """The min-cut partitioner after ``JOINT_PIPELINE`` (``tspc/pipeline.py``) on the joint
    graph; its snapshots go to ``graphs`` for a dump."""
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    ctx = GraphContext(joint_module.graph, opts, joint_module)
    dump = graphs is not None and opts is not None and bool(opts.dump_dir)
    snapshots = [("traced", ctx.code())] if dump else None
    run_passes(JOINT_PIPELINE, ctx, snapshots, "joint graph")
    if dump:
        graphs.snapshots.append(("joint", snapshots))
    try:
        if not ctx.partitioner_cse:
            with partitioner_without_cse():
                return min_cut_rematerialization_partition(joint_module, joint_inputs, **kwargs)
        return min_cut_rematerialization_partition(joint_module, joint_inputs, **kwargs)
    except Exception as e:
        tagged = tags_in_error(joint_module.graph, str(e))
        if not tagged:
            raise
        raise partitioner_tag_error(tagged, str(e)) from e


def partitioner_tag_error(tagged: list, message: str) -> PartitionerTagError:
    """tspc's error for a partitioner failure on a value tspc tagged (``passes/tag_origin.py``):
    the node, the tag, the pass that set it and the option that avoids it, then torch's own
    account of the conflict without its pointer to PyTorch's tracker."""
    first = tagged[0]
    lines = [
        f"  '{t.node}': tagged {t.tag} by tspc's pass {t.tagged_by}; avoided by {t.option}"
        for t in tagged
    ]
    return PartitionerTagError(
        f"tspc: aot_autograd's partitioner could not honour the tag tspc's pass "
        f"{first.tagged_by.split(' ')[0]} put on '{first.node}' (a bug in tspc, not in "
        "PyTorch); the tagged nodes it names:\n"
        + "\n".join(lines)
        + f"\nPlease report it: {REPORT_HINT}. The partitioner said:\n"
        + torch_words(message)
    )


_is_collective = is_transfer


class _Segments:
    """Which stretch of compute between two collectives each FX node belongs to.

    Inductor's origins of a kernel are nodes of the graph it lowers (after its post-grad
    passes, so the numbering is taken lazily from that graph, once per graph)."""

    def __init__(self) -> None:
        self._by_graph: dict[int, tuple[fx.Graph, dict[fx.Node, int]]] = {}

    def of(self, node: fx.Node) -> int | None:
        g = node.graph
        entry = self._by_graph.get(id(g))
        if entry is None or entry[0] is not g:
            seg, index = 0, {}
            for n in g.nodes:
                if _is_collective(n):
                    seg += 1
                index[n] = seg
            entry = self._by_graph[id(g)] = (g, index)
        return entry[1].get(node)


@functools.cache
def tspc_source_hash() -> bytes:
    """A hash of every Python source of tspc, ``tspc.passes`` and ``tspc.runtime``: the part of
    Inductor's FX graph cache key that stands for what tspc does to a graph Inductor compiles
    (the fence choices handler, the post-grad pass, the lowering of tspc's collective starts,
    their fake kernels). Hashing all of it, not a list of modules, keeps an entry from
    outliving a change in some module that list would have missed; the price is a cold
    compile after any edit to tspc."""
    from torch._inductor.custom_graph_pass import get_hash_for_files

    import tspc
    import tspc.passes
    import tspc.runtime

    roots = [Path(p) for pkg in (tspc, tspc.passes, tspc.runtime) for p in pkg.__path__]
    # ordered by the path inside each package, so that where tspc is installed does not matter
    files = sorted(
        (
            (i, path.relative_to(root).as_posix(), str(path))
            for i, root in enumerate(roots)
            for path in root.rglob("*.py")
        ),
    )
    return get_hash_for_files(tuple(f for _, _, f in files))


def _fence_choices():
    """Inductor heuristics that never fuse kernels of different stretches of compute: a fused
    kernel runs where its last input is ready, so fusing across a collective would move compute
    over a wait (or a start after compute it was meant to overlap).

    A factory (Inductor's ``inductor_choices_class`` config takes one): the config's entry in the
    FX graph cache key is the handler's ``uuid()``."""
    from torch._inductor.choices import InductorChoices

    segments = _Segments()

    def span(node) -> set[int]:
        out: set[int] = set()
        for sub in node.get_nodes():
            ir_node = getattr(sub, "node", None)
            for origin in ir_node.get_origins() if ir_node is not None else ():
                seg = segments.of(origin)
                if seg is not None:
                    out.add(seg)
        return out

    class _FenceChoices(InductorChoices):
        @staticmethod
        def can_fuse(scheduler, node1, node2, shared_data_score) -> bool:
            both = span(node1) | span(node2)
            if len(both) > 1:
                return False
            return InductorChoices.can_fuse(scheduler, node1, node2, shared_data_score)

        def uuid(self) -> bytes:  # part of Inductor's FX graph cache key
            return tspc_source_hash()

    return _FenceChoices()


def _split_addmm_pass():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class _SplitAddmmAcrossWaits(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            run_passes(POST_GRAD_PIPELINE, GraphContext(graph), None, "Inductor post-grad graph")

        def uuid(self) -> bytes:  # part of Inductor's FX graph cache key
            return tspc_source_hash()

    return _SplitAddmmAcrossWaits()


def compile_with_inductor(g: fx.GraphModule, ex, is_backward: bool) -> Callable:
    """``compile_fx_inner`` keeping the collectives' schedule (module docstring)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.virtualized import V

    # No layout optimisation: with a convolution in the graph Inductor may store a saved
    # activation channels-last in the forward, which the backward (compiled here, with the
    # forward: ``eager_backward_compile``) then reads as contiguous — a graph traced with a
    # symbolic length crashed so (a causal conv1d over the tokens, Mamba-style).
    if not any(_is_collective(n) for n in g.graph.nodes):
        with inductor_config.patch(layout_optimization=False):
            return compile_fx_inner(g, ex, is_backward=is_backward)  # nothing to keep in place
    with (
        comm.lowered_for_inductor(),  # the starts as Inductor collective kernels (runtime/comm.py)
        inductor_config.patch(
            layout_optimization=False,
            reorder_for_peak_memory=False,
            reorder_for_locality=False,
            post_grad_custom_post_pass=_split_addmm_pass(),
            # Only for the cache key: Inductor takes its handler from this config at its
            # first use in a thread and keeps it, so the handler is also set below.
            inductor_choices_class=_fence_choices,
        ),
        V.set_choices_handler(_fence_choices()),
    ):
        return compile_fx_inner(g, ex, is_backward=is_backward)


@dataclass
class AotGraphs:
    """The forward / backward graphs aot_autograd produced, after scheduling (for dumps)."""

    forward: list[str] = field(default_factory=list)
    backward: list[str] = field(default_factory=list)
    forward_gms: list[fx.GraphModule] = field(default_factory=list)
    backward_gms: list[fx.GraphModule] = field(default_factory=list)
    # inner="inductor": the Python code Inductor generated for each graph (for dumps and tests)
    forward_inductor_code: list[str] = field(default_factory=list)
    backward_inductor_code: list[str] = field(default_factory=list)
    # Dump hook (tspc/dump.py): wraps the compiled backward at its first call, so the dump can
    # add what it communicated.
    on_backward_compiled: Callable[[Callable], Callable] | None = None
    # seconds spent in the inner compiler per graph ("forward", "backward"), added to the
    # compile record of this graph (``tspc/compiles.py``); shared with the report
    compile_seconds: dict[str, float] = field(default_factory=dict)
    # "forward: InductorError: ..." for each graph Inductor failed on (run unfused instead)
    inductor_failures: list[str] = field(default_factory=list)
    # with a dump: (graph label, [(pass name, code)]) for the joint graph and each forward and
    # backward graph, the code before the first pass of its phase and after each pass
    snapshots: list[tuple[str, list[tuple[str, str]]]] = field(default_factory=list)


def _with_timeout(fn: Callable, seconds: float) -> Callable:
    """``fn`` (a boxed compiled graph) with its collectives waited under this graph's
    ``comm_timeout``: the backward runs from autograd, outside the forward's scope."""

    def run(args):
        with comm.timeout_scope(seconds):
            return fn(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


def compile_plain(gm: fx.GraphModule, example_inputs: list[Any], inner: str) -> Callable:
    """Dynamo's graph compiled by the inner compiler alone, no tspc pass: what
    ``torch.compile(model, backend=inner)`` would run (``tspc/fallback.py``)."""
    if inner == "eager":
        return gm.forward
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend(inner)(gm, example_inputs)


class _LateBackwardHook:
    """The compiled backward, wrapped at its first call by ``graphs.on_backward_compiled``
    (a dump's hook) when one was set after the backward was compiled: tspc compiles the
    backward with the forward (``compile_inner``), before the backend sets the hook."""

    _boxed_call = True

    def __init__(self, fn: Callable, graphs: AotGraphs):
        self.fn = fn
        self.graphs = graphs
        self.hooked = False

    def __call__(self, args):
        if not self.hooked:
            self.hooked = True
            if self.graphs.on_backward_compiled is not None:
                self.fn = self.graphs.on_backward_compiled(self.fn)
        return self.fn(args)


def _inductor_or_none(g: fx.GraphModule, ex, kind: str, graphs: AotGraphs) -> Callable | None:
    """Inductor's code for one aot graph, or None where Inductor itself failed to generate it
    (``InductorError``: a lowering or codegen bug in torch, not in a pass of ours): that graph's
    local compute then runs as aot_eager runs it - the same schedule, collectives in the same
    order, only the elementwise kernels unfused - rather than the whole model losing TSP to a
    plain compile. The warning and the report (``AotGraphs.inductor_failures``) say so."""
    try:
        return compile_with_inductor(g, ex, is_backward=kind == "backward")
    except Exception as e:
        if not is_inductor_codegen_error(e):
            raise
        what = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
        graphs.inductor_failures.append(f"{kind}: {what}")
        warnings.warn(
            f"tspc: Inductor failed to compile the rewritten {kind} graph ({what}); it runs with "
            "the TSP schedules unchanged, its local compute as aot_eager runs it (unfused). "
            f"The numbers are unchanged; {REPORT_HINT}.",
            InductorFallbackWarning,
            stacklevel=2,
        )
        compile_log.info("tspc: Inductor failed on the %s graph", kind, exc_info=e)
        return None


def compile_inner(
    gm: fx.GraphModule, example_inputs: list[Any], opts: TSPOptions, graphs: AotGraphs
) -> Callable:
    if opts.inner == "eager":
        return gm.forward

    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified

    def make(kind: str):
        def compiler(g: fx.GraphModule, ex):
            t0 = time.perf_counter()
            fn = compile_one(g, ex)
            graphs.compile_seconds[kind] = time.perf_counter() - t0
            if kind == "backward":
                compile_log.info(
                    "tspc: backward of the latest graph compiled in %.2f s (%s)",
                    graphs.compile_seconds[kind],
                    opts.inner,
                )
            return fn

        def compile_one(g: fx.GraphModule, ex):
            if kind == "backward":  # retain_graph=True, as plain torch.compile allows it
                donate_no_saved_buffers()
            gms = graphs.forward_gms if kind == "forward" else graphs.backward_gms
            ctx = GraphContext(g.graph, opts, g, list(ex))
            snapshots = [("partitioned", ctx.code())] if opts.dump_dir else None
            run_passes(AOT_GRAPH_PIPELINE, ctx, snapshots, f"{kind} graph")
            if snapshots is not None:
                graphs.snapshots.append((kind if not gms else f"{kind}_{len(gms)}", snapshots))
            (graphs.forward if kind == "forward" else graphs.backward).append(g.code)
            gms.append(g)
            fn = None
            if opts.inner == "inductor":
                fn = _inductor_or_none(g, ex, kind, graphs)
                code = getattr(fn, "source_code", None)
                if code is not None:
                    if kind == "forward":
                        graphs.forward_inductor_code.append(code)
                    else:
                        graphs.backward_inductor_code.append(code)
            if fn is None:
                fn = make_boxed_func(g.forward)
            if kind == "backward":
                fn = _LateBackwardHook(fn, graphs)  # dump hook, see AotGraphs
            if kind == "backward" and opts.comm_timeout is not None:
                fn = _with_timeout(fn, float(opts.comm_timeout))
            return fn

        return compiler

    decomps = None
    partition = functools.partial(tsp_partition, opts=opts, graphs=graphs)
    if opts.inner == "inductor":
        from torch._inductor.decomposition import select_decomp_table

        decomps = select_decomp_table()
    else:
        # aot_eager's min-cut should not try Inductor-specific fusion heuristics.
        partition = functools.partial(partition, compiler="aot_eager")
    # AOTAutograd's cache stays off, even where a user forces it (``force_autograd_cache``):
    # its key does not hold ``partition_fn`` (tspc's joint-graph passes and partitioner), and an
    # entry would hold Inductor's bare output without the wrappers ``make`` adds. Left alone it
    # would not be used either: ``aot_module_simplified`` looks it up only for a forward compiler
    # that is a ``SerializableAOTDispatchCompiler``, which ours is not, and forced, its
    # ``check_cacheable`` bypasses tspc's rewritten graph, whose nodes call plain functions
    # (``runtime/packing.pack``, the ring's ``autograd.Function``), not only ops.
    # The backward is compiled now, with the forward, not at the first backward
    # (``force_non_lazy_backward_lowering``): a failure in it (its passes, Inductor) then shows
    # while the full weights still exist and the backend can fall back to a plain compile
    # (``tspc/fallback.py``); at the first backward they are already released.
    # fx's dead-code elimination keeps the collectives while aot_autograd and Inductor compile
    # (``comm.collectives_kept``; only for this compile, not for other graphs of the process).
    with autograd_cache_off(), eager_backward_compile(), comm.collectives_kept():
        return aot_module_simplified(
            gm,
            example_inputs,
            fw_compiler=make("forward"),
            bw_compiler=make("backward"),
            partition_fn=partition,
            decompositions=decomps,
            keep_inference_input_mutations=True,
        )
