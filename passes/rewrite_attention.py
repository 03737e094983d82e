"""Pass 4a — rewrite matched attention into the TSP broadcast schedule.

For r = 0..D-1 (one step per head group):

1. rank r broadcasts its packed shard [W_Q^r; W_K^r; W_V^r; W_O^r] (and biases): one transfer;
2. every rank runs the original head-local region — projections, reshapes, RoPE, q/k norms —
   for head group r only, on its local tokens (the region is cloned with its head counts cut to
   the group's);
3. the group's keys and values are all-gathered over the sequence (zigzag, back in true order);
4. local queries attend causally to them (``tspc::zigzag_causal_attention``, or SDPA with the
   mask's local rows); grouped-query repetition is done by the kernel, so only KV heads move;
5. the group's output projection gives a partial result, accumulated locally — no all-reduce.

Only one head group's gathered K/V is alive at a time. At D = 1 the same clone runs once with
the original weights and no communication.

The head-local check (``passes/head_plan.py``) is a propagation like the sequence one: every
value in the region must carry the head factor whole in one dimension, and nothing may mix
heads. A region that fails the check is left as the sequence pass made it (SP: replicated
weights) and reported as skipped with the reason.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn.functional as F

from tspc.ops.masked_rows import masked_attention
from tspc.ops.zigzag_attention import causal_attention, default_scale
from tspc.runtime.autograd_glue import sync_replicated_grad
from tspc.runtime.group import TSPGroup
from tspc.runtime.packing import pack, unpack
from tspc.runtime.shard_store import ShardSpec

from .analyse import GraphInfo, defer_recompile
from .graph_utils import (
    arg,
    erase_unused,
    reachable,
    shape,
    sink_after,
    tensor_val,
)
from .head_plan import (
    REDUCED,
    WHOLE,
    HeadPlan,
    NotHeadLocal,
    head_rows,
    local_heads,
    plan_heads,
    post_chain,
    region_between,
)
from .held_whole import kv_heads_fix
from .layout import (
    reduced_dims,
)
from .match_attention import AttentionMatch, Projection, Skip, projection_input
from .seq_rules_attention import sdpa_local_queries
from .shard_inputs import ShardInputs


@dataclass
class AttentionRewrite:
    module: str
    steps: int
    broadcasts: int
    kv_gathers: int
    local_heads: int
    local_kv_heads: int
    kernel: str
    shard_numel: int
    predicted_recv_bytes: int = 0
    notes: list[str] = field(default_factory=list)
    # the model's own KV head count where the schedule moves more (K/V expanded before the
    # head-local ops): what the paper's formula counts
    model_kv_heads: int = 0
    # (reason, fix) when some of its weights are held whole for a reason the user can change
    held_whole: tuple[str, str] | None = None


def _find_gather(root: fx.Node) -> fx.Node | None:
    for u in root.users:
        if u.meta.get("tspc_role") in ("kv_gather", "seq_gather"):
            return u
        if u.op == "call_function" and u.target is torch.ops.tspc.all_gather_start.default:
            for w in u.users:
                if w.meta.get("tspc_role") in ("kv_gather", "seq_gather"):
                    return w
    return None


def rewrite_attention(
    gm: fx.GraphModule,
    info: GraphInfo,
    match: AttentionMatch,
    group: TSPGroup,
    shards: ShardInputs,
) -> AttentionRewrite | Skip:
    """Rewrite one matched attention in place; the graph reads this rank's shards from new
    inputs that ``shards`` adds (see passes/shard_inputs.py)."""
    try:
        return _rewrite(gm, info, match, group, shards)
    except NotHeadLocal as e:
        return Skip("attention", match.module, f"not head-local: {e}")


def _descendants_within(nodes: list[fx.Node], region: set[fx.Node]) -> set[fx.Node]:
    # the starts themselves are kept even outside the region (as the users they lead to)
    return set(nodes) | reachable([u for n in nodes for u in n.users], True, region)


def _ancestors_within(nodes: list[fx.Node], region: set[fx.Node]) -> set[fx.Node]:
    return reachable(nodes, forward=False, within=region)


def _rewrite(gm, info, m: AttentionMatch, group: TSPGroup, shards: ShardInputs) -> AttentionRewrite:
    g = gm.graph
    D, rank = group.size, group.rank
    attention = m.sdpa
    d = m.head_dim
    projections = m.projections()
    sources = {p.out: p for p in projections}
    q_key = m.q.key()
    # Fewer KV heads than ranks: D / Hkv consecutive head groups share one KV head; its K/V
    # are computed and gathered once, in the step of the first of those groups (the
    # "primary"), and reused by the following groups, so the K/V bytes stay 2*B*S*h_kv.
    # Separate K/V projection weights stay whole on every rank (a replicated parameter, its
    # gradient summed in-graph): one owner per head would be no DTensor placement, and every
    # rank already holding them saves their broadcast. A fused projection keeps its K/V rows
    # in the primary's pack.
    shared_kv = m.kv_heads % D != 0
    span = D // m.kv_heads if shared_kv else 1

    def kv_only(p: Projection) -> bool:
        return p.key() != q_key

    replicated_kv = [p for p in projections if shared_kv and kv_only(p)]

    def primary(r: int) -> bool:
        return r % span == 0

    k_gather = _find_gather(m.k_root) if D > 1 else None
    v_gather = _find_gather(m.v_root) if D > 1 else None
    if D > 1 and (k_gather is None or v_gather is None):
        raise NotHeadLocal("keys/values are not gathered where expected (sequence pass)")

    q_in = arg(attention, 0, "query")
    region = region_between(list(sources), [q_in, m.k_root, m.v_root])
    region_only = set(region)
    plan = plan_heads(m, D, attention, region, sources, projections)
    post = post_chain(attention, m.o_linear)
    plan.plan_post(post)
    kv_nodes = _ancestors_within([m.k_root, m.v_root], region_only) - _ancestors_within(
        [q_in], region_only
    )

    # Attention arguments as the sequence pass left them.
    key_valid = exact_rows = None
    if attention.target is causal_attention:
        kind, mask, scale = "zigzag_causal", None, attention.args[4]
        key_valid = attention.args[3]
    elif attention.target is sdpa_local_queries:
        kind, mask, scale = "sdpa_masked_rows", attention.args[3], attention.args[5]
        exact_rows = attention.args[7] if len(attention.args) > 7 else None  # masked_attention
    else:
        kind, mask, scale = "sdpa", arg(attention, 3, "attn_mask"), arg(attention, 6, "scale")
    if scale is None:
        scale = default_scale(d)

    # ---- what each step's pack holds: (name, full parameter node, the slice of it)
    def components(r: int) -> list[tuple[str, fx.Node, ShardSpec]]:
        out = []
        for i, p in enumerate(projections):
            if p in replicated_kv or (shared_kv and kv_only(p) and not primary(r)):
                continue
            a, b = head_rows(p, r, D)
            out.append((f"p{i}_w", p.weight, ShardSpec(p.feature_dim, a, b)))
            if p.bias is not None:
                out.append((f"p{i}_b", p.bias, ShardSpec(0, a, b)))
        hq_l = m.q_heads // D
        o_in_dim = 0 if m.o_transposed else 1  # the weight dim of the heads' features
        dv = m.v_head_dim or d
        out.append(("o_w", m.o_weight, ShardSpec(o_in_dim, r * hq_l * dv, (r + 1) * hq_l * dv)))
        return out

    def comp_shape(pnode: fx.Node, spec: ShardSpec) -> tuple[int, ...]:
        s = list(shape(pnode))
        s[spec.dim] = spec.stop - spec.start
        return tuple(s)

    step_comps = [components(r) for r in range(D)]
    step_shapes = [[comp_shape(pn, sp) for _, pn, sp in c] for c in step_comps]
    step_numel = [sum(math.prod(s) for s in shapes) for shapes in step_shapes]
    # With statistics over all heads (plan.cross) the layer sweeps the head groups twice:
    # the first sweep's broadcasts carry the Q/K/V slices, the second's the O slice. Every
    # weight still moves once; each rank keeps its own tokens' projections of every group
    # between the sweeps (the activations one process keeps for its backward anyway).
    sweeps = [lambda name: name != "o_w", lambda name: name == "o_w"] if plan.cross else [None]

    def sweep_part(r: int, k: int) -> tuple[list, list, int]:
        keep = sweeps[k]
        idx = [i for i, (name, _, _) in enumerate(step_comps[r]) if keep is None or keep(name)]
        shapes = [step_shapes[r][i] for i in idx]
        return [step_comps[r][i] for i in idx], shapes, sum(math.prod(x) for x in shapes)

    order = {n: i for i, n in enumerate(g.nodes)}
    first_use = min(region + [m.o_linear], key=order.__getitem__)
    pack_nodes: list[fx.Node | None] = [None] * len(sweeps)
    shard_numel = 0
    if D > 1:
        # every rank's slices of each parameter: the pack of step r is rank r's
        layouts: dict[fx.Node, list[list[ShardSpec]]] = {}
        for r, c in enumerate(step_comps):
            for _, pnode, spec in c:
                layouts.setdefault(pnode, [[] for _ in range(D)])[r].append(spec)
        for pnode, layout in layouts.items():
            shards.declare(pnode, layout)
        with g.inserting_before(first_use):
            for k in range(len(sweeps)):
                shard_nodes = []
                for cname, pnode, spec in sweep_part(rank, k)[0]:
                    node = shards.get(pnode, spec, f"tsp_{m.module.replace('.', '_')}_{cname}")
                    shard_numel += math.prod(comp_shape(pnode, spec))
                    shard_nodes.append(node)
                pack_nodes[k] = g.call_function(pack, (shard_nodes,))

    tag = m.module
    n_kv_groups = m.kv_heads if shared_kv else D
    elem = tensor_val(m.o_weight).element_size()
    # one head group's K and V bytes, averaged (values may have a head size of their own)
    kv_group_bytes = (
        sum(
            t.numel() // m.kv_heads * local_heads(m.kv_heads, D) * t.element_size()
            for t in (tensor_val(m.k_root), tensor_val(m.v_root))
        )
        // 2
    )
    ret = AttentionRewrite(
        module=m.module,
        steps=D * len(sweeps),
        broadcasts=D * len(sweeps) if D > 1 else 0,
        kv_gathers=2 * n_kv_groups if D > 1 else 0,
        local_heads=m.q_heads // D,
        local_kv_heads=local_heads(m.kv_heads, D),
        kernel=kind,
        shard_numel=shard_numel,
        predicted_recv_bytes=(
            sum(n for r, n in enumerate(step_numel) if r != rank) * elem
            + 2 * n_kv_groups * (D - 1) * kv_group_bytes
        )
        if D > 1
        else 0,
    )
    projected_kv = m.k.n_heads  # the heads the K projection makes (fused: the row units)
    if projected_kv < m.kv_heads and D > 1:
        # The KV heads are expanded before RoPE (Falcon's broadcast_to, torchtune's view +
        # expand + reshape, torchtitan's repeat_kv before the transpose), so the keys the
        # schedule gathers already have the query heads' count
        kv_bytes = 2 * n_kv_groups * (D - 1) * kv_group_bytes
        extra = kv_bytes - kv_bytes * projected_kv // m.kv_heads
        ret.model_kv_heads = projected_kv
        ret.notes.append(
            f"the model expands its {projected_kv} K/V heads to {m.kv_heads} before the "
            "head-local ops (RoPE) run on them, so each head group's K/V is gathered at that "
            f"width: {extra} bytes more than the formula's 2*B*S*h_kv*d"
        )
    if plan.cross:
        ret.notes.append(
            "statistics over all heads ("
            + ", ".join(f"'{n.name}' ({kind_})" for n, kind_ in plan.cross.items())
            + f") before the attention: two sweeps over the {D} head groups, Q/K/V slices "
            "broadcast in the first, O in the second (every weight moves once); each rank "
            "keeps its tokens' projections of all head groups between them"
        )
    if replicated_kv and D > 1:
        params = info.params
        names = ", ".join(sorted({params[p.weight].fqn for p in replicated_kv}))
        ret.held_whole = (
            f"its {m.kv_heads} key/value heads are fewer than D={D}, so its K/V projection "
            f"weights ({names}) are held whole on every rank",
            kv_heads_fix(m.kv_heads),
        )
        ret.notes.append(
            f"{m.kv_heads} KV heads on {D} ranks: the K/V projection weights stay whole on every "
            "rank (replicated, not broadcast), so the layer receives "
            f"{sum(_rows_numel(p) for p in replicated_kv) * (D - 1) // D * elem} "
            "weight bytes fewer than the formula counts"
        )
    region_set = region_only | set(post)
    old_gathers = [n for n in (k_gather, v_gather) if n is not None]
    # a padded sequence's gathers are cut back to the true length by a node of their own
    old_gathers += [n.meta["tspc_unpad"] for n in old_gathers if "tspc_unpad" in n.meta]
    ignore_users = set(old_gathers) | {n.args[0] for n in old_gathers} | set(m.repeat_nodes)
    ignore_users |= {attention, m.o_linear}
    escapes: dict[fx.Node, list[fx.Node]] = {
        n: [] for n in region if any(u not in region_set and u not in ignore_users for u in n.users)
    }

    acc = None
    env_primary: dict[fx.Node, fx.Node] = {}
    kv_primary: tuple[fx.Node, fx.Node] | None = None
    gqa = m.kv_heads != m.q_heads
    reduced = {n for n in region if plan.layout.get(n) is REDUCED}
    after_stats = _descendants_within(list(reduced), region_only) - reduced
    envs: list[dict[fx.Node, fx.Node]] = [{} for _ in range(D)]

    def weights(r: int, k: int) -> dict[str, fx.Node]:
        comps, shapes, numel = sweep_part(r, k)
        return _step_weights(g, r, D, group, tag, pack_nodes[k], comps, shapes, numel)

    def project(r: int, ws: dict[str, fx.Node], nodes: list[fx.Node]) -> None:
        """Head group r's copies of ``nodes`` (region nodes, in graph order)."""
        env = envs[r]
        reuse = shared_kv and not primary(r)
        if not reuse:
            ws.update(_replicated_kv_weights(g, replicated_kv, projections, r, D))
        for node in nodes:
            if reuse and node in kv_nodes:
                env[node] = env_primary[node]
            elif node in sources:
                p = sources[node]
                i = projections.index(p)
                env[node] = g.call_function(
                    F.linear,
                    (projection_input(p), _as_out_in(g, ws[f"p{i}_w"], p.transposed)),
                    {"bias": ws.get(f"p{i}_b")},
                )
                if p.split_heads:
                    env[node] = g.call_function(torch.unflatten, (env[node], -1, (-1, p.unit)))
            else:
                env[node] = _clone(g, node, env, plan, r, D)

    with g.inserting_before(m.o_linear):
        if plan.cross:
            # sweep 1: every group's projections; the statistics summed over the groups
            pre = [n for n in region if n not in reduced and n not in after_stats]
            totals: dict[fx.Node, fx.Node] = {}
            for r in range(D):
                project(r, weights(r, 0), pre)
                if primary(r):
                    env_primary = envs[r]
                for c in plan.cross:
                    if shared_kv and c in kv_nodes and not primary(r):
                        continue  # a shared KV head: counted once, by its first group
                    dims, keep = arg(c, 1, "dim"), arg(c, 2, "keepdim", False)
                    part = g.call_function(torch.sum, (envs[r][c.args[0]], dims, keep))
                    totals[c] = (
                        part if c not in totals else g.call_function(torch.add, (totals[c], part))
                    )
            stats: dict[fx.Node, fx.Node] = {}
            for c, kind_ in plan.cross.items():
                stats[c] = totals[c]
                if kind_ == "mean":
                    x_shape = shape(c.args[0])
                    count = math.prod(
                        x_shape[i] for i in reduced_dims(len(x_shape), arg(c, 1, "dim"))
                    )
                    stats[c] = g.call_function(torch.div, (totals[c], count))
            for n in region:
                if n in reduced and n not in stats:
                    stats[n] = _clone(g, n, stats, plan, 0, D)
            rest, second = [n for n in region if n in after_stats], 1
        else:
            rest, second = region, 0
        for r in range(D):
            env = envs[r]
            env.update(stats if plan.cross else {})
            ws = weights(r, second)
            project(r, ws, rest)
            reuse = shared_kv and not primary(r)
            q_r = env[q_in]
            if reuse:
                k_full, v_full = kv_primary
            elif D > 1:
                k_full, v_full = (
                    _async_gather(g, env[root], gather, tag, r)
                    for root, gather in ((m.k_root, k_gather), (m.v_root, v_gather))
                )
            else:
                k_full, v_full = env[m.k_root], env[m.v_root]
            if primary(r):
                env_primary, kv_primary = env, (k_full, v_full)
            if kind == "zigzag_causal":
                att = g.call_function(
                    causal_attention,
                    (q_r, k_full, v_full, key_valid, float(scale), rank, D),
                    dict(attention.kwargs),  # window, document ids, an explicit mask
                )
            elif kind == "sdpa_masked_rows":
                att = g.call_function(
                    sdpa_local_queries, (q_r, k_full, v_full, mask, 0.0, scale, gqa, exact_rows)
                )
            else:
                kw = {
                    "attn_mask": mask,
                    "is_causal": m.is_causal,
                    "scale": scale,
                    "enable_gqa": gqa,
                }
                sdpa = F.scaled_dot_product_attention
                if attention.target is masked_attention:  # exact rows hidden from every key
                    sdpa = masked_attention
                    kw["safe_softmax"] = attention.kwargs.get("safe_softmax", True)
                att = g.call_function(sdpa, (q_r, k_full, v_full), kw)
            att.meta["tspc_role"] = "attention"
            att.meta["tspc_step"] = r
            env[attention] = att
            for node in post:
                env[node] = _clone(g, node, env, plan, r, D)
            o_w = _as_out_in(g, ws["o_w"], m.o_transposed)
            part = g.call_function(F.linear, (env[post[-1]] if post else att, o_w))
            part.meta["tspc_role"] = "partial_output"
            acc = part if acc is None else g.call_function(torch.add, (acc, part))
            for n in escapes:
                escapes[n].append(env[n])
        o_bias = m.o_proj.current_bias()
        out = g.call_function(torch.add, (acc, o_bias)) if o_bias is not None else acc
        for n, per_step in escapes.items():
            # A value the rest of the graph also uses (a KV cache output, say): the groups'
            # parts side by side along the head dimension, each shared KV head once.
            sh = plan.layout[n]
            parts = per_step[::span] if (shared_kv and n in kv_nodes) else per_step
            if len(parts) == 1 or sh is WHOLE:
                cat = parts[0]
            else:
                cat = g.call_function(torch.cat, (parts, sh.dim))
            outside = [u for u in n.users if u not in region_set and u not in ignore_users]
            for u in outside:
                u.replace_input_with(n, cat)
            # Users may precede the schedule (a sliding-window cache slices its keys as soon
            # as they exist): they move after the value that now feeds them.
            sink_after(cat, outside)
    m.o_linear.replace_all_uses_with(out)
    # Remove what the schedule replaced. The old gathers are side-effectful (dead-code
    # elimination keeps them), so they are erased explicitly, users first.
    replaced = region_set | set(m.repeat_nodes) | {m.o_linear, attention}
    replaced |= set(old_gathers) | {n.args[0] for n in old_gathers if _is_gather_wait(n)}
    upstream: list[fx.Node] = []
    for n in sorted(replaced, reverse=True):  # fx nodes order as in the graph: users first
        if not n.users:
            upstream += n.all_input_nodes
            g.erase_node(n)
    erase_unused(g, upstream)
    defer_recompile(gm)  # once for all layers, by the next shape propagation
    return ret


def _rows_numel(p: Projection) -> int:
    """Elements of the weight rows (output features) projection ``p`` uses."""
    return p.rows * math.prod(shape(p.weight)) // shape(p.weight)[p.feature_dim]


def _replicated_kv_weights(g, replicated, projections, r: int, D: int) -> dict[str, fx.Node]:
    """Head group r's rows of K/V weights every rank holds whole: slices of the parameter as
    the graph uses it (after the in-graph gradient sum, where there is one)."""

    def as_used(pnode: fx.Node) -> fx.Node:
        synced = [u for u in pnode.users if u.target is sync_replicated_grad]
        return synced[0] if synced else pnode

    out = {}
    for p in replicated:
        i = projections.index(p)
        a, b = head_rows(p, r, D)
        out[f"p{i}_w"] = g.call_function(torch.narrow, (as_used(p.weight), p.feature_dim, a, b - a))
        if p.bias is not None:
            out[f"p{i}_b"] = g.call_function(torch.narrow, (as_used(p.bias), 0, a, b - a))
    return out


def _as_out_in(g, w: fx.Node, transposed: bool) -> fx.Node:
    """A weight slice as ``F.linear`` takes it (``[out, in]``): a Conv1D's ``[in, out]`` is
    transposed (a view; ``linear`` then runs the same ``addmm`` as the Conv1D did)."""
    return g.call_function(torch.t, (w,)) if transposed else w


def _step_weights(g, r, D, group, tag, pack_node, comps, shapes, numel) -> dict[str, fx.Node]:
    """Nodes for head group r's weights: unpacked from rank r's broadcast, or (D = 1) the
    original parameters, sliced where a fused projection is only partly used."""
    if D > 1:
        # Every rank, the source included, runs the same nodes and uses the broadcast result:
        # graphs must not differ in structure between ranks, or the order in which collectives
        # are issued could differ and deadlock.
        h = g.call_function(
            torch.ops.tspc.broadcast_start.default, (pack_node, r, numel, group.name, D, tag)
        )
        weights = g.call_function(
            torch.ops.tspc.broadcast_wait.default, (h, pack_node, r, numel, group.name, D, tag)
        )
        weights.meta["tspc_role"] = "weight_broadcast"
        weights.meta["tspc_step"] = r
        unpacked = g.call_function(unpack, (weights, shapes))
        return {
            name: g.call_function(operator.getitem, (unpacked, i))
            for i, (name, _, _) in enumerate(comps)
        }
    out = {}
    for name, pnode, spec in comps:
        if spec.start == 0 and spec.stop == shape(pnode)[spec.dim]:
            out[name] = pnode
        else:
            out[name] = g.call_function(
                torch.narrow, (pnode, spec.dim, spec.start, spec.stop - spec.start)
            )
    return out


def _clone(g, node: fx.Node, env: dict, plan: HeadPlan, r: int, D: int) -> fx.Node:
    """Copy a region node for head group r: inputs from this group's copies, head counts in
    its size arguments cut to the group's, outside per-head operands narrowed to the group."""
    local = dict(env)
    for (owner, outside), (dim, sh) in plan.outside_slices.items():
        if owner is node:
            start = r * sh.n_local if sh.n % D == 0 else r * sh.n // D
            local[outside] = g.call_function(
                torch.narrow, (outside, dim, start * sh.inner, sh.n_local * sh.inner)
            )
    new = g.node_copy(node, lambda a: local.get(a, a))
    plan.apply_sizes(node, new)
    return new


def _async_gather(g, local: fx.Node, template: fx.Node, tag: str, r: int) -> fx.Node:
    """All-gather one head group's keys or values, as the sequence pass gathered the whole."""
    _, _x, dim, outer, inner, _rg, gname, world, _tag = template.args
    start = g.call_function(
        torch.ops.tspc.all_gather_start.default,
        (local, dim, outer, inner, True, gname, world, tag),
    )
    wait = g.call_function(
        torch.ops.tspc.all_gather_wait.default,
        (start, local, dim, outer, inner, True, gname, world, tag),
    )
    wait.meta["tspc_role"] = "kv_gather"
    wait.meta["tspc_step"] = r
    unpad = template.meta.get("tspc_unpad")
    if unpad is None:
        return wait
    return g.call_function(unpad.target, (wait, *unpad.args[1:]))


def _is_gather_wait(n: fx.Node) -> bool:
    return n.op == "call_function" and n.target is torch.ops.tspc.all_gather_wait.default
