"""Pass 2a — match attention: find self-attention blocks the TSP broadcast schedule can run.

Anchored on ``F.scaled_dot_product_attention``. From each call the matcher walks back to the
projections that produce q, k and v (a parameter projection in any spelling ``passes/projection.py``
knows: ``F.linear``, GPT-2's Conv1D ``addmm`` with a ``[in, out]`` weight, Falcon's ``x @ W.T``;
possibly an output-feature slice of a fused QKV projection, seen through reshapes that keep the
feature dim), recognises grouped-query head repetition between the keys/values and
the call (dropped by the schedule, which repeats heads itself), and walks forward to the output
projection. Whatever lies in between — reshapes, RoPE, q/k norms, biases — is left as it is and
later run once per head group; ``rewrite_attention`` checks that it really is head-local.

Every SDPA call yields either an ``AttentionMatch`` or a ``Skip`` with the reason, so a model
whose attention is not rewritten says so.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch.fx as fx

from tspc.runtime.errors import TSPConfigError, describe_error

from .analyse import GraphInfo
from .elementwise import is_reshape
from .gqa import NoMatch, head_repeat_chain, projected_kv_heads
from .graph_utils import (
    arg,
    backward_reach,
    calls_named,
    is_getitem,
    node_module_fqn,
    op_name,
    projection_module,
    shape,
    tensor_inputs,
)
from .held_whole import heads_fix
from .projection import Linear, as_linear


@dataclass
class Skip:
    kind: str  # "attention" | "mlp"
    module: str
    reason: str
    # the exception, when matching or rewriting the module raised (a tspc bug, warned about),
    # rather than a reason the module's form gives
    error: BaseException | None = None
    fix: str = ""  # what the user can change to have it sharded (another D), if anything
    anchor: fx.Node | None = None  # the attention call / the MLP's down projection (census)


def failed(kind: str, module: str, stage: str, error: BaseException) -> Skip:
    """The skip of a module whose ``stage`` ("match") raised ``error``: that module alone is
    left as it was (matching changes nothing in the graph)."""
    return Skip(kind, module, f"{stage} failed: {describe_error(error)}", error)


@dataclass
class Projection:
    """``x @ weight[rows].T (+ bias[rows])`` — a whole linear layer or a row slice of a fused one.

    "Rows" are output features: rows of a ``[out, in]`` weight, columns of a ``transposed``
    (Conv1D, ``[in, out]``) one."""

    linear: fx.Node  # the projection node (linear, addmm, matmul)
    weight: fx.Node
    bias: fx.Node | None
    row_start: int
    row_stop: int
    out: fx.Node  # the node whose value this projection is (the linear, or its slice)
    n_heads: int = 0
    transposed: bool = False
    # The projection reads its tokens flattened to 2-D (Conv1D: ``x.view(-1, h)``) and its
    # output is read back at x's leading shape: each head group's projection reads x itself.
    unflatten_input: bool = False
    proj: Linear | None = None
    # ``out`` holds the features split into [..., heads, unit] (Falcon's multi-query
    # ``qkv.view(B, S, heads + 2, d)[..., :-2, :]``): heads in the second-to-last dim
    split_heads: bool = False

    @property
    def feature_dim(self) -> int:
        """The weight dim that holds the output features."""
        return 1 if self.transposed else 0

    @property
    def rows(self) -> int:
        return self.row_stop - self.row_start

    @property
    def unit(self) -> int:
        """Rows per head."""
        return self.rows // self.n_heads

    def key(self) -> tuple:
        return (self.linear, self.row_start, self.row_stop)


@dataclass
class AttentionMatch:
    module: str
    sdpa: fx.Node
    x: fx.Node
    q: Projection
    k: Projection
    v: Projection
    o_linear: fx.Node
    o_weight: fx.Node
    o_bias: fx.Node | None
    q_heads: int
    kv_heads: int
    head_dim: int
    seq_len: int
    k_root: fx.Node  # keys after the last head-local op, before any GQA head repetition
    v_root: fx.Node
    repeat_nodes: list[fx.Node] = field(default_factory=list)
    is_causal: bool = False
    mask: fx.Node | None = None
    scale: float | None = None
    o_proj: Linear | None = None  # the output projection as a Linear (orientation, bias)
    v_head_dim: int = 0  # the values' head size (SDPA allows one unlike q's and k's)

    @property
    def o_transposed(self) -> bool:
        """The output projection's weight is ``[in, out]`` (Conv1D)."""
        return self.o_proj is not None and self.o_proj.transposed

    def projections(self) -> list[Projection]:
        """Distinct projections (a fused QKV projection appears once)."""
        out: dict[tuple, Projection] = {}
        for p in (self.q, self.k, self.v):
            out.setdefault(p.key(), p)
        return list(out.values())


SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def sdpa_args(node: fx.Node) -> dict:
    """SDPA's arguments by name; also for ``causal_attention`` (what classify_masks emits)."""
    from tspc.ops.zigzag_attention import causal_attention

    if node.target is causal_attention:
        q, k, v, key_valid, scale = node.args[:5]
        return {
            "query": q,
            "key": k,
            "value": v,
            "attn_mask": None,
            "dropout_p": 0.0,
            "is_causal": True,
            "scale": scale,
            "enable_gqa": True,
            "key_valid": key_valid,
            "window": node.kwargs.get("window"),
            "doc_ids": node.kwargs.get("doc_ids"),
            "dense_mask": node.kwargs.get("dense_mask"),
            "masked_value": node.kwargs.get("masked_value"),
            "safe_softmax": node.kwargs.get("safe_softmax", True),
        }
    defaults = (None, None, None, None, 0.0, False, None, False)
    out = {name: arg(node, i, name, d) for i, (name, d) in enumerate(zip(SDPA_ARGS, defaults))}
    out["key_valid"] = out["window"] = out["doc_ids"] = out["dense_mask"] = None
    out["masked_value"] = None
    # masked_attention (SDPA's arguments): eager code's softmax for rows hidden from every key
    out["safe_softmax"] = node.kwargs.get("safe_softmax", True)
    return out


_NoMatch = NoMatch  # what the user can change (passes/held_whole.py) is its ``fix``


def _param_linear(node: fx.Node, params) -> bool:
    return as_linear(node, params) is not None


# products that project by a parameter of any rank; ``as_linear`` reads only 2-D weights
_CONTRACTIONS = ("einsum", "tensordot", "matmul", "bmm", "baddbmm", "mm", "linear", "__matmul__")


def _unshardable_projection(n: fx.Node, params) -> str:
    """Why ``n`` projects by a parameter the schedules cannot cut (an ``einsum`` over a fused
    ``[3, heads, head_dim, dim]`` weight), or "". Walking back past such a node would reach an
    earlier layer's projection and name the wrong module."""
    for i in n.all_input_nodes:
        if i not in params:
            continue
        nd = len(shape(i))
        if nd >= 3 or (nd == 2 and op_name(n) in _CONTRACTIONS):
            return (
                f"is projected by '{op_name(n)}' with the {nd}-D parameter {params[i].fqn}: the "
                "schedules shard projections by 2-D weights (linear, addmm, matmul or a "
                "two-operand einsum over a 2-D weight)"
            )
    return ""


def _find_projection(start: fx.Node, params, what: str) -> tuple[fx.Node, list[fx.Node]]:
    """The single parameter ``linear`` that ``start`` is computed from (not looking past it)."""
    found: list[fx.Node] = []
    reasons: list[str] = []
    seen = {start}
    queue = deque([start])
    while queue:
        n = queue.popleft()
        if _param_linear(n, params):
            found.append(n)
            continue
        if n.op in ("placeholder", "get_attr"):
            continue
        stop = _unshardable_projection(n, params)
        if stop:  # not walked past: what lies behind it belongs to another projection
            reasons.append(stop)
            continue
        for i in tensor_inputs(n, include_tuples=True):
            if i not in seen:
                seen.add(i)
                queue.append(i)
    if not found and reasons:
        raise _NoMatch(f"{what} {reasons[0]}")
    if len(found) != 1:
        raise _NoMatch(
            f"{what} is computed from {len(found)} parameter projections (expected exactly one)"
        )
    return found[0], []


def _forward_reach(src: fx.Node, limit: set[fx.Node]) -> set[fx.Node]:
    seen = {src}
    queue = deque([src])
    while queue:
        n = queue.popleft()
        for u in n.users:
            if u in limit and u not in seen:
                seen.add(u)
                queue.append(u)
    return seen


def _projection_rows(linear: fx.Node, target: fx.Node, params) -> Projection:
    """Which output features of projection ``linear`` reach ``target``: all of them, or a
    last-dim slice of a fused projection (``qkv[..., a:b]``, ``qkv.narrow(-1, a, n)``, or an
    item of split/chunk), also after reshapes that keep the last dim (Conv1D's
    ``addmm(...).view(B, S, 3h)``)."""
    lin = as_linear(linear, params)
    w, b = lin.weight, lin.bias
    out_features = lin.out_features
    on_path = backward_reach(target, linear)

    def whole() -> Projection:
        return _oriented(Projection(linear, w, b, 0, out_features, linear), lin, linear)

    def part(start: int, stop: int, out: fx.Node) -> Projection:
        return _oriented(Projection(linear, w, b, start, stop, out), lin, out)

    src = linear
    while True:
        users = [u for u in src.users if u in on_path]
        if len(users) != 1 or not (is_reshape(users[0]) and users[0] is not target):
            break
        src = users[0]  # a leading-dims reshape: the features stay in the last dim
    users = [u for u in src.users if u in on_path]
    if len(users) != 1:
        return whole()
    u = users[0]
    ndim = len(shape(src))
    sv = shape(u) if op_name(u) in ("view", "reshape") else ()
    if (
        len(sv) == ndim + 1
        and tuple(sv[:-2]) == tuple(shape(src)[:-1])
        and sv[-2] * sv[-1] == out_features
    ):
        # the features split into [units, unit]; a slice or one-element list of units, or an
        # item of a split along the units (Falcon's multi-query ``split([heads, 1, 1], -2)``)
        items = [g for g in u.users if g in on_path]
        sel = None
        if len(items) == 1 and is_getitem(items[0]):
            sel = _unit_selection(items[0].args[1], len(sv), sv[-2])
            out = items[0]
        elif (
            len(items) == 1
            and op_name(items[0]) in ("split", "split_with_sizes")
            and arg(items[0], 2, "dim", 0) % len(sv) == len(sv) - 2
        ):
            got = [g for g in items[0].users if is_getitem(g) and g in on_path]
            if len(got) == 1:
                sizes = _split_sizes(items[0], sv[-2])
                i = got[0].args[1]
                sel, out = (sum(sizes[:i]), sum(sizes[: i + 1])), got[0]
        if sel is not None:
            p = Projection(linear, w, b, sel[0] * sv[-1], sel[1] * sv[-1], out)
            p.split_heads = True
            return _oriented(p, lin, out)
    if is_getitem(u) and isinstance(u.args[1], tuple):
        idx = u.args[1]
        last = idx[-1] if idx and idx[-1] is not Ellipsis else None
        leading = idx[:-1]
        lead_ok = all(i is Ellipsis or i == slice(None) for i in leading) and (
            Ellipsis in leading or len(idx) == ndim
        )
        if isinstance(last, slice) and lead_ok and last.step in (None, 1):
            start = last.start or 0
            stop = out_features if last.stop is None else min(last.stop, out_features)
            if start < 0 or stop < 0:
                raise _NoMatch("negative slice of a fused projection")
            return part(start, stop, u)
    if op_name(u) == "narrow" and arg(u, 1, "dim") in (-1, ndim - 1):
        start, length = arg(u, 2, "start"), arg(u, 3, "length")
        return part(start, start + length, u)
    if op_name(u) in ("split", "chunk", "split_with_sizes") and arg(u, 2, "dim", 0) in (
        -1,
        ndim - 1,
    ):
        items = [g for g in u.users if is_getitem(g) and g in on_path]
        if len(items) == 1:
            i = items[0].args[1]
            sizes = [shape_of_item for shape_of_item in _split_sizes(u, out_features)]
            start = sum(sizes[:i])
            return part(start, start + sizes[i], items[0])
    return whole()


def _unit_selection(index, ndim: int, n: int) -> tuple[int, int] | None:
    """[a, b) when ``index`` picks a range of dim -2 of an ``ndim``-D tensor (whose size is
    ``n``) and takes every other dim whole: ``x[..., a:b, :]`` or ``x[..., [i], :]``."""
    items = list(index) if isinstance(index, tuple) else [index]
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items = items[:at] + [slice(None)] * (ndim - len(items) + 1) + items[at + 1 :]
    items += [slice(None)] * (ndim - len(items))
    if len(items) != ndim or any(i != slice(None) for i in items[:-2] + items[-1:]):
        return None
    sel = items[-2]
    if isinstance(sel, list) and len(sel) == 1 and isinstance(sel[0], int):
        i = sel[0] % n
        return i, i + 1
    if isinstance(sel, slice) and sel.step in (None, 1):
        a = 0 if sel.start is None else sel.start % n if sel.start < 0 else sel.start
        b = n if sel.stop is None else sel.stop % n if sel.stop < 0 else min(sel.stop, n)
        return (a, b) if a < b else None
    return None


def _oriented(p: Projection, lin: Linear, out: fx.Node) -> Projection:
    """Note the weight's orientation, and whether each head group's projection must read the
    tokens before a flattening reshape so that its output has ``out``'s leading shape."""
    p.transposed = lin.transposed
    p.proj = lin
    lead = tuple(shape(out)[: -2 if p.split_heads else -1])
    if tuple(shape(lin.x)[:-1]) == lead:
        return p
    src = lin.x.all_input_nodes[0] if is_reshape(lin.x) else None
    if src is not None and tuple(shape(src)[:-1]) == lead:
        p.unflatten_input = True
        return p
    raise _NoMatch(
        f"the projection '{lin.node.name}' is read back at leading shape {list(lead)}, "
        f"neither its input's {list(shape(lin.x)[:-1])} nor that input's source's"
    )


def projection_input(p: Projection) -> fx.Node:
    """The token input each head group's projection reads, as the graph has it now (the
    sequence pass may have put a node in front of the projection since matching)."""
    x = p.proj.current_x()
    return x.all_input_nodes[0] if p.unflatten_input else x


def _split_sizes(node: fx.Node, total: int) -> list[int]:
    name = op_name(node)
    a = node.args[1] if len(node.args) > 1 else node.kwargs.get("split_size_or_sections")
    if name == "chunk":
        n = a if a is not None else node.kwargs.get("chunks")
        step = -(-total // n)
        return [min(step, total - i * step) for i in range(n) if total - i * step > 0]
    if isinstance(a, int):
        return [min(a, total - i) for i in range(0, total, a)]
    return list(a)


def _o_projection(sdpa: fx.Node, params) -> fx.Node:
    node = sdpa
    for _ in range(16):
        users = list(node.users)
        if len(users) != 1:
            raise _NoMatch(
                f"the attention output '{node.name}' has {len(users)} users before reaching the "
                "output projection"
            )
        u = users[0]
        lin = as_linear(u, params)
        if lin is not None:
            if lin.x is not node:
                raise _NoMatch("the attention output feeds the output projection's weight")
            return u
        if op_name(u) not in (
            "transpose",
            "permute",
            "reshape",
            "view",
            "contiguous",
            "flatten",
            "to",
            "type_as",
            "clone",
        ):
            raise _NoMatch(
                f"the attention output goes through '{op_name(u)}' before the output projection"
            )
        node = u
    raise _NoMatch("no output projection found after the attention")


def match_attention(
    gm: fx.GraphModule, info: GraphInfo, world: int
) -> tuple[list[AttentionMatch], list[Skip]]:
    params = info.params
    matches: list[AttentionMatch] = []
    skips: list[Skip] = []
    for node, module in calls_named(gm.graph, "sdpa"):
        try:
            a = sdpa_args(node)
            module = _guess_module(node, a, params)
            matches.append(_match_one(node, a, params, module, world))
        except _NoMatch as e:
            skips.append(Skip("attention", module, str(e), fix=e.fix, anchor=node))
        except TSPConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - this attention alone is skipped and reported
            skips.append(failed("attention", module, "match", e))
            skips[-1].anchor = node
    return matches, skips


def _guess_module(sdpa: fx.Node, a: dict, params) -> str:
    """The attention's module: its query projection's (a function-style attention records
    no module of its own), unless that lies outside the module the call ran in."""
    own = node_module_fqn(sdpa)
    try:
        lin, _ = _find_projection(a["query"], params, "q")
    except _NoMatch:
        return own or sdpa.name
    guess = projection_module(params[as_linear(lin, params).weight].fqn)
    if own and not (guess.startswith(own) or own.startswith(guess)):
        return own
    return guess


def _match_one(sdpa: fx.Node, a: dict, params, module: str, world: int) -> AttentionMatch:
    q, k, v = a["query"], a["key"], a["value"]
    if not all(isinstance(t, fx.Node) for t in (q, k, v)):
        raise _NoMatch("q, k or v is not a tensor computed in the graph")
    qs, ks, vs = shape(q), shape(k), shape(v)
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4:
        raise _NoMatch(f"expected 4-D [batch, heads, seq, head_dim] inputs, got q {list(qs)}")
    if qs[2] != ks[2]:
        raise _NoMatch(
            f"query length {qs[2]} != key length {ks[2]} (cross-attention or a KV cache)"
        )
    if a["dropout_p"] not in (0, 0.0):
        raise _NoMatch(f"attention dropout p={a['dropout_p']} (only p=0 runs the TSP schedule)")
    mask = a["attn_mask"]
    if a["is_causal"] and mask is not None:
        raise _NoMatch("both is_causal and attn_mask are set")
    hq, d, dv = qs[1], qs[3], vs[3]  # values may have a head size of their own
    k_root, k_rep = head_repeat_chain(k, hq)
    v_root, v_rep = head_repeat_chain(v, hq)
    hkv = shape(k_root)[1]
    if shape(v_root)[1] != hkv:
        raise _NoMatch("keys and values have different head counts")
    if hq % hkv:
        raise _NoMatch(f"{hq} query heads are not a multiple of {hkv} key/value heads")
    if hkv != ks[1] and not (k_rep and v_rep):
        raise _NoMatch("unrecognised key/value head repetition")
    if ks[1] not in (hq, 1) and not a["enable_gqa"] and not k_rep:
        raise _NoMatch("key heads differ from query heads without enable_gqa")
    if world > hq:
        raise TSPConfigError(
            f"{module}: D={world} ranks is more than its {hq} attention heads; each rank needs "
            f"at least one head. Use a TSP group of at most {hq} ranks (combine it with data "
            "parallelism on a 2-D mesh for more devices)."
        )
    if hq % world:
        raise _NoMatch(f"{hq} query heads are not divisible by D={world}", heads_fix(hq, hkv))
    if hkv % world and world % hkv:
        raise _NoMatch(
            f"{hkv} key/value heads neither divide nor are divisible by D={world}",
            heads_fix(hq, hkv),
        )

    q_lin, _ = _find_projection(q, params, "q")
    k_lin, _ = _find_projection(k_root, params, "k")
    v_lin, _ = _find_projection(v_root, params, "v")
    qp = _projection_rows(q_lin, q, params)
    kp = _projection_rows(k_lin, k_root, params)
    vp = _projection_rows(v_lin, v_root, params)
    xs = {projection_input(p) for p in (qp, kp, vp)}
    if len(xs) != 1:
        raise _NoMatch("the q, k and v projections read different inputs")
    x = next(iter(xs))
    kv_proj_heads = hkv
    if not k_rep and hkv == hq and kp.key() != qp.key() and vp.key() != qp.key():
        # GQA repeated before the last head-local ops (torchtitan's ``repeat_kv`` before the
        # transpose, torchtune's view + expand + reshape before RoPE): the keys reach the call
        # with the query heads' count, but the k/v projections hold fewer heads. The
        # repetition stays in the region and runs per head group on that group's KV heads.
        kv_proj_heads = projected_kv_heads(kp, vp, hq, d, dv, world)
    # A projection shared by several of q/k/v (interleaved fused QKV) serves them all at once.
    # One serving q and k/v with fewer K/V heads (Falcon's grouped ``query_key_value``: per KV
    # group, its q heads then one k and one v head) is counted in q heads here;
    # ``head_plan.plan_heads`` then cuts it at the coarser units its reshapes keep whole.
    by_key: dict[tuple, Projection] = {}
    for p, heads in ((qp, hq), (kp, kv_proj_heads), (vp, kv_proj_heads)):
        p = by_key.setdefault(p.key(), p)
        if p.n_heads and p.n_heads != heads and p.key() != qp.key():
            raise _NoMatch("a fused projection serves k and v with different head counts")
        p.n_heads = max(p.n_heads, heads)
        if p.rows % heads:
            raise _NoMatch(f"projection rows {p.rows} are not a multiple of {heads} heads")
    qp, kp, vp = by_key[qp.key()], by_key[kp.key()], by_key[vp.key()]

    o_lin = _o_projection(sdpa, params)
    o_proj = as_linear(o_lin, params)
    o_w = o_proj.weight
    if o_proj.in_features != hq * dv:
        raise _NoMatch(
            f"output projection input size {o_proj.in_features} != heads*head_dim {hq * dv}"
        )
    if world > 1 and any(params[p.weight].example is None for p in (qp, kp, vp)):
        raise _NoMatch("projection weight is not available")
    return AttentionMatch(
        module=module,
        sdpa=sdpa,
        x=x,
        q=qp,
        k=kp,
        v=vp,
        o_linear=o_lin,
        o_weight=o_w,
        o_bias=o_proj.bias,
        o_proj=o_proj,
        q_heads=hq,
        kv_heads=hkv,
        head_dim=d,
        v_head_dim=dv,
        seq_len=qs[2],
        k_root=k_root,
        v_root=v_root,
        repeat_nodes=k_rep + v_rep,
        is_causal=bool(a["is_causal"]),
        mask=mask,
        scale=a["scale"],
    )


__all__ = [
    "AttentionMatch",
    "Projection",
    "Skip",
    "match_attention",
    "projection_input",
    "sdpa_args",
    "_forward_reach",
]
