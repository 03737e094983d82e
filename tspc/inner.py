"""The inner compiler: what runs the rewritten graph's local compute.

* ``aot_eager`` — aot_autograd traces the rewritten graph (custom ops and the ring's
  autograd.Function included) into forward and backward graphs of aten ops and runs them
  eagerly. The partitioner is told to *recompute* the weight broadcasts and the K/V all-gathers
  in backward rather than save their results, so neither a layer's full weights nor the full
  K/V are kept alive between forward and backward (``tsp_partition``).
* ``inductor`` — the same, with Inductor compiling the local compute of both graphs; the
  collectives stay explicit extern calls where the schedule placed them. Left alone, Inductor
  would undo the schedule: it fuses elementwise kernels of different head groups that read the
  same tables (RoPE's cos/sin), which drags group r+1's projections — and the wait for its
  weights — in front of group r's attention, and it reorders nodes for memory and locality.
  So our graphs are compiled with no fusion across a collective (``_FenceChoices``), without
  those two reorderings, and with a GEMM that its ``mm + add -> addmm`` pattern moved past a
  wait put back before it (``split_addmm_across_waits``); within the compute between two
  collectives Inductor fuses freely.
* ``eager`` — the rewritten graph as a Python function; autograd records it op by op (debugging;
  backward then keeps the broadcast weights alive).

Both aot variants run the overlap scheduler on the forward and the backward graph.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from tspc.passes.schedule import is_view_or_pack, schedule_overlap
from tspc.runtime import comm
from tspc.runtime.comm import is_transfer, is_transfer_wait
from tspc.runtime.compat import joint_graph_cse, partitioner_without_cse

from .options import TSPOptions

compile_log = logging.getLogger("tspc.compiles")

_RECOMPUTE_STARTS = (
    torch.ops.tspc.broadcast_start.default,
    torch.ops.tspc.all_gather_start.default,
    torch.ops.tspc.ring_start.default,
    torch.ops.tspc.ring_chunk_start.default,
)
_RECOMPUTE_WAITS = (
    torch.ops.tspc.broadcast_wait.default,
    torch.ops.tspc.all_gather_wait.default,
    torch.ops.tspc.ring_wait.default,
    torch.ops.tspc.ring_chunk_wait.default,
)


def _mark(n: fx.Node) -> None:
    n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    n.meta.setdefault("ac_graph_id", 0)


def mark_transfers_for_recompute(graph: fx.Graph) -> int:
    """Tag weight transfers and K/V gathers (and the views/packs around them) MUST_RECOMPUTE.

    Without this the min-cut partitioner would save what they produce for the backward — every
    head group's weights and gathered K/V, the whole layer — or, for transfers that the backward
    issues but that do not depend on a gradient (the MLP ring's backward weight hops), would
    hoist them into the forward and save their results. Recomputing keeps both in the backward.
    """
    marked = 0
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        if n.target in _RECOMPUTE_STARTS:
            _mark(n)
            marked += 1
            # the packed weights the broadcast sends: a cheap cat of local shards
            src = n.args[0]
            if isinstance(src, fx.Node) and is_view_or_pack(src):
                _mark(src)
                for i in src.all_input_nodes:
                    if is_view_or_pack(i):
                        _mark(i)
        elif n.target in _RECOMPUTE_WAITS:
            _mark(n)
            stack = list(n.users)
            while stack:
                u = stack.pop()
                if is_view_or_pack(u) and "recompute" not in u.meta:
                    _mark(u)
                    stack.extend(u.users)
    return marked


def keep_backward_transfers_in_backward(graph: fx.Graph) -> int:
    """Pin collectives traced in backward to the backward graph.

    The partitioner may move a backward node that does not depend on a gradient into the
    forward and save its result — for the MLP ring's backward weight hops that would mean
    fetching every shard in the forward and keeping them all. ``must_be_in_backward`` forbids it.
    """
    pinned = 0
    for n in graph.nodes:
        if (
            n.op == "call_function"
            and getattr(n.target, "namespace", None) == "tspc"
            and n.meta.get("partitioner_tag") == "is_backward"
        ):
            n.meta["partitioner_tag"] = "must_be_in_backward"
            pinned += 1
    return pinned


_SPLIT_STARTS = (torch.ops.tspc.broadcast_start.default, torch.ops.tspc.all_gather_start.default)


def _in_backward(n: fx.Node) -> bool:
    return n.meta.get("partitioner_tag") in ("is_backward", "must_be_in_backward")


def split_recomputed_transfers(graph: fx.Graph) -> int:
    """Give the backward its own copy of each recomputed weight broadcast and K/V gather whose
    result both a recomputed forward node and a backward node read.

    Under block recomputation (``options={"recompute": ...}``) the backward replays a block's
    forward — which needs head group r's weights and gathered K/V — and then runs the block's
    backward, which needs them again. As one node the transfer would be recomputed once and its
    result kept from the replayed forward to the backward of group r: every head group's
    weights and full-sequence K/V alive at once (a whole layer's, 8x the one group the schedule
    keeps at D = 8). With a copy for the backward users, the replay's transfer dies after the
    replayed group and the backward fetches the group again just before it needs it (one more
    broadcast and K/V gather per group in the backward: the paper's "weights re-streamed, K/V
    re-gathered"). The pack a broadcast sends is copied with it. Every rank builds the same
    graph, so every rank issues the copies in the same order. Returns the number of transfers
    copied.
    """
    order = {n: i for i, n in enumerate(graph.nodes)}
    copied = 0
    for start in [n for n in graph.nodes if n.op == "call_function" and n.target in _SPLIT_STARTS]:
        if _in_backward(start) or start.meta.get("recompute") != CheckpointPolicy.MUST_RECOMPUTE:
            continue
        chain, seen, stack = [start], {start}, list(start.users)
        while stack:  # the wait and the free views/packs after it (what moves with a transfer)
            u = stack.pop()
            if u in seen or _in_backward(u) or u.op != "call_function":
                continue
            if u.target in _RECOMPUTE_WAITS or (
                is_view_or_pack(u) and u.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE
            ):
                seen.add(u)
                chain.append(u)
                stack.extend(u.users)
        readers = [u for c in chain for u in c.users if u not in seen]
        backward = [u for u in readers if _in_backward(u)]
        if not backward or len(backward) == len(readers):
            continue
        # The packed weights a broadcast sends (a cat of views of the shards): copied too, or
        # the one pack would be kept from the replay's start to the backward's.
        stack = [a for a in start.all_input_nodes]
        while stack:
            a = stack.pop()
            if (
                a not in seen
                and a.op == "call_function"
                and not _in_backward(a)
                and is_view_or_pack(a)
                and a.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE
            ):
                seen.add(a)
                chain.append(a)
                stack.extend(a.all_input_nodes)
        chain.sort(key=order.__getitem__)
        env: dict[fx.Node, fx.Node] = {}
        with graph.inserting_before(min(backward, key=order.__getitem__)):
            for c in chain:
                env[c] = graph.node_copy(c, lambda a, env=env: env.get(a, a))
                # a backward node: the forward graph must not run it (its users are backward)
                env[c].meta["partitioner_tag"] = "must_be_in_backward"
        for u in dict.fromkeys(backward):
            u.args = fx.node.map_arg(u.args, lambda a, env=env: env.get(a, a))
            u.kwargs = fx.node.map_arg(u.kwargs, lambda a, env=env: env.get(a, a))
        copied += 1
    return copied


def tsp_partition(joint_module: fx.GraphModule, joint_inputs, **kwargs):
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    keep_backward_transfers_in_backward(joint_module.graph)
    mark_transfers_for_recompute(joint_module.graph)
    if any(n.meta.get("ac_graph_id", 0) > 0 for n in joint_module.graph.nodes):
        # Recomputed regions: the backward fetches its own weights and K/V. The partitioner's
        # CSE would merge those copies back, so it runs here, before they are made.
        joint_module.graph.eliminate_dead_code()
        joint_module.graph = joint_graph_cse(joint_module.graph)
        if split_recomputed_transfers(joint_module.graph):
            joint_module.recompile()
            with partitioner_without_cse():
                return min_cut_rematerialization_partition(joint_module, joint_inputs, **kwargs)
    return min_cut_rematerialization_partition(joint_module, joint_inputs, **kwargs)


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


def _fence_choices():
    """Inductor heuristics that never fuse kernels of different stretches of compute: a fused
    kernel runs where its last input is ready, so fusing across a collective would move compute
    over a wait (or a start after compute it was meant to overlap)."""
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

    return _FenceChoices()


def split_addmm_across_waits(graph: fx.Graph) -> int:
    """Undo Inductor's ``mm`` + ``add`` -> ``addmm`` fusion where a wait lies between them.

    The schedule overlaps a GEMM with a transfer by placing it before the transfer's wait; when
    its result is accumulated only after the wait (the MLP ring's backward adds a weight
    gradient GEMM to the next step's), Inductor's post-grad pattern fuses the two into one
    ``addmm`` at the add's place, after the wait, and the GEMM no longer overlaps anything. Here
    such an ``addmm`` becomes the GEMM again, just before the latest wait after its operands
    are ready, and the add where it was. Returns the number split."""
    aten = torch.ops.aten
    order = {n: i for i, n in enumerate(graph.nodes)}
    waits = [n for n in graph.nodes if is_transfer_wait(n)]
    split = 0
    for n in list(graph.nodes):
        if n.op != "call_function" or n.target is not aten.addmm.default or n.kwargs:
            continue
        inp, mat1, mat2 = n.args[:3]
        ready = max(
            (x for x in (mat1, mat2) if isinstance(x, fx.Node)),
            key=order.__getitem__,
            default=None,
        )
        if ready is None:
            continue
        between = [w for w in waits if order[ready] < order[w] < order[n]]
        if not between:
            continue
        with graph.inserting_before(between[-1]):
            gemm = graph.call_function(aten.mm.default, (mat1, mat2))
        gemm.meta.update({k: v for k, v in n.meta.items() if k != "val"})
        if "val" in n.meta:
            gemm.meta["val"] = torch.empty_like(n.meta["val"])  # addmm's shape, dtype, device
        with graph.inserting_before(n):
            add = graph.call_function(aten.add.Tensor, (inp, gemm))
        add.meta.update(n.meta)
        n.replace_all_uses_with(add)
        graph.erase_node(n)
        split += 1
    return split


def _split_addmm_pass():
    from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

    class _SplitAddmmAcrossWaits(CustomGraphPass):
        def __call__(self, graph: fx.Graph) -> None:
            split_addmm_across_waits(graph)

        def uuid(self):  # part of Inductor's FX graph cache key
            return get_hash_for_files((__file__,))

    return _SplitAddmmAcrossWaits()


def compile_with_inductor(g: fx.GraphModule, ex, is_backward: bool) -> Callable:
    """``compile_fx_inner`` keeping the collectives' schedule (module docstring)."""
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.virtualized import V

    if not any(_is_collective(n) for n in g.graph.nodes):
        return compile_fx_inner(g, ex, is_backward=is_backward)  # nothing to keep in place
    with (
        inductor_config.patch(
            reorder_for_peak_memory=False,
            reorder_for_locality=False,
            post_grad_custom_post_pass=_split_addmm_pass(),
            # A graph with transfers is compiled afresh: with a warm FX graph cache, the code
            # of one of test_inner_inductor's D = 2 graphs failed the overlap FileCheck that
            # the same graph's cold compile passes (not diagnosed; the choices handler above
            # is not part of the cache key). Graphs without transfers (D = 1) use the cache.
            fx_graph_cache=False,
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
    # Dump hook (tspc/dump.py): wraps the backward once aot_autograd compiles it, lazily at the
    # first backward call, so the dump can add the backward graph and what it communicated.
    on_backward_compiled: Callable[[Callable], Callable] | None = None
    # seconds spent in the inner compiler per graph ("forward", "backward"), added to the
    # compile record of this graph (``tspc/compiles.py``); shared with the report
    compile_seconds: dict[str, float] = field(default_factory=dict)


def _with_timeout(fn: Callable, seconds: float) -> Callable:
    """``fn`` (a boxed compiled graph) with its collectives waited under this graph's
    ``comm_timeout``: the backward runs from autograd, outside the forward's scope."""

    def run(args):
        with comm.timeout_scope(seconds):
            return fn(args)

    run._boxed_call = True  # type: ignore[attr-defined]
    return run


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
            if opts.overlap:
                schedule_overlap(g)
            (graphs.forward if kind == "forward" else graphs.backward).append(g.code)
            (graphs.forward_gms if kind == "forward" else graphs.backward_gms).append(g)
            if opts.inner == "inductor":
                fn = compile_with_inductor(g, ex, is_backward=kind == "backward")
                code = getattr(fn, "source_code", None)
                if code is not None:
                    if kind == "forward":
                        graphs.forward_inductor_code.append(code)
                    else:
                        graphs.backward_inductor_code.append(code)
            else:
                fn = make_boxed_func(g.forward)
            if kind == "backward" and graphs.on_backward_compiled is not None:
                fn = graphs.on_backward_compiled(fn)  # dump hook, see AotGraphs
            if kind == "backward" and opts.comm_timeout is not None:
                fn = _with_timeout(fn, float(opts.comm_timeout))
            return fn

        return compiler

    decomps = None
    partition = tsp_partition
    if opts.inner == "inductor":
        from torch._inductor.decomposition import select_decomp_table

        decomps = select_decomp_table()
    else:
        partition = _aot_eager_partition
    return aot_module_simplified(
        gm,
        example_inputs,
        fw_compiler=make("forward"),
        bw_compiler=make("backward"),
        partition_fn=partition,
        decompositions=decomps,
        keep_inference_input_mutations=True,
    )


def _aot_eager_partition(joint_module, joint_inputs, **kwargs):
    # aot_eager's min-cut should not try Inductor-specific fusion heuristics.
    kwargs.setdefault("compiler", "aot_eager")
    return tsp_partition(joint_module, joint_inputs, **kwargs)
