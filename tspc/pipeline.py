"""The pass pipeline, in order, with a snapshot of the graph after each pass.

    inline_checkpoints -> analyse -> canonicalize_attention -> classify_masks -> match_attention, match_mlp -> shard_sequence -> chunk_loss -> rewrite_attention
            -> rewrite_mlp -> recompute -> schedule_overlap -> (inner compiler: tspc/inner.py)

``run_pipeline`` runs it on a copy of Dynamo's graph at one *level*: "tsp" (everything), "sp"
(sequence sharding only: replicated weights, K/V all-gathered), or "replicated" (no pass
changes the graph; every rank computes everything). The backend falls back from a level to the
next when a pass fails, unless the user asked for ``strict``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

try:  # private to torch (Dynamo and Inductor use it); without it code is generated eagerly
    from torch.fx._lazy_graph_module import _LazyGraphModule as _GraphModule
except ImportError:  # pragma: no cover - other torch versions
    _GraphModule = fx.GraphModule

from tspc.passes.analyse import (
    adopt_static_values,
    analyse,
    propagate_shapes,
    recompile_if_stale,
)
from tspc.passes.canonicalize_attention import canonicalize_eager_attention
from tspc.passes.chunk_loss import chunk_loss
from tspc.passes.classify_mask import classify_masks
from tspc.passes.graph_utils import eliminate_dead_code
from tspc.passes.inline_checkpoint import inline_checkpoints
from tspc.passes.match_attention import match_attention
from tspc.passes.match_mlp import match_mlp
from tspc.passes.recompute import (
    extend_checkpoint_regions,
    recompute_ring_projections,
    tag_recompute,
)
from tspc.passes.rewrite_attention import AttentionRewrite, rewrite_attention
from tspc.passes.rewrite_mlp import rewrite_mlp
from tspc.passes.schedule import schedule_overlap
from tspc.passes.shard_inputs import ShardInput, ShardInputs
from tspc.passes.shard_sequence import find_sequence_length, shard_sequence
from tspc.runtime.group import TSPGroup

from .options import TSPOptions
from .report import CompileReport, ModuleEntry

log = logging.getLogger("tspc")

PIPELINE = (
    "inline_checkpoints",
    "analyse",
    "canonicalize_attention",
    "classify_masks",
    "match",
    "shard_sequence",
    "chunk_loss",
    "rewrite_attention",
    "rewrite_mlp",
    "recompute",
    "schedule",
)
LEVELS = ("tsp", "sp", "replicated")


@dataclass
class PipelineResult:
    gm: fx.GraphModule
    report: CompileReport
    snapshots: list[tuple[str, str]] = field(default_factory=list)  # (pass name, python code)
    # This rank's weight shards, which the rewritten graph takes as extra inputs after the
    # original ones (see passes/shard_inputs.py); the runtime fills them on every call.
    shard_inputs: list[ShardInput] = field(default_factory=list)

    def example_inputs(self, original: list[Any]) -> list[Any]:
        return list(original) + [s.example for s in self.shard_inputs]


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
    return _GraphModule(root, graph)


def run_pipeline(
    dynamo_gm: fx.GraphModule,
    example_inputs: list[Any],
    group: TSPGroup,
    opts: TSPOptions,
    level: str = "tsp",
    graph_id: int = 0,
) -> PipelineResult:
    D = group.size
    gm = fresh_copy(dynamo_gm)
    report = CompileReport(rank=group.rank, world=D, level=level, graph_id=graph_id)
    res = PipelineResult(gm, report)

    def snap(name: str) -> None:
        # Only a dump shows the per-pass code: generating it for the whole graph after every
        # pass is a cost no other user of the pipeline should pay.
        if opts.dump_dir:
            recompile_if_stale(gm)  # a pass may have deferred regenerating the code
            res.snapshots.append((name, gm.code))

    snap("captured")
    checkpointed = inline_checkpoints(gm)
    if checkpointed:
        report.notes.append("activation-checkpoint regions inlined (tagged for recompute)")
    snap("inline_checkpoints")
    info = analyse(gm, example_inputs)
    if not adopt_static_values(gm):  # else Dynamo's values serve until the graph changes
        propagate_shapes(gm, example_inputs)
    snap("analyse")
    eager = canonicalize_eager_attention(gm)
    for e in eager:
        if not e.replaced:  # an entry, so that no attention is silently left out
            report.entries.append(
                ModuleEntry("attention", e.module, "skipped", f"eager attention: {e.reason}")
            )
    snap("canonicalize_attention")
    masks = classify_masks(gm)
    report.masks = [vars(m) for m in masks]
    if masks or eager:  # the graph changed: new nodes need their values
        propagate_shapes(gm, example_inputs)
    snap("classify_masks")
    att_matches, att_skips = match_attention(gm, info, D)
    claimed = set()
    for m in att_matches:
        claimed |= {p.linear for p in m.projections()} | {m.o_linear}
    mlp_matches, mlp_skips = match_mlp(gm, info, D, claimed)
    for s in att_skips + mlp_skips:
        report.entries.append(ModuleEntry(s.kind, s.module, "skipped", s.reason))
    snap("match")
    seq_len = find_sequence_length(gm)
    report.seq_len = seq_len
    if level == "replicated" or D == 1 or not seq_len:
        if D > 1 and level != "replicated":
            report.notes.append("no self-attention found: the sequence is not sharded")
    else:
        tags = {m.sdpa: m.module for m in att_matches}
        sr = shard_sequence(
            gm, info, group, seq_len, gather_outputs=opts.outputs == "gathered", tags=tags
        )
        report.sharded_inputs = sr.sharded_inputs
        report.padded_seq_len = sr.padded_len
        report.gathers = sr.gathers
        report.notes += sr.notes
        propagate_shapes(gm, example_inputs)
        report.notes += chunk_loss(gm, opts.loss_chunk)
    snap("shard_sequence")

    if level == "tsp" and opts.schedules == "tsp":
        shards = ShardInputs(gm, info, group)
        for m in att_matches:
            out = rewrite_attention(gm, info, m, group, shards)
            if isinstance(out, AttentionRewrite):
                details = {
                    k: v
                    for k, v in vars(out).items()
                    if k not in ("module", "notes", "model_kv_heads")
                }
                kv_heads = out.model_kv_heads or m.kv_heads  # the model's, for the formula
                details.update(q_heads=m.q_heads, kv_heads=kv_heads, head_dim=m.head_dim)
                report.entries.append(ModuleEntry("attention", m.module, "matched", "", details))
                report.predicted_recv_bytes[m.module] = out.predicted_recv_bytes
                report.notes += [f"{m.module}: {note}" for note in out.notes]
            else:
                report.entries.append(ModuleEntry("attention", m.module, "skipped", out.reason))
        # No propagation here: a rewrite reads only the metadata of its own layer's original
        # nodes, which no other rewrite touches; the one after the MLP rewrites gives every
        # new node its value and validates the whole rewritten graph (each propagation runs
        # every node on fake tensors: a large share of the passes' time).
        rewritten = {
            m.sdpa.name
            for m in att_matches
            if any(e.module == m.module and e.status == "matched" for e in report.entries)
        }
        # K/V gathers of the sequence pass that the schedule replaced are not in the program.
        report.gathers = [x for x in report.gathers if x["for"] not in rewritten]
        snap("rewrite_attention")
        for m in mlp_matches:
            out = rewrite_mlp(gm, info, m, group, shards)
            details = {k: v for k, v in vars(out).items() if k != "module"}
            details["intermediate"] = m.intermediate
            report.entries.append(ModuleEntry("mlp", m.module, "matched", "", details))
            report.predicted_recv_bytes[m.module] = out.predicted_recv_bytes
        eliminate_dead_code(gm.graph)  # once for all layers; each rewrite erased its own
        propagate_shapes(gm, example_inputs + shards.examples)
        res.shard_inputs = shards.items
        snap("rewrite_mlp")
    else:
        why = "schedules='sp'" if opts.schedules == "sp" else f"level '{level}'"
        for m in att_matches:
            report.entries.append(
                ModuleEntry("attention", m.module, "skipped", f"not rewritten ({why})")
            )
        for m in mlp_matches:
            report.entries.append(ModuleEntry("mlp", m.module, "skipped", f"not rewritten ({why})"))
    if opts.recompute != "none":
        regions = tag_recompute(
            gm, [m.module for m in att_matches], [m.module for m in mlp_matches], opts.recompute
        )
        what = "block" if opts.recompute == "full" else "attention"
        report.notes.append(
            f"recompute={opts.recompute}: {len(regions)} {what} region(s) recomputed in backward"
            + (f" ({regions[0]} ... {regions[-1]})" if regions else "")
        )
    elif checkpointed:
        extend_checkpoint_regions(gm)
    recompute_ring_projections(gm)
    snap("recompute")
    if opts.overlap:
        schedule_overlap(gm)
    snap("schedule")
    recompile_if_stale(gm)
    report.entries.sort(key=lambda e: (_natural_key(e.module), e.kind))
    return res


def _natural_key(s: str):
    import re

    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]
