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

What to emit is decided first, from numbers only (``passes/attention_plan.py``: the packs, K/V
sharing, sweeps, the predicted bytes), then emitted here. The head-local check
(``passes/head_plan.py``) is a propagation like the sequence one: every
value in the region must carry the head factor whole in one dimension, and nothing may mix
heads. A region that fails the check is left as the sequence pass made it (SP: replicated
weights) and reported as skipped with the reason.
"""

from __future__ import annotations

import math
import operator

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
from .attention_plan import (
    AttentionPlan,
    AttentionRewrite,
    AttentionSpec,
    ProjectionSlots,
    plan_attention,
)
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
    check_heads_align,
    check_output_columns,
    head_rows,
    plan_heads,
    post_chain,
    region_between,
)
from .layout import (
    reduced_dims,
)
from .match_attention import AttentionMatch, Skip, projection_input
from .seq_rules_attention import sdpa_local_queries
from .shard_inputs import ShardInputs


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


def attention_spec(
    info: GraphInfo, m: AttentionMatch, group: TSPGroup, kernel: str, cross: dict
) -> AttentionSpec:
    """The numbers of matched attention ``m`` that its plan is made from."""
    q_key = m.q.key()
    k_local = tensor_val(m.k_root)
    return AttentionSpec(
        module=m.module,
        world=group.size,
        rank=group.rank,
        q_heads=m.q_heads,
        kv_heads=m.kv_heads,
        head_dim=m.head_dim,
        projections=tuple(
            ProjectionSlots(
                n_heads=p.n_heads,
                row_start=p.row_start,
                row_stop=p.row_stop,
                weight_shape=tuple(shape(p.weight)),
                feature_dim=p.feature_dim,
                has_bias=p.bias is not None,
                kv_only=p.key() != q_key,
                fqn=info.params[p.weight].fqn if p.weight in info.params else "",
            )
            for p in m.projections()
        ),
        o_shape=tuple(shape(m.o_weight)),
        o_transposed=m.o_transposed,
        elem_size=tensor_val(m.o_weight).element_size(),
        k_numel=k_local.numel(),
        k_elem_size=k_local.element_size(),
        kernel=kernel,
        cross=tuple((n.name, kind) for n, kind in cross.items()),
        fused_q_heads=m.k.n_heads if m.k.n_heads < m.kv_heads else 0,
        v_head_dim=m.v_head_dim if m.v_head_dim != m.head_dim else 0,
        v_numel=tensor_val(m.v_root).numel(),
    )


def _rewrite(gm, info, m: AttentionMatch, group: TSPGroup, shards: ShardInputs) -> AttentionRewrite:
    """The region's head placement (``head_plan.py``), the schedule's plan
    (``attention_plan.py``: what each step packs and moves), then the graph surgery: the packs,
    each head group's clone of the region, its K/V gathers and attention, the partial outputs'
    sum, the values other code reads, and the removal of what the schedule replaced."""
    g = gm.graph
    D, rank = group.size, group.rank
    attention = m.sdpa
    projections = m.projections()
    sources = {p.out: p for p in projections}

    k_gather = _find_gather(m.k_root) if D > 1 else None
    v_gather = _find_gather(m.v_root) if D > 1 else None
    if D > 1 and (k_gather is None or v_gather is None):
        raise NotHeadLocal("keys/values are not gathered where expected (sequence pass)")

    q_in = arg(attention, 0, "query")
    region = region_between(list(sources), [q_in, m.k_root, m.v_root])
    region_only = set(region)
    heads = plan_heads(m, D, attention, region, sources, projections)
    check_heads_align(heads, q_in, m.k_root, m.v_root)
    post = post_chain(attention, m.o_linear)
    heads.plan_post(post)
    check_output_columns(heads, post[-1] if post else attention)
    kv_nodes = _ancestors_within([m.k_root, m.v_root], region_only) - _ancestors_within(
        [q_in], region_only
    )

    kind, mask, scale, key_valid, exact_rows = _kernel_args(attention, m.head_dim)
    plan = plan_attention(attention_spec(info, m, group, kind, heads.cross))
    shared_kv, span = plan.shared_kv, plan.span
    replicated_kv = [projections[i] for i in plan.replicated_kv]
    params = {f"p{i}_w": p.weight for i, p in enumerate(projections)}
    params |= {f"p{i}_b": p.bias for i, p in enumerate(projections) if p.bias is not None}
    params["o_w"] = m.o_weight

    order = {n: i for i, n in enumerate(g.nodes)}
    first_use = min(region + [m.o_linear], key=order.__getitem__)
    tag = m.module
    pack_nodes = _emit_packs(g, plan, params, shards, first_use, tag) if D > 1 else [None]

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
    reduced = {n for n in region if heads.layout.get(n) is REDUCED}
    after_stats = _descendants_within(list(reduced), region_only) - reduced
    envs: list[dict[fx.Node, fx.Node]] = [{} for _ in range(D)]

    def weights(r: int, k: int) -> dict[str, fx.Node]:
        comps = plan.sweep_part(r, k)
        return _step_weights(g, r, D, group, tag, pack_nodes[k], comps, params)

    def project(r: int, ws: dict[str, fx.Node], nodes: list[fx.Node]) -> None:
        """Head group r's copies of ``nodes`` (region nodes, in graph order)."""
        env = envs[r]
        reuse = plan.reuses_kv(r)
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
                env[node] = _clone(g, node, env, heads, r, D)

    with g.inserting_before(m.o_linear):
        if heads.cross:
            # sweep 1: every group's projections; the statistics summed over the groups
            pre = [n for n in region if n not in reduced and n not in after_stats]
            totals: dict[fx.Node, fx.Node] = {}
            for r in range(D):
                project(r, weights(r, 0), pre)
                if plan.primary(r):
                    env_primary = envs[r]
                for c in heads.cross:
                    if c in kv_nodes and plan.reuses_kv(r):
                        continue  # a shared KV head: counted once, by its first group
                    dims, keep = arg(c, 1, "dim"), arg(c, 2, "keepdim", False)
                    part = g.call_function(torch.sum, (envs[r][c.args[0]], dims, keep))
                    totals[c] = (
                        part if c not in totals else g.call_function(torch.add, (totals[c], part))
                    )
            stats: dict[fx.Node, fx.Node] = {}
            for c, kind_ in heads.cross.items():
                stats[c] = totals[c]
                if kind_ == "mean":
                    x_shape = shape(c.args[0])
                    count = math.prod(
                        x_shape[i] for i in reduced_dims(len(x_shape), arg(c, 1, "dim"))
                    )
                    stats[c] = g.call_function(torch.div, (totals[c], count))
            for n in region:
                if n in reduced and n not in stats:
                    stats[n] = _clone(g, n, stats, heads, 0, D)
            rest, second = [n for n in region if n in after_stats], 1
        else:
            rest, second = region, 0
        for r in range(D):
            env = envs[r]
            env.update(stats if heads.cross else {})
            ws = weights(r, second)
            project(r, ws, rest)
            reuse = plan.reuses_kv(r)
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
            if plan.primary(r):
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
                env[node] = _clone(g, node, env, heads, r, D)
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
            sh = heads.layout[n]
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
    replaced = region_set | set(m.repeat_nodes) | {m.o_linear, attention}
    _erase_replaced(g, replaced, old_gathers)
    defer_recompile(gm)  # once for all layers, by the next shape propagation
    return plan.report


def _kernel_args(attention: fx.Node, head_dim: int):
    """The attention's kernel (zigzag_causal | sdpa_masked_rows | sdpa) and its arguments as
    the sequence pass left them: mask, scale, the keys' valid length, exact masked rows."""
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
        scale = default_scale(head_dim)
    return kind, mask, scale, key_valid, exact_rows


def _emit_packs(g, plan: AttentionPlan, params, shards: ShardInputs, first_use, tag: str):
    """Declare every rank's slices of each packed parameter (the pack of step r is rank r's)
    and emit this rank's packs, one per sweep, before the layer's first node."""
    D, rank = plan.spec.world, plan.spec.rank
    layouts: dict[fx.Node, list[list[ShardSpec]]] = {}
    for r, comps in enumerate(plan.steps):
        for c in comps:
            layouts.setdefault(params[c.name], [[] for _ in range(D)])[r].append(c.spec)
    for pnode, layout in layouts.items():
        shards.declare(pnode, layout)
    pack_nodes = []
    with g.inserting_before(first_use):
        for k in range(plan.sweeps):
            shard_nodes = [
                shards.get(params[c.name], c.spec, f"tsp_{tag.replace('.', '_')}_{c.name}")
                for c in plan.sweep_part(rank, k)
            ]
            pack_nodes.append(g.call_function(pack, (shard_nodes,)))
    return pack_nodes


def _erase_replaced(g, replaced: set[fx.Node], old_gathers: list[fx.Node]) -> None:
    """Remove what the schedule replaced. The old gathers are side-effectful (dead-code
    elimination keeps them), so they are erased explicitly, users first."""
    replaced = replaced | set(old_gathers)
    replaced |= {n.args[0] for n in old_gathers if _is_gather_wait(n)}
    upstream: list[fx.Node] = []
    for n in sorted(replaced, reverse=True):  # fx nodes order as in the graph: users first
        if not n.users:
            upstream += n.all_input_nodes
            g.erase_node(n)
    erase_unused(g, upstream)


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


def _step_weights(g, r, D, group, tag, pack_node, comps, params) -> dict[str, fx.Node]:
    """Nodes for head group r's weights: unpacked from rank r's broadcast, or (D = 1) the
    original parameters (``params``, by component name), sliced where a fused projection is
    only partly used."""
    if D > 1:
        # Every rank, the source included, runs the same nodes and uses the broadcast result,
        # so every rank issues the same collectives in the same order (else they deadlock).
        # The backward graphs do differ between ranks: the source alone keeps the reduced
        # weight gradient (runtime/comm.py) — but their collectives still run in one order.
        numel = sum(c.numel for c in comps)
        h = g.call_function(
            torch.ops.tspc.broadcast_start.default, (pack_node, r, numel, group.name, D, tag)
        )
        weights = g.call_function(
            torch.ops.tspc.broadcast_wait.default, (h, pack_node, r, numel, group.name, D, tag)
        )
        weights.meta["tspc_role"] = "weight_broadcast"
        weights.meta["tspc_step"] = r
        unpacked = g.call_function(unpack, (weights, [c.shape for c in comps]))
        return {
            c.name: g.call_function(operator.getitem, (unpacked, i)) for i, c in enumerate(comps)
        }
    out = {}
    for c in comps:
        name, pnode, spec = c.name, params[c.name], c.spec
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
