"""Which values of a matched attention's region are head-local, and how to cut them to one
head group (used by ``passes/rewrite_attention.py``).

The check is a propagation like the sequence one (``passes/layout.py``): from the q/k/v
projections' outputs, every value of the region must carry the head factor whole in one
dimension, and nothing may mix heads. ``HeadPlan`` records each value's head layout and the size
arguments that cut it to a group's heads; a value shared by every group is ``WHOLE``, one computed
from every group together (cross-head q/k norm statistics) is ``REDUCED``. A region that fails
raises ``NotHeadLocal`` with the reason, which the rewrite reports as the skip reason.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from .graph_utils import (
    arg,
    is_getitem,
    op_name,
    reachable,
    shape,
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
    rewrite_sizes,
)
from .match_attention import AttentionMatch, Projection
from .seq_ops import is_elementwise, is_first_arg_only

_VIEWS = ("view", "reshape")
_PERMUTES = ("transpose", "permute", "t", "swapaxes")
_KEEP = ("contiguous", "clone", "to", "float", "half", "bfloat16", "type_as", "detach")


class NotHeadLocal(Exception):
    pass


WHOLE = "whole"  # a value every head group uses unchanged (a single shared KV head)
# A value computed from every head group together and then used by each (OLMo-2's q/k RMSNorm
# statistics: a mean over all heads' features). Computed once, between two sweeps over the
# head groups: the first projects and sums each group's part, the second uses the total.
REDUCED = "reduced"


def local_heads(n: int, world: int) -> int:
    return n // world if n % world == 0 else 1


def head_rows(p: Projection, rank: int, world: int) -> tuple[int, int]:
    """Rows of projection ``p`` that head group ``rank`` uses."""
    n_l = local_heads(p.n_heads, world)
    if p.n_heads % world == 0:
        first = rank * n_l
    else:  # fewer heads than ranks: each group uses one head, shared by D / n groups
        first = rank * p.n_heads // world
    return p.row_start + first * p.unit, p.row_start + (first + n_l) * p.unit


class HeadPlan:
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
        return Sharded(dim, n_heads, local_heads(n_heads, self.world), 1, unit)

    def plan_pre(self, region: list[fx.Node], sources: dict[fx.Node, Projection]) -> None:
        self.allow_cross = True
        for node in region:
            if node in sources:
                p = sources[node]
                if local_heads(p.n_heads, self.world) == p.n_heads:
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
            raise NotHeadLocal(f"'{node.name}' is in the region but has no head-carrying input")
        reduced = [i for i in ins if self.layout[i] is REDUCED]
        if reduced:
            if not is_elementwise(node) and name not in _KEEP:
                raise NotHeadLocal(
                    f"'{node.name}' ({name}) uses a statistic over all heads in a way only "
                    "elementwise ops are known to allow"
                )
            if len(reduced) == len(ins):
                return REDUCED  # computed once, from the totals
        whole = [i for i in ins if self.layout[i] is WHOLE]
        if whole:
            if len(whole) != len(ins):
                raise NotHeadLocal(f"'{node.name}' mixes a shared head with split heads")
            return WHOLE
        x = node.args[0] if node.args else None
        if name in _VIEWS or name in ("flatten", "squeeze", "unsqueeze", "unflatten"):
            sh = self.layout[x]
            out = map_view(shape(x), shape(node), sh)
            if out is None:
                raise NotHeadLocal(f"'{node.name}' ({name}) splits a head")
            if name in _VIEWS:
                self._plan_sizes(node, out)
            elif name == "unflatten":
                dim = arg(node, 1, "dim") % len(shape(x))
                sizes = list(arg(node, 2, "sizes"))
                if dim <= out.dim < dim + len(sizes):
                    g = shape(node)[out.dim]
                    new = rewrite_sizes(sizes, out.dim - dim, g, out.local_size(g))
                    if new is None:
                        raise NotHeadLocal(f"'{node.name}' has an unexpected size argument")
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
                raise NotHeadLocal(f"'{node.name}' indexes with a tensor")
            out = map_getitem(shape(x), node.args[1], self.layout[x])
            if out is None or out == "unknown":
                raise NotHeadLocal(f"'{node.name}' slices across heads")
            return out
        if name in ("split", "chunk", "split_with_sizes", "unbind"):
            sh = self.layout[x]
            nd = len(shape(x))
            dim = arg(node, 2 if name != "unbind" else 1, "dim", 0) % nd
            if dim == sh.dim:
                raise NotHeadLocal(f"'{node.name}' splits across heads")
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
                    raise NotHeadLocal(f"'{node.name}' normalises across heads")
                return sh
            keep = len(shape(node)) == ndim
            out = map_reduce(ndim, dims, keep, sh)
            if out is None:
                if self.allow_cross and name in ("mean", "sum") and len(node.args) <= 3:
                    if not node.kwargs.keys() <= {"dim", "keepdim"}:
                        raise NotHeadLocal(f"'{node.name}' ({name}) reduces across heads")
                    self.cross[node] = name
                    return REDUCED
                raise NotHeadLocal(f"'{node.name}' ({name}) reduces across heads")
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
                raise NotHeadLocal(f"'{node.name}' concatenates values with different head layouts")
            sh = next(iter(lays))
            if sh.dim == dim:
                raise NotHeadLocal(f"'{node.name}' concatenates along heads")
            for t in tensors:
                tv = tensor_val(t)
                if t not in self.layout and tv is not None and tv.numel():
                    raise NotHeadLocal(f"'{node.name}' mixes in a value from outside the region")
            return sh
        if name in ("rms_norm", "layer_norm"):
            # normalises the last len(normalized_shape) dims; its weight and bias span those
            sh = self.layout[x]
            nd = len(shape(x))
            if sh.dim >= nd - len(arg(node, 1, "normalized_shape")):
                raise NotHeadLocal(
                    f"'{node.name}' ({name}) normalises across heads in one fused op (written "
                    "out as pow/mean/rsqrt, as OLMo-2 does, the statistics are summed per group)"
                )
            return sh
        if name == "normalize":  # F.normalize(x, p, dim=1): a p-norm along ``dim``
            sh = self.layout[x]
            if arg(node, 2, "dim", 1) % len(shape(x)) == sh.dim:
                raise NotHeadLocal(f"'{node.name}' normalises across heads")
            return sh
        if name in ("view_as_complex", "view_as_real"):
            # the last dim's pairs as complex numbers and back (Llama-4's RoPE): the other
            # dims keep their places
            sh = self.layout[x]
            if name == "view_as_complex" and sh.dim == len(shape(x)) - 1:
                raise NotHeadLocal(f"'{node.name}' pairs values across heads")
            return sh
        if name == "stack":
            # A new dim inserted into values of one head layout (RoPE by rotate-every-two:
            # ``stack((-x2, x1), -1).flatten(-2)``): heads stay where they were, one further
            # along when the new dim comes before them.
            tensors = list(arg(node, 0, "tensors"))
            lays = {self.layout.get(t) for t in tensors}
            if None in lays or len(lays) != 1:
                raise NotHeadLocal(f"'{node.name}' stacks values with different head layouts")
            sh = next(iter(lays))
            dim = arg(node, 1, "dim", 0) % len(shape(node))
            return sh.with_dim(sh.dim + 1) if dim <= sh.dim else sh
        if name == "linear":
            sh = self.layout[x]
            if sh.dim == len(shape(x)) - 1:
                raise NotHeadLocal(f"'{node.name}' projects across heads")
            for w in tensor_inputs(node)[1:]:
                if w in self.layout:
                    raise NotHeadLocal(f"'{node.name}' uses a per-head value as a weight")
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
                        raise NotHeadLocal(f"'{node.name}' combines differently split heads")
                    target = mapped
            for p in parts:
                if p in self.layout and self.layout[p] is not REDUCED:
                    continue
                ps = shape(p)
                a = target.dim - (out_ndim - len(ps))
                if a >= 0 and ps[a] != 1:
                    if p in self.layout or (target.outer != 1 or ps[a] != shape(node)[target.dim]):
                        raise NotHeadLocal(f"'{node.name}' broadcasts a value across heads")
                    # a per-feature operand (a norm weight over all heads): the group's part
                    self.outside_slices[(node, p)] = (a, target)
            return target
        raise NotHeadLocal(f"'{node.name}' ({name or node.op}) is not known to be head-local")

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
            raise NotHeadLocal(f"'{node.name}' has a size argument that does not match its heads")
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


def head_positions(sh: Sharded, rank: int, world: int) -> list[int]:
    """The global indices of the split dim that ``rank`` holds under ``sh``, in local order:
    the n-factor's part of each outer block, each with its ``inner`` run. With fewer heads
    than ranks each group holds one, shared by D / n groups (as ``head_rows`` cuts them)."""
    if sh.n % world == 0:
        first, count = rank * sh.n_local, sh.n_local
    else:
        first, count = rank * sh.n // world, 1
    return [
        (o * sh.n + h) * sh.inner + i
        for o in range(sh.outer)
        for h in range(first, first + count)
        for i in range(sh.inner)
    ]


def check_heads_align(plan: HeadPlan, query: fx.Node, keys: fx.Node, values: fx.Node) -> None:
    """Each head group's queries must meet the keys and values of their own heads.

    The propagation proves each value head-local, but the attention pairs its operands by
    position: local query head j with local key head j. Where K/V heads are repeated to the
    query heads' count inside the region, the repetition decides which KV head a query head
    reads — Llama's ``repeat_kv`` (``[k0, k0, k1, k1]``) keeps a group's heads together,
    einops' ``repeat('b h n d -> b (r h) n d')`` (x-transformers: ``[k0, k1, k0, k1]``)
    does not, and the groups would silently attend with another head's keys. Fewer K/V heads
    than query heads where the call reads them (Llama's ``repeat_kv`` the schedule dropped,
    SDPA's ``enable_gqa``) are repeated by the schedule and the kernel the interleaved way."""
    lq = plan.layout.get(query)
    if not isinstance(lq, Sharded):
        return
    for what, node in (("queries", query), ("keys", keys), ("values", values)):
        lay = plan.layout.get(node)
        if isinstance(lay, Sharded) and lay.dim != len(shape(node)) - 3:
            # ``view(b, s, d, h).permute(0, 3, 1, 2)`` (einops' '(d h)'): what the projection's
            # head groups cut reaches the call as its head_dim, which it contracts or mixes
            raise NotHeadLocal(
                f"the {what} reach the attention with the projections' head groups in dim "
                f"{lay.dim}, not the heads dim of [..., heads, seq, head_dim]: the model reads "
                "its projections' features in another order than heads-major"
            )
    world = plan.world
    for what, node in (("keys", keys), ("values", values)):
        lk = plan.layout.get(node)
        if not isinstance(lk, Sharded):  # one KV head every group shares, whole
            continue
        if lk.dim != lq.dim or shape(query)[lq.dim] % shape(node)[lk.dim]:
            raise NotHeadLocal(f"the {what}' heads do not line up with the queries' heads")
        repeat = shape(query)[lq.dim] // shape(node)[lk.dim]
        for r in range(world):
            want = head_positions(lq, r, world)  # the query heads of group r, in local order
            have = head_positions(lk, r, world)
            # repeated locally to the group's query heads (fewer KV heads than ranks: a
            # group holds one KV head for fewer query heads than the model repeats it to)
            local = len(want) // len(have) if len(want) % len(have) == 0 else 0
            meets = [p for p in have for _ in range(local)]
            if meets != [p // repeat for p in want]:
                raise NotHeadLocal(
                    f"head group {r}'s query heads {want} would meet the {what} of heads "
                    f"{meets}: the model repeats its key/value heads in an order that does not "
                    "keep a group's heads together (einops' '(r h)' tiles them: query head i "
                    "reads KV head i mod n), so no cut by head groups is exact"
                )


def region_between(sources: list[fx.Node], sinks: list[fx.Node]) -> list[fx.Node]:
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


def plan_heads(m, D, attention, region, sources, projections) -> HeadPlan:
    shared = [p for p in projections if p.key() == m.q.key() == m.k.key() == m.v.key()]
    if not shared:
        plan = HeadPlan(m, D, attention)
        plan.plan_pre(region, sources)
        return plan
    (p,) = shared
    first_error = None
    for n in _unit_counts(p, m.head_dim, D) or [p.n_heads]:
        p.n_heads = n
        plan = HeadPlan(m, D, attention)
        try:
            plan.plan_pre(region, sources)
            return plan
        except NotHeadLocal as e:
            first_error = first_error or e
    if m.q_heads != m.kv_heads:
        # [all q | all k | all v] in one projection (GPT-BigCode's multi-query ``c_attn``): a
        # rank's heads are three row ranges, not one, and no grouping of the rows is head-local
        raise NotHeadLocal(
            f"a fused projection serves q and k/v with different head counts in a layout no "
            f"grouping of its rows cuts per rank ({first_error})"
        )
    raise NotHeadLocal(
        f"{first_error} (the fused q/k/v projection was also tried in every coarser grouping "
        f"of its rows that {D} ranks can share)"
    )


def check_output_columns(plan: HeadPlan, o_input: fx.Node) -> None:
    """The output projection reads head group r's columns as one range ``[r·Hq/D·dv, ...)``:
    exact only when the heads reach its input dim outermost, each head's features together
    (``transpose(1, 2).reshape(b, s, Hq·dv)``). Heads innermost (einops' ``'b h n d -> b n
    (d h)'``) put a group's features in a strided set of columns."""
    lay = plan.layout.get(o_input)
    if not isinstance(lay, Sharded):
        raise NotHeadLocal("the output projection's input carries no head split")
    width = shape(o_input)[-1]
    if lay.dim != len(shape(o_input)) - 1 or lay.outer != 1 or lay.n * lay.inner != width:
        raise NotHeadLocal(
            "the attention output reaches the output projection with its heads not outermost "
            f"in the features (split {lay}): a head group's columns are not one range"
        )


def post_chain(attention: fx.Node, o_linear: fx.Node) -> list[fx.Node]:
    chain = []
    node = attention
    while True:
        users = list(node.users)
        if len(users) != 1:
            raise NotHeadLocal(f"'{node.name}' has {len(users)} users after the attention")
        u = users[0]
        if u is o_linear:
            return chain
        chain.append(u)
        node = u
