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

The head-local check is a propagation like the sequence one (``passes/layout.py``): every value
in the region must carry the head factor whole in one dimension, and nothing may mix heads. A
region that fails the check is left as the sequence pass made it (SP: replicated weights) and
reported as skipped with the reason.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn.functional as F

from tspc.ops.zigzag_attention import causal_attention, default_scale
from tspc.runtime.autograd_glue import sync_replicated_grad
from tspc.runtime.group import TSPGroup
from tspc.runtime.packing import pack, unpack
from tspc.runtime.shard_store import ShardSpec

from .analyse import GraphInfo, defer_recompile
from .graph_utils import (
    arg,
    erase_unused,
    is_getitem,
    op_name,
    reachable,
    shape,
    sink_after,
    tensor_inputs,
    tensor_val,
)
from .layout import (
    Sharded,
    map_broadcast,
    map_getitem,
    map_permute,
    map_reduce,
    map_transpose,
    map_view,
    reduced_dims,
    rewrite_sizes,
)
from .match_attention import AttentionMatch, Projection, Skip, projection_input
from .seq_ops import is_elementwise, is_first_arg_only
from .seq_rules_attention import sdpa_local_queries
from .shard_inputs import ShardInputs

_VIEWS = ("view", "reshape")
_PERMUTES = ("transpose", "permute", "t", "swapaxes")
_KEEP = ("contiguous", "clone", "to", "float", "half", "bfloat16", "type_as", "detach")


class _NotHeadLocal(Exception):
    pass


WHOLE = "whole"  # a value every head group uses unchanged (a single shared KV head)
# A value computed from every head group together and then used by each (OLMo-2's q/k RMSNorm
# statistics: a mean over all heads' features). Computed once, between two sweeps over the
# head groups: the first projects and sums each group's part, the second uses the total.
REDUCED = "reduced"


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


def _local_heads(n: int, world: int) -> int:
    return n // world if n % world == 0 else 1


def _head_rows(p: Projection, rank: int, world: int) -> tuple[int, int]:
    """Rows of projection ``p`` that head group ``rank`` uses."""
    n_l = _local_heads(p.n_heads, world)
    if p.n_heads % world == 0:
        first = rank * n_l
    else:  # fewer heads than ranks: each group uses one head, shared by D / n groups
        first = rank * p.n_heads // world
    return p.row_start + first * p.unit, p.row_start + (first + n_l) * p.unit


class _HeadPlan:
    """Head placement of every value in the region, and the argument rewrites that cut it."""

    def __init__(self, match: AttentionMatch, world: int, attention_node: fx.Node):
        self.m = match
        self.world = world
        self.layout: dict[fx.Node, Sharded] = {}
        self.sizes: dict[fx.Node, tuple] = {}  # node -> (arg index or kw name, new sizes)
        self.outside_slices: dict[tuple[fx.Node, fx.Node], tuple[int, Sharded]] = {}
        self.attention = attention_node
        # reductions over the head dim (sum/mean), by node: each becomes a sum of per-group
        # partial sums; only before the attention (the keys must be final when gathered)
        self.cross: dict[fx.Node, str] = {}
        self.allow_cross = False

    def sharded(self, n_heads: int, unit: int, dim: int) -> Sharded:
        return Sharded(dim, n_heads, _local_heads(n_heads, self.world), 1, unit)

    def plan_pre(self, region: list[fx.Node], sources: dict[fx.Node, Projection]) -> None:
        self.allow_cross = True
        for node in region:
            if node in sources:
                p = sources[node]
                if _local_heads(p.n_heads, self.world) == p.n_heads:
                    # a single KV head shared by every group: nothing of it to cut
                    self.layout[node] = WHOLE
                elif p.split_heads:  # [..., heads, unit]
                    self.layout[node] = self.sharded(p.n_heads, 1, len(shape(node)) - 2)
                else:
                    self.layout[node] = self.sharded(p.n_heads, p.unit, len(shape(node)) - 1)
                continue
            self.layout[node] = self._propagate(node, region)

    def plan_post(self, chain: list[fx.Node]) -> None:
        self.allow_cross = False
        m = self.m
        q_dim = len(shape(self.attention)) - 3
        self.layout[self.attention] = self.sharded(m.q_heads, 1, q_dim)
        for node in chain:
            self.layout[node] = self._propagate(node, chain)

    def _propagate(self, node: fx.Node, region) -> Sharded:
        name = op_name(node) or ""
        ins = [i for i in tensor_inputs(node, include_tuples=True) if i in self.layout]
        if not ins:
            raise _NotHeadLocal(f"'{node.name}' is in the region but has no head-carrying input")
        reduced = [i for i in ins if self.layout[i] is REDUCED]
        if reduced:
            if not is_elementwise(node) and name not in _KEEP:
                raise _NotHeadLocal(
                    f"'{node.name}' ({name}) uses a statistic over all heads in a way only "
                    "elementwise ops are known to allow"
                )
            if len(reduced) == len(ins):
                return REDUCED  # computed once, from the totals
        whole = [i for i in ins if self.layout[i] is WHOLE]
        if whole:
            if len(whole) != len(ins):
                raise _NotHeadLocal(f"'{node.name}' mixes a shared head with split heads")
            return WHOLE
        x = node.args[0] if node.args else None
        if name in _VIEWS or name in ("flatten", "squeeze", "unsqueeze", "unflatten"):
            sh = self.layout[x]
            out = map_view(shape(x), shape(node), sh)
            if out is None:
                raise _NotHeadLocal(f"'{node.name}' ({name}) splits a head")
            if name in _VIEWS:
                self._plan_sizes(node, out)
            elif name == "unflatten":
                dim = arg(node, 1, "dim") % len(shape(x))
                sizes = list(arg(node, 2, "sizes"))
                if dim <= out.dim < dim + len(sizes):
                    g = shape(node)[out.dim]
                    new = rewrite_sizes(sizes, out.dim - dim, g, out.local_size(g))
                    if new is None:
                        raise _NotHeadLocal(f"'{node.name}' has an unexpected size argument")
                    self.sizes[node] = ("unflatten", tuple(new))
            return out
        if name in _PERMUTES:
            sh = self.layout[x]
            n = len(shape(x))
            if name == "permute":
                dims = node.args[1] if isinstance(node.args[1], (tuple, list)) else node.args[1:]
                return map_permute(list(dims), sh)
            if name == "t":
                return map_transpose(n, 0, 1, sh) if n == 2 else sh
            return map_transpose(n, arg(node, 1, "dim0"), arg(node, 2, "dim1"), sh)
        if name in ("expand", "broadcast_to"):
            sh = self.layout[x]
            out = map_broadcast(len(shape(x)), len(shape(node)), sh)
            self._plan_sizes(node, out)
            return out
        if is_getitem(node) and isinstance(self.layout.get(x), tuple):
            return self.layout[x][node.args[1]]
        if is_getitem(node):
            if not isinstance(node.args[1], (tuple, slice, int, type(None), type(Ellipsis))):
                raise _NotHeadLocal(f"'{node.name}' indexes with a tensor")
            out = map_getitem(shape(x), node.args[1], self.layout[x])
            if out is None or out == "unknown":
                raise _NotHeadLocal(f"'{node.name}' slices across heads")
            return out
        if name in ("split", "chunk", "split_with_sizes", "unbind"):
            sh = self.layout[x]
            nd = len(shape(x))
            dim = arg(node, 2 if name != "unbind" else 1, "dim", 0) % nd
            if dim == sh.dim:
                raise _NotHeadLocal(f"'{node.name}' splits across heads")
            parts = len(node.meta.get("val", ()))
            if name == "unbind":
                sh = sh.with_dim(sh.dim - (1 if dim < sh.dim else 0))
            return (sh,) * parts
        if name in ("mean", "sum", "amax", "amin", "var", "std", "norm", "softmax", "log_softmax"):
            sh = self.layout[x]
            ndim = len(shape(x))
            dims = arg(node, 1, "dim")
            if name in ("softmax", "log_softmax"):
                if dims % ndim == sh.dim:
                    raise _NotHeadLocal(f"'{node.name}' normalises across heads")
                return sh
            keep = len(shape(node)) == ndim
            out = map_reduce(ndim, dims, keep, sh)
            if out is None:
                if self.allow_cross and name in ("mean", "sum") and len(node.args) <= 3:
                    if not node.kwargs.keys() <= {"dim", "keepdim"}:
                        raise _NotHeadLocal(f"'{node.name}' ({name}) reduces across heads")
                    self.cross[node] = name
                    return REDUCED
                raise _NotHeadLocal(f"'{node.name}' ({name}) reduces across heads")
            return out
        if name == "cat":
            tensors = list(arg(node, 0, "tensors"))
            dim = arg(node, 1, "dim", 0) % len(shape(node))
            lays = {
                self.layout.get(t)
                for t in tensors
                if tensor_val(t) is not None and tensor_val(t).numel()
            }
            lays.discard(None)
            if len(lays) != 1:
                raise _NotHeadLocal(
                    f"'{node.name}' concatenates values with different head layouts"
                )
            sh = next(iter(lays))
            if sh.dim == dim:
                raise _NotHeadLocal(f"'{node.name}' concatenates along heads")
            for t in tensors:
                tv = tensor_val(t)
                if t not in self.layout and tv is not None and tv.numel():
                    raise _NotHeadLocal(f"'{node.name}' mixes in a value from outside the region")
            return sh
        if name in ("rms_norm", "layer_norm"):
            # normalises the last len(normalized_shape) dims; its weight and bias span those
            sh = self.layout[x]
            nd = len(shape(x))
            if sh.dim >= nd - len(arg(node, 1, "normalized_shape")):
                raise _NotHeadLocal(
                    f"'{node.name}' ({name}) normalises across heads in one fused op (written "
                    "out as pow/mean/rsqrt, as OLMo-2 does, the statistics are summed per group)"
                )
            return sh
        if name in ("view_as_complex", "view_as_real"):
            # the last dim's pairs as complex numbers and back (Llama-4's RoPE): the other
            # dims keep their places
            sh = self.layout[x]
            if name == "view_as_complex" and sh.dim == len(shape(x)) - 1:
                raise _NotHeadLocal(f"'{node.name}' pairs values across heads")
            return sh
        if name == "stack":
            # A new dim inserted into values of one head layout (RoPE by rotate-every-two:
            # ``stack((-x2, x1), -1).flatten(-2)``): heads stay where they were, one further
            # along when the new dim comes before them.
            tensors = list(arg(node, 0, "tensors"))
            lays = {self.layout.get(t) for t in tensors}
            if None in lays or len(lays) != 1:
                raise _NotHeadLocal(f"'{node.name}' stacks values with different head layouts")
            sh = next(iter(lays))
            dim = arg(node, 1, "dim", 0) % len(shape(node))
            return sh.with_dim(sh.dim + 1) if dim <= sh.dim else sh
        if name == "linear":
            sh = self.layout[x]
            if sh.dim == len(shape(x)) - 1:
                raise _NotHeadLocal(f"'{node.name}' projects across heads")
            for w in tensor_inputs(node)[1:]:
                if w in self.layout:
                    raise _NotHeadLocal(f"'{node.name}' uses a per-head value as a weight")
            return sh
        if is_elementwise(node) or name in _KEEP:
            out_ndim = len(shape(node))
            parts = tensor_inputs(node)
            if is_first_arg_only(node):
                parts = parts[:1]
            target = None
            for p in parts:
                if p in self.layout and self.layout[p] is not REDUCED:
                    mapped = map_broadcast(len(shape(p)), out_ndim, self.layout[p])
                    if target is not None and mapped != target:
                        raise _NotHeadLocal(f"'{node.name}' combines differently split heads")
                    target = mapped
            for p in parts:
                if p in self.layout and self.layout[p] is not REDUCED:
                    continue
                ps = shape(p)
                a = target.dim - (out_ndim - len(ps))
                if a >= 0 and ps[a] != 1:
                    if p in self.layout or (target.outer != 1 or ps[a] != shape(node)[target.dim]):
                        raise _NotHeadLocal(f"'{node.name}' broadcasts a value across heads")
                    # a per-feature operand (a norm weight over all heads): the group's part
                    self.outside_slices[(node, p)] = (a, target)
            return target
        raise _NotHeadLocal(f"'{node.name}' ({name or node.op}) is not known to be head-local")

    def _plan_sizes(self, node: fx.Node, out: Sharded) -> None:
        g = shape(node)[out.dim]
        if len(node.args) >= 2 and isinstance(node.args[1], (tuple, list, torch.Size)):
            sizes, where = list(node.args[1]), "tuple"
        elif len(node.args) >= 2:
            sizes, where = list(node.args[1:]), "varargs"
        else:
            key = "size" if "size" in node.kwargs else "shape"
            sizes, where = list(node.kwargs.get(key, ())), key
        new = rewrite_sizes(sizes, out.dim, g, out.local_size(g))
        if new is None:
            raise _NotHeadLocal(f"'{node.name}' has a size argument that does not match its heads")
        self.sizes[node] = (where, tuple(new))

    def apply_sizes(self, orig: fx.Node, new: fx.Node) -> None:
        if orig not in self.sizes:
            return
        where, sizes = self.sizes[orig]
        if where == "tuple":
            new.args = (new.args[0], sizes, *new.args[2:])
        elif where == "varargs":
            new.args = (new.args[0], *sizes)
        elif where == "unflatten":
            args = list(new.args)
            if len(args) > 2:
                args[2] = sizes
                new.args = tuple(args)
            else:
                new.kwargs = {**new.kwargs, "sizes": sizes}
        else:
            new.kwargs = {**new.kwargs, where: sizes}


def _region(sources: list[fx.Node], sinks: list[fx.Node]) -> list[fx.Node]:
    """Nodes on a path from a source to a sink, in graph order."""
    nodes = reachable(sinks, forward=False, within=reachable(sources))
    order = {n: i for i, n in enumerate(sources[0].graph.nodes)}
    return sorted(nodes, key=order.__getitem__)


def _unit_counts(p: Projection, head_dim: int, world: int) -> list[int]:
    """Head-group units a fused projection serving q, k and v may be cut into, most first.

    Its rows are counted in q heads at first; a layout that groups rows otherwise (Falcon's
    ``new_decoder_architecture``: per KV group, its q heads then one k and one v head) is cut
    at the coarser units its reshapes keep whole. Only counts every rank can get a share of."""
    widths = p.rows // head_dim
    return [
        n
        for n in range(min(p.n_heads, widths), 0, -1)
        if widths % n == 0 and n % world == 0 and p.rows % n == 0
    ]


def _plan_heads(m, D, attention, region, sources, projections) -> _HeadPlan:
    shared = [p for p in projections if p.key() == m.q.key() == m.k.key() == m.v.key()]
    if not shared:
        plan = _HeadPlan(m, D, attention)
        plan.plan_pre(region, sources)
        return plan
    (p,) = shared
    first_error = None
    for n in _unit_counts(p, m.head_dim, D) or [p.n_heads]:
        p.n_heads = n
        plan = _HeadPlan(m, D, attention)
        try:
            plan.plan_pre(region, sources)
            return plan
        except _NotHeadLocal as e:
            first_error = first_error or e
    raise _NotHeadLocal(
        f"{first_error} (the fused q/k/v projection was also tried in every coarser grouping "
        f"of its rows that {D} ranks can share)"
    )


def _post_chain(attention: fx.Node, o_linear: fx.Node) -> list[fx.Node]:
    chain = []
    node = attention
    while True:
        users = list(node.users)
        if len(users) != 1:
            raise _NotHeadLocal(f"'{node.name}' has {len(users)} users after the attention")
        u = users[0]
        if u is o_linear:
            return chain
        chain.append(u)
        node = u


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
    except _NotHeadLocal as e:
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
        raise _NotHeadLocal("keys/values are not gathered where expected (sequence pass)")

    q_in = arg(attention, 0, "query")
    region = _region(list(sources), [q_in, m.k_root, m.v_root])
    region_only = set(region)
    plan = _plan_heads(m, D, attention, region, sources, projections)
    post = _post_chain(attention, m.o_linear)
    plan.plan_post(post)
    kv_nodes = _ancestors_within([m.k_root, m.v_root], region_only) - _ancestors_within(
        [q_in], region_only
    )

    # Attention arguments as the sequence pass left them.
    key_valid = None
    if attention.target is causal_attention:
        kind, mask, scale = "zigzag_causal", None, attention.args[4]
        key_valid = attention.args[3]
    elif attention.target is sdpa_local_queries:
        kind, mask, scale = "sdpa_masked_rows", attention.args[3], attention.args[5]
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
            a, b = _head_rows(p, r, D)
            out.append((f"p{i}_w", p.weight, ShardSpec(p.feature_dim, a, b)))
            if p.bias is not None:
                out.append((f"p{i}_b", p.bias, ShardSpec(0, a, b)))
        hq_l = m.q_heads // D
        o_in_dim = 0 if m.o_transposed else 1  # the weight dim of the heads' features
        out.append(("o_w", m.o_weight, ShardSpec(o_in_dim, r * hq_l * d, (r + 1) * hq_l * d)))
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
    k_local = tensor_val(m.k_root)
    kv_group_bytes = (
        k_local.numel() // m.kv_heads * _local_heads(m.kv_heads, D) * (k_local.element_size())
    )
    ret = AttentionRewrite(
        module=m.module,
        steps=D * len(sweeps),
        broadcasts=D * len(sweeps) if D > 1 else 0,
        kv_gathers=2 * n_kv_groups if D > 1 else 0,
        local_heads=m.q_heads // D,
        local_kv_heads=_local_heads(m.kv_heads, D),
        kernel=kind,
        shard_numel=shard_numel,
        predicted_recv_bytes=(
            sum(n for r, n in enumerate(step_numel) if r != rank) * elem
            + 2 * n_kv_groups * (D - 1) * kv_group_bytes
        )
        if D > 1
        else 0,
    )
    fused = m.q.key() == m.k.key() == m.v.key()
    if fused and m.q.n_heads < m.kv_heads and D > 1:
        # Falcon's grouped layout: the KV heads are expanded (broadcast_to) before RoPE, so
        # the keys the schedule gathers already have the query heads' count
        kv_bytes = 2 * n_kv_groups * (D - 1) * kv_group_bytes
        extra = kv_bytes - kv_bytes * m.q.n_heads // m.kv_heads
        ret.model_kv_heads = m.q.n_heads
        ret.notes.append(
            f"the model expands its {m.q.n_heads} K/V heads to {m.kv_heads} before the "
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
                    sdpa_local_queries, (q_r, k_full, v_full, mask, 0.0, scale, gqa)
                )
            else:
                att = g.call_function(
                    F.scaled_dot_product_attention,
                    (q_r, k_full, v_full),
                    {
                        "attn_mask": mask,
                        "is_causal": m.is_causal,
                        "scale": scale,
                        "enable_gqa": gqa,
                    },
                )
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
        a, b = _head_rows(p, r, D)
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


def _clone(g, node: fx.Node, env: dict, plan: _HeadPlan, r: int, D: int) -> fx.Node:
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
