"""The pass pipeline: a list of passes, run in order by one loop, a snapshot after each.

``PIPELINE`` below is the whole order (one ``Pass`` per step, its function right under it). Every
pass has the same signature, ``step(ctx: PassContext) -> None``: the graph and what passes hand
to each other (the matches, the sequence length, the weight shards the rewrites ask for) live
in the context, and each step calls the pass module's plain function over the graph
(``tspc/passes/*.py``, testable without a process group). A ``Pass`` may be skipped at some
levels (``applies``).

``run_pipeline`` runs it on a copy of Dynamo's graph at one *level*: "tsp" (everything), "sp"
(sequence sharding only: replicated weights, K/V all-gathered), or "replicated" (no pass
changes the graph; every rank computes everything). The backend falls back from a level to the
next when a pass fails, unless the user asked for ``strict``.

``PHASES`` at the end is every step a compile takes, in order, as five lists of passes: the
per-shape ``SPECIALIZE`` (graphs traced with symbolic sizes, ``tspc/backend.py``), ``PIPELINE``,
and the inner compiler's (``tspc/inner.py``) ``JOINT_PIPELINE`` (aot_autograd's joint graph:
the partitioner's tags), ``AOT_GRAPH_PIPELINE`` (the forward and the backward graph: the
schedule again) and ``POST_GRAD_PIPELINE`` (Inductor's post-grad graph). The later phases'
passes take a ``GraphContext`` (one graph and the options); ``run_passes`` runs every phase
and keeps its snapshots for a dump. ``python -m tspc.pipeline`` prints the list
(``describe``); docs/architecture.md is that output.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from tspc.passes.analyse import (
    adopt_static_values,
    analyse,
    propagate_shapes,
    recompile_if_stale,
)
from tspc.passes.canonicalize_attention import canonicalize_eager_attention
from tspc.passes.canonicalize_einsum import canonicalize_einsum
from tspc.passes.canonicalize_flex import canonicalize_flex
from tspc.passes.canonicalize_mha import canonicalize_mha
from tspc.passes.census import census, reconcile
from tspc.passes.chunk_loss import chunk_loss
from tspc.passes.classify_mask import classify_masks
from tspc.passes.functionalize_writes import UnsupportedWrite, functionalize_writes
from tspc.passes.graph_utils import eliminate_dead_code
from tspc.passes.inline_checkpoint import inline_checkpoints
from tspc.passes.keyed_random import key_random_ops
from tspc.passes.match_attention import match_attention
from tspc.passes.match_mlp import match_mlp
from tspc.passes.match_moe import match_moe
from tspc.passes.recompute import (
    extend_checkpoint_regions,
    recompute_ring_projections,
    tag_recompute,
)
from tspc.passes.rewrite_attention import AttentionRewrite, rewrite_attention
from tspc.passes.rewrite_mlp import rewrite_mlp, set_ring_hop_chunks
from tspc.passes.rewrite_moe import collapse_moe, shard_moe
from tspc.passes.schedule import schedule_overlap
from tspc.passes.shard_inputs import ShardInput, ShardInputs
from tspc.passes.shard_sequence import find_sequence_length, shard_sequence
from tspc.runtime.compat import LazyGraphModule
from tspc.runtime.context import RuntimeContext
from tspc.runtime.group import TSPGroup
from tspc.runtime.shard_store import STORE, ShardStore

from .errors import ModuleRewriteFailed
from .graph_phases import (  # noqa: F401  (re-exported: the backend and inner import them here)
    AOT_GRAPH_PIPELINE,
    JOINT_PIPELINE,
    POST_GRAD_PIPELINE,
    SPECIALIZE,
    GraphContext,
    Pass,
    run_passes,
)
from .module_isolation import ModuleFailures, rewrite_guarded, run_isolated, warn_module_skipped
from .options import TSPOptions
from .report import CompileReport, ModuleEntry

log = logging.getLogger("tspc")

LEVELS = ("tsp", "sp", "replicated")


@dataclass
class PipelineResult:
    gm: fx.GraphModule
    report: CompileReport
    snapshots: list[tuple[str, str]] = field(default_factory=list)  # (pass name, python code)
    # This rank's weight shards, which the rewritten graph takes as extra inputs after the
    # original ones (see passes/shard_inputs.py); the runtime fills them on every call.
    shard_inputs: list[ShardInput] = field(default_factory=list)
    runtime: RuntimeContext = field(default_factory=RuntimeContext)

    def example_inputs(self, original: list[Any]) -> list[Any]:
        return list(original) + [s.example for s in self.shard_inputs]


@dataclass
class PassContext:
    """What the passes of one compile share: the graph, its inputs, the group and options, the
    report being written, and what one pass hands to a later one."""

    gm: fx.GraphModule
    example_inputs: list[Any]
    group: TSPGroup
    opts: TSPOptions
    level: str
    report: CompileReport
    info: Any = None  # passes.analyse.GraphInfo: the inputs (parameters, buffers, user inputs)
    checkpointed: bool = False  # the model had torch.utils.checkpoint regions (inlined)
    changed_by_eager: bool = False  # canonicalize_attention replaced eager attention
    # why in-place writes stay in the graph (level 'replicated' only; the others raise)
    writes_left: str | None = None
    att_matches: list = field(default_factory=list)
    mlp_matches: list = field(default_factory=list)
    moe_matches: list = field(default_factory=list)  # experts run expert-parallel
    moe_ops: list = field(default_factory=list)  # (match, its moe_experts call)
    seq_len: int | None = None
    shards: ShardInputs | None = None  # the weight shards the rewrites asked for
    # where the rewrites declare every rank's slices of a weight (the runtime's STORE)
    shard_store: ShardStore = field(default_factory=lambda: STORE)
    # modules left out of the rewrites because theirs raised (tspc/module_isolation.py)
    failures: ModuleFailures = field(default_factory=ModuleFailures)
    # what the rewrites hand to the runtime, kept by the compiled graph (runtime/context.py)
    runtime: RuntimeContext = field(default_factory=RuntimeContext)

    @property
    def rewrites(self) -> bool:
        """Whether the TSP schedules run (level 'tsp' and schedules='tsp')."""
        return self.level == "tsp" and self.opts.schedules == "tsp"

    @property
    def shards_sequence(self) -> bool:
        return self.level != "replicated" and self.group.size > 1 and bool(self.seq_len)

    def code(self) -> str:
        recompile_if_stale(self.gm)  # a pass may have deferred regenerating the code
        return self.gm.code


def _inline_checkpoints(ctx: PassContext) -> None:
    ctx.checkpointed = bool(inline_checkpoints(ctx.gm))
    if ctx.checkpointed:
        ctx.report.notes.append("activation-checkpoint regions inlined (tagged for recompute)")


def _analyse(ctx: PassContext) -> None:
    ctx.info = analyse(ctx.gm, ctx.example_inputs)
    if not adopt_static_values(ctx.gm):  # else Dynamo's values serve until the graph changes
        propagate_shapes(ctx.gm, ctx.example_inputs)


def _canonicalize_attention(ctx: PassContext) -> None:
    # in-place writes into tensors the graph builds (a mask built with ``masked_fill_``,
    # ``h[:, 1:] = x[:, :-1]``) first: every pass reads a node's value as what it computes,
    # which a write would change behind them
    try:
        inputs = [i.node for i in ctx.info.user_inputs]
        written = functionalize_writes(ctx.gm, inputs)
    except UnsupportedWrite as e:
        if ctx.level != "replicated":
            raise
        # unsharded, the writes run as written; no pass may read the values they change
        ctx.writes_left = str(e)
        ctx.report.notes.append(f"attention and masks left as written: {e}")
        return
    if written:
        ctx.report.notes.append("in-place writes made pure: " + ", ".join(written))
        propagate_shapes(ctx.gm, ctx.example_inputs)
    # einsum projections and products first: the eager attention they spell is then the
    # matmul/softmax chain canonicalize_eager_attention reads
    if canonicalize_einsum(ctx.gm, ctx.info.params):
        ctx.report.notes.append("einsum calls lowered to linear/matmul")
    mha = canonicalize_mha(ctx.gm)
    flex = canonicalize_flex(ctx.gm)
    if any(f.replaced for f in mha + flex):  # the mask classifier reads the new nodes' values
        propagate_shapes(ctx.gm, ctx.example_inputs)
    for f in mha:
        if f.replaced:
            ctx.report.notes.append(f"{f.module}: nn.MultiheadAttention's call written out as SDPA")
        else:
            ctx.report.entries.append(ModuleEntry("attention", f.module, "skipped", f.reason))
    for f in flex:
        if f.replaced:
            ctx.report.notes.append(f"{f.module}: FlexAttention with a {f.reason} mask as SDPA")
        else:  # an entry, so that no attention is silently left out
            ctx.report.entries.append(ModuleEntry("attention", f.module, "skipped", f.reason))
    eager = canonicalize_eager_attention(ctx.gm)
    for e in eager:
        if not e.replaced:
            ctx.report.entries.append(
                ModuleEntry("attention", e.module, "skipped", f"eager attention: {e.reason}")
            )
    ctx.changed_by_eager = bool(eager) or any(f.replaced for f in mha + flex)


def _classify_masks(ctx: PassContext) -> None:
    if ctx.writes_left:
        return
    masks = classify_masks(ctx.gm)
    ctx.report.masks = [vars(m) for m in masks]
    if masks or ctx.changed_by_eager:  # the graph changed: new nodes need their values
        propagate_shapes(ctx.gm, ctx.example_inputs)


def _match(ctx: PassContext) -> None:
    D = ctx.group.size
    ctx.att_matches, att_skips = match_attention(ctx.gm, ctx.info, D)
    claimed = set()
    for m in ctx.att_matches:
        claimed |= {p.linear for p in m.projections()} | {m.o_linear}
    ctx.moe_matches, moe_skips = match_moe(ctx.gm, ctx.info, D)
    blocks: dict = {m.module: None for m in ctx.moe_matches}
    blocks.update({s.module: s for s in moe_skips})
    ctx.mlp_matches, mlp_skips = match_mlp(ctx.gm, ctx.info, D, claimed, blocks)
    if ctx.rewrites:
        _collapse_moe(ctx)
    for s in att_skips + mlp_skips:
        if s.error is not None:  # matching raised: this module alone is left out
            if ctx.opts.strict:
                raise ModuleRewriteFailed(s.kind, s.module, "match", s.error) from s.error
            warn_module_skipped(ctx.report.graph_id, s.kind, s.module, s.error)
        details = {"fix": s.fix} if s.fix else {}
        ctx.report.entries.append(ModuleEntry(s.kind, s.module, "skipped", s.reason, details))
    _census(ctx, att_skips + mlp_skips)
    ctx.seq_len = ctx.report.seq_len = find_sequence_length(ctx.gm)


def _rewrite_each(ctx: PassContext, kind: str, matches: list, rewrite) -> Iterator[tuple]:
    """``(match, rewrite(match))`` for each match not left out by an earlier attempt
    (``tspc/module_isolation.py``; those are reported skipped), each rewrite guarded so that
    one that raises names its module."""
    for m in matches:
        failed = ctx.failures.excluded(kind, m.module)
        if failed:
            ctx.report.entries.append(ModuleEntry(kind, m.module, "skipped", failed))
            continue
        yield m, rewrite_guarded(kind, m.module, lambda m=m: rewrite(m))


def _collapse_moe(ctx: PassContext) -> None:
    """Each matched MoE block's experts become one ``moe_experts`` call before the sequence
    pass runs (``passes/rewrite_moe.py``: the region's sorts over all pairs would otherwise
    gather the sequence); ``_rewrite_mlp`` gives each call its rank's experts."""

    def collapse(m):
        return collapse_moe(ctx.gm, m, ctx.runtime.chains)

    ctx.moe_ops.extend(_rewrite_each(ctx, "mlp", ctx.moe_matches, collapse))
    if ctx.moe_ops:
        propagate_shapes(ctx.gm, ctx.example_inputs)


def _census(ctx: PassContext, skips: list) -> None:
    """Every attention- and MLP-like computation the census finds is in the report: one no
    match or skip accounts for becomes a skip naming the form the matcher did not recognise."""
    items = census(ctx.gm, ctx.info.params)
    anchors = {m.sdpa: m.module for m in ctx.att_matches}
    anchors |= {m.down.node: m.module for m in ctx.mlp_matches}
    anchors |= {s.anchor: s.module for s in skips if s.anchor is not None}
    listed = {(e.kind, e.module) for e in ctx.report.entries}
    for item in reconcile(items, anchors, listed):
        reason = f"not recognised by the {item.kind} matcher: {item.form}"
        ctx.report.entries.append(ModuleEntry(item.kind, item.module, "skipped", reason))
    ctx.report.census = [
        {"kind": i.kind, "module": i.module, "form": i.form, "node": i.anchor.name} for i in items
    ]


def _key_random_ops(ctx: PassContext) -> None:
    keyed = key_random_ops(ctx.gm, ctx.group.name, ctx.group.size)
    ctx.report.notes += keyed.notes()
    if keyed.keyed:  # new nodes need their values
        propagate_shapes(ctx.gm, ctx.example_inputs)


def _shard_sequence(ctx: PassContext) -> None:
    if not ctx.shards_sequence:
        if ctx.group.size > 1 and ctx.level != "replicated":
            ctx.report.notes.append("no self-attention found: the sequence is not sharded")
        return
    sr = shard_sequence(
        ctx.gm,
        ctx.info,
        ctx.group,
        ctx.seq_len,
        gather_outputs=ctx.opts.outputs == "gathered",
        tags={m.sdpa: m.module for m in ctx.att_matches},
    )
    ctx.report.sharded_inputs = sr.sharded_inputs
    ctx.report.padded_seq_len = sr.padded_len
    ctx.report.gathers = sr.gathers
    ctx.report.notes += sr.notes
    propagate_shapes(ctx.gm, ctx.example_inputs)


def _chunk_loss(ctx: PassContext) -> None:
    ctx.report.notes += chunk_loss(ctx.gm, ctx.opts.loss_chunk)


def _rewrite_attention(ctx: PassContext) -> None:
    report = ctx.report
    if not ctx.rewrites:
        _report_not_rewritten(ctx, "attention", ctx.att_matches)
        return
    ctx.shards = ShardInputs(ctx.gm, ctx.info, ctx.group, ctx.shard_store)

    def rewrite(m):
        return rewrite_attention(ctx.gm, ctx.info, m, ctx.group, ctx.shards)

    for m, out in _rewrite_each(ctx, "attention", ctx.att_matches, rewrite):
        if isinstance(out, AttentionRewrite):
            skip = ("module", "notes", "model_kv_heads", "held_whole")
            details = {k: v for k, v in vars(out).items() if k not in skip}
            if out.held_whole is not None:  # some weights whole for a reason the user can change
                details["held_whole"], details["fix"] = out.held_whole
            kv_heads = out.model_kv_heads or m.kv_heads  # the model's, for the formula
            details.update(q_heads=m.q_heads, kv_heads=kv_heads, head_dim=m.head_dim)
            report.entries.append(ModuleEntry("attention", m.module, "matched", "", details))
            report.predicted_recv_bytes[m.module] = out.predicted_recv_bytes
            report.notes += [f"{m.module}: {note}" for note in out.notes]
        else:
            report.entries.append(ModuleEntry("attention", m.module, "skipped", out.reason))
    # No propagation here: a rewrite reads only the metadata of its own layer's original
    # nodes, which no other rewrite touches; the one after the MLP rewrites gives every new
    # node its value and validates the whole rewritten graph (each propagation runs every
    # node on fake tensors: a large share of the passes' time).
    rewritten = {
        m.sdpa.name
        for m in ctx.att_matches
        if any(e.module == m.module and e.status == "matched" for e in report.entries)
    }
    # K/V gathers of the sequence pass that the schedule replaced are not in the program.
    report.gathers = [x for x in report.gathers if x["for"] not in rewritten]


def _rewrite_mlp(ctx: PassContext) -> None:
    if not ctx.rewrites:
        _report_not_rewritten(ctx, "mlp", ctx.mlp_matches + ctx.moe_matches)
        return
    if ctx.group.size > 1 and not ctx.shards_sequence:
        # every rank holds every token here (a graph with no self-attention: a graph break
        # cut it off): the ring would reduce D equal weight gradients onto each owner, D times
        # the true one; the MLP reads its weights whole instead (gathered if already released)
        why = "the sequence is not sharded in this graph (no self-attention in it)"
        for m in ctx.mlp_matches:
            ctx.report.entries.append(ModuleEntry("mlp", m.module, "skipped", why))
        for m, _ in ctx.moe_ops:  # the op keeps whole experts and runs them locally
            ctx.report.entries.append(ModuleEntry("mlp", m.module, "skipped", why))
        return
    for m, op in ctx.moe_ops:  # expert parallelism (passes/rewrite_moe.py)
        out = rewrite_guarded(
            "mlp", m.module, lambda m=m, op=op: shard_moe(ctx.gm, op, m, ctx.group, ctx.shards)
        )
        details = {k: v for k, v in vars(out).items() if k != "module"}
        ctx.report.entries.append(ModuleEntry("mlp", m.module, "matched", "", details))

    def rewrite(m):
        return rewrite_mlp(ctx.gm, ctx.info, m, ctx.group, ctx.shards, ctx.runtime.chains)

    for m, out in _rewrite_each(ctx, "mlp", ctx.mlp_matches, rewrite):
        details = {k: v for k, v in vars(out).items() if k != "module"}
        details["intermediate"] = m.intermediate
        ctx.report.entries.append(ModuleEntry("mlp", m.module, "matched", "", details))
        ctx.report.predicted_recv_bytes[m.module] = out.predicted_recv_bytes
    eliminate_dead_code(ctx.gm.graph)  # once for all layers; each rewrite erased its own
    propagate_shapes(ctx.gm, ctx.example_inputs + ctx.shards.examples)


def _report_not_rewritten(ctx: PassContext, kind: str, matches: list) -> None:
    why = "schedules='sp'" if ctx.opts.schedules == "sp" else f"level '{ctx.level}'"
    for m in matches:
        ctx.report.entries.append(ModuleEntry(kind, m.module, "skipped", f"not rewritten ({why})"))


def _recompute(ctx: PassContext) -> None:
    _tag_recomputed(ctx)
    # after the tagging: by default a recomputed block's ring hops in sub-shard chunks
    chunked = set_ring_hop_chunks(ctx.gm, ctx.opts.ring_chunks)
    if chunked:
        ctx.report.notes.append(f"{chunked} MLP ring(s) hop in sub-shard chunks")


def _tag_recomputed(ctx: PassContext) -> None:
    opts = ctx.opts
    if opts.recompute == "none":
        if ctx.checkpointed:
            extend_checkpoint_regions(ctx.gm)
            recompute_ring_projections(ctx.gm)  # rings inside a user's checkpoint regions
        return
    regions = tag_recompute(
        ctx.gm,
        [m.module for m in ctx.att_matches],
        [m.module for m in ctx.mlp_matches],
        opts.recompute,
    )
    recompute_ring_projections(ctx.gm)
    what = "block" if opts.recompute == "full" else "attention"
    ctx.report.notes.append(
        f"recompute={opts.recompute}: {len(regions)} {what} region(s) recomputed in backward"
        + (f" ({regions[0]} ... {regions[-1]})" if regions else "")
    )


def _schedule(ctx: PassContext) -> None:
    schedule_overlap(ctx.gm)


PIPELINE: tuple[Pass, ...] = (
    Pass("inline_checkpoints", _inline_checkpoints),
    Pass("analyse", _analyse),
    Pass("canonicalize_attention", _canonicalize_attention),
    Pass("classify_masks", _classify_masks),
    Pass("match", _match),
    # at every D, D = 1 too: keyed by global position, D = 1 draws what D = 2 and 4 draw
    Pass("key_random_ops", _key_random_ops, lambda ctx: ctx.level != "replicated"),
    Pass("shard_sequence", _shard_sequence),
    Pass("chunk_loss", _chunk_loss, lambda ctx: ctx.shards_sequence),
    Pass("rewrite_attention", _rewrite_attention),
    Pass("rewrite_mlp", _rewrite_mlp),
    Pass("recompute", _recompute),
    Pass("schedule", _schedule, lambda ctx: ctx.opts.overlap),
)


@dataclass(frozen=True)
class Phase:
    name: str
    graph: str  # what its passes run on, and who runs them
    passes: tuple[Pass, ...]


PHASES: tuple[Phase, ...] = (
    Phase(
        "specialize", "a graph traced with symbolic sizes, per concrete shape (backend)", SPECIALIZE
    ),
    Phase("graph", "a copy of Dynamo's graph (backend, per fallback level)", PIPELINE),
    Phase("joint", "aot_autograd's joint graph, before the partitioner (inner)", JOINT_PIPELINE),
    Phase("aot_graph", "the forward and the backward graph (inner)", AOT_GRAPH_PIPELINE),
    Phase("post_grad", "Inductor's post-grad graph, inner='inductor' (inner)", POST_GRAD_PIPELINE),
)


def describe() -> str:
    """Every phase and its passes in order: the list docs/architecture.md shows
    (``python -m tspc.pipeline`` prints it; a test keeps the two equal)."""
    lines = []
    for phase in PHASES:
        lines.append(f"{phase.name}: {phase.graph}")
        for i, p in enumerate(phase.passes, 1):
            lines.append(f"  {i:2d}. {p.name}")
    return "\n".join(lines)


def fresh_copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of Dynamo's graph in a new GraphModule with no Dynamo metadata.

    The copy is what the passes mutate (Dynamo's graph stays intact for recompiles at other
    shapes), and its root module is where the shards live as parameters that aot_autograd lifts.
    It is a lazy GraphModule (as Inductor's passes use): a pass's ``recompile()`` only marks
    the code stale, and the code is generated once, when something runs or reads it —
    regenerating it after every pass was a tenth of the passes' time on a 32-layer model.
    """
    root = torch.nn.Module()
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    for n in graph.nodes:
        if n.op == "get_attr":
            obj = gm
            for part in n.target.split("."):
                obj = getattr(obj, part)
            setattr(root, n.target.replace(".", "_"), obj)
            n.target = n.target.replace(".", "_")
    return LazyGraphModule(root, graph)


def run_pipeline(
    dynamo_gm: fx.GraphModule,
    example_inputs: list[Any],
    group: TSPGroup,
    opts: TSPOptions,
    level: str = "tsp",
    graph_id: int = 0,
    store: ShardStore = STORE,
) -> PipelineResult:
    """Every pass of ``PIPELINE`` that applies, in order, on a copy of Dynamo's graph.
    ``store``: where the rewrites declare the weights' slices (a test may pass its own); only
    the declarations of the attempt that ran through reach it. A module whose rewrite raises is
    left out and the passes run again (``tspc/module_isolation.py``)."""

    def attempt(failures: ModuleFailures) -> PipelineResult:
        scratch = store.scratch_copy(example_inputs)
        res = _run_pipeline_once(
            dynamo_gm, example_inputs, group, opts, level, graph_id, scratch, failures
        )
        store.keep_declarations(scratch)
        return res

    return run_isolated(attempt, opts.strict, graph_id)


def _run_pipeline_once(
    dynamo_gm: fx.GraphModule,
    example_inputs: list[Any],
    group: TSPGroup,
    opts: TSPOptions,
    level: str,
    graph_id: int,
    store: ShardStore,
    failures: ModuleFailures,
) -> PipelineResult:
    gm = fresh_copy(dynamo_gm)
    report = CompileReport(rank=group.rank, world=group.size, level=level, graph_id=graph_id)
    ctx = PassContext(
        gm, list(example_inputs), group, opts, level, report, shard_store=store, failures=failures
    )
    res = PipelineResult(gm, report, runtime=ctx.runtime)

    # Only a dump shows the per-pass code: generating it for the whole graph after every
    # pass is a cost no other user of the pipeline should pay.
    snapshots = res.snapshots if opts.dump_dir else None
    if snapshots is not None:
        snapshots.append(("captured", ctx.code()))
    run_passes(PIPELINE, ctx, snapshots, f"level {level}, graph {graph_id}")
    recompile_if_stale(gm)
    if ctx.shards is not None:
        res.shard_inputs = ctx.shards.items
    report.entries.sort(key=lambda e: (_natural_key(e.module), e.kind))
    return res


def _natural_key(s: str):
    import re

    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


if __name__ == "__main__":
    print(describe())
