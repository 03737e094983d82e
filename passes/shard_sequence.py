"""Pass 3 — shard the sequence: run the graph on this rank's zigzag tokens.

A propagation over the graph, not a list of special cases. Every value is replicated or
``Sharded`` (``passes/layout.py``) along the dimension that carries the tokens. User inputs are
cut to the local zigzag tokens where they enter; from there each operation either keeps the split
(token-wise operations: elementwise math, projections, norms over the hidden size, reshapes that
keep the token factor whole) with its shape arguments rewritten for the local length, or gets
what it needs:

* a replicated value meeting a sharded one along the tokens (RoPE tables built from
  ``arange(S)``, position ids, the query rows of a mask) is *sliced* to the local positions — no
  communication, always exact;
* an operation that needs every token (the keys of attention, a shift-by-one, a cumulative op,
  any operation not known here) gets a *gather* first (zigzag all-gather, back in true order);
* a sum or mean over the tokens, and token-level losses, reduce locally and all-reduce one value.

Correctness never depends on which dimension the inputs are cut along: every rule is exact for
whatever dimension is split, and unknown operations fall back to a gather. The choice only
decides how much work and memory is saved.

Gradient convention (the runtime's ops implement it): the gradient a rank holds for a replicated
value is a partial sum over ranks. Hence: slicing's adjoint scatters into zeros (no
communication); a gather's adjoint reduce-scatters; replicated parameters and inputs all-reduce
their gradient where they enter (``sync_replicated_grad``); replicated outputs hand the user's
(identical) gradient over as a partial (``replicated_output``); and an *output* gather, whose
consumers hold identical gradients on every rank, adjoins to "take my slice".

Any length: a sequence of S tokens that does not split into 2D zigzag chunks runs padded to P,
the next multiple of 2D, with the padding at its end (``runtime/zigzag.py``). Sharded values
carry the padding (``Sharded(n=S, n_local=P/D)``: shape arguments become ``P/D`` per S), and
only they do — a replicated value is always exactly the one-process value:

* a replicated value cut to the local tokens is padded with copies of its last token first, so
  padding tokens hold values real tokens hold (valid ids and positions, finite numbers, a mask
  row that sees some key) and nothing they compute is NaN;
* every gather drops the padding again (``drop_padding``), so an operation that needs every
  token, the keys of attention included, never sees it: no real query attends to padding, and
  the zigzag kernel cuts its blocks at the last real key;
* sums and means over the tokens and token losses set the padding to zero or to the loss's
  ``ignore_index`` first (``fill_padding``); a mean divides by the true count.

Padding rows are computed and dropped; their gradient is zero everywhere (nothing real reads
them), so gradients are exact too.

Attention: keys and values are gathered where they leave the computation from local tokens —
before any grouped-query head repetition, so only the KV heads move — and the queries stay
local. ``is_causal`` becomes the zigzag causal kernel (no mask tensor at all); an explicit mask is
cut to the local query rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn.functional as F

from tspc.ops.zigzag_attention import causal_attention, default_scale
from tspc.runtime.autograd_glue import replicated_output, sync_replicated_grad
from tspc.runtime.group import TSPGroup
from tspc.runtime.seq_reductions import sharded_cross_entropy, sharded_mean, sharded_sum
from tspc.runtime.zigzag import drop_padding, fill_padding, padded_length, zigzag_slice

from .analyse import GraphInfo
from .graph_utils import (
    arg,
    eliminate_dead_code,
    is_getitem,
    node_module_fqn,
    op_name,
    replace_input,
    set_arg,
    set_fake_value,
    shape,
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
from .match_attention import _head_repeat_chain, sdpa_args

ELEMENTWISE = frozenset(
    [
        "add",
        "sub",
        "mul",
        "div",
        "floor_divide",
        "remainder",
        "fmod",
        "pow",
        "neg",
        "abs",
        "exp",
        "expm1",
        "log",
        "log1p",
        "log2",
        "sqrt",
        "rsqrt",
        "sin",
        "cos",
        "tan",
        "tanh",
        "sinh",
        "cosh",
        "sigmoid",
        "silu",
        "gelu",
        "relu",
        "relu6",
        "leaky_relu",
        "elu",
        "selu",
        "celu",
        "softplus",
        "mish",
        "hardtanh",
        "hardswish",
        "hardsigmoid",
        "erf",
        "erfc",
        "reciprocal",
        "clamp",
        "clamp_min",
        "clamp_max",
        "clip",
        "where",
        "masked_fill",
        "eq",
        "ne",
        "lt",
        "le",
        "gt",
        "ge",
        "bitwise_and",
        "bitwise_or",
        "bitwise_xor",
        "bitwise_not",
        "logical_and",
        "logical_or",
        "logical_xor",
        "logical_not",
        "maximum",
        "minimum",
        "lerp",
        "square",
        "sign",
        "nan_to_num",
        "float",
        "half",
        "bfloat16",
        "double",
        "int",
        "long",
        "bool",
        "to",
        "contiguous",
        "clone",
        "detach",
        "type",
        "type_as",
        "dropout",
        "round",
        "floor",
        "ceil",
        "trunc",
        "isnan",
        "isinf",
        "isfinite",
        "atan2",
        "addcmul",
        "addcdiv",
        "copysign",
        "zeros_like",
        "ones_like",
        "full_like",
        "empty_like",
        "rand_like",
        "randn_like",
        "requires_grad_",
        "sgn",
        "frac",
    ]
)
# Ops whose only tensor that shapes the output is the first argument.
FIRST_ARG_ONLY = frozenset(
    [
        "type_as",
        "to",
        "zeros_like",
        "ones_like",
        "full_like",
        "empty_like",
        "rand_like",
        "randn_like",
    ]
)
FACTORIES = frozenset(
    [
        "arange",
        "zeros",
        "ones",
        "full",
        "empty",
        "tensor",
        "randn",
        "rand",
        "randint",
        "eye",
        "linspace",
        "logspace",
        "new_zeros",
        "new_ones",
        "new_empty",
        "new_full",
        "new_tensor",
        "scalar_tensor",
        "zeros_like_",
        "empty_strided",
    ]
)
SAME_SHAPE_ALONG_DIM = frozenset(
    ["softmax", "log_softmax", "cumsum", "cumprod", "cummax", "cummin", "logcumsumexp", "_softmax"]
)
REDUCTIONS = frozenset(
    [
        "sum",
        "mean",
        "amax",
        "amin",
        "prod",
        "std",
        "var",
        "norm",
        "logsumexp",
        "any",
        "all",
        "count_nonzero",
        "argmax",
        "argmin",
        "nansum",
        "nanmean",
        "max",
        "min",
    ]
)
NO_VALUE = frozenset(
    [
        "_set_grad_enabled",
        "_log_api_usage_once",
        "_enter_autocast",
        "_exit_autocast",
        "set_grad_enabled",
        "_record_function_enter",
        "_record_function_exit",
    ]
)


@dataclass
class SeqShardReport:
    seq_len: int = 0
    world: int = 1
    padded_len: int = 0  # the length the ranks run: seq_len, or padded to a multiple of 2D
    sharded_inputs: list[tuple[str, int]] = field(default_factory=list)
    gathers: list[dict] = field(default_factory=list)  # what was gathered, for which op, why
    notes: list[str] = field(default_factory=list)


def find_sequence_length(gm: fx.GraphModule) -> int | None:
    """The query length of the graph's self-attention calls (their common value)."""
    lengths = []
    for n in gm.graph.nodes:
        if op_name(n) == "sdpa":
            a = sdpa_args(n)
            try:
                qs, ks = shape(a["query"]), shape(a["key"])
            except (ValueError, TypeError):
                continue
            if len(qs) >= 2 and qs[-2] == ks[-2]:
                lengths.append(qs[-2])
    if not lengths:
        return None
    return max(set(lengths), key=lengths.count)


def sdpa_local_queries(q, k, v, attn_mask, dropout_p, scale, enable_gqa):
    """SDPA of local query rows against all keys (mask already cut to those rows)."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa
    )


class _Propagator:
    def __init__(
        self,
        gm: fx.GraphModule,
        info: GraphInfo,
        seq_len: int,
        group: TSPGroup,
        gather_outputs: bool,
        tags: dict[fx.Node, str],
        report: SeqShardReport,
    ):
        self.gm = gm
        self.g = gm.graph
        self.info = info
        self.S = seq_len
        self.D = group.size
        # A length that does not split into 2D chunks runs padded to P: the padding tokens are
        # the last ones of the sequence. Sharded values carry them (n = S true tokens, n_local
        # = P/D local ones); replicated values never do (see the module docstring).
        self.P = padded_length(seq_len, group.size)
        self.rank = group.rank
        self.group = group.name
        self.gather_outputs = gather_outputs
        self.tags = tags
        self.report = report
        self.layout: dict[fx.Node, object] = {}
        self._gathered: dict[fx.Node, fx.Node] = {}
        self._sliced: dict[tuple, fx.Node] = {}
        self.kv_roots: dict[fx.Node, tuple[fx.Node, fx.Node]] = {}  # root -> (chain user, sdpa)

    # ------------------------------------------------------------------ helpers
    def L(self, x):  # noqa: N802 - short name for the layout lookup used everywhere
        return self.layout.get(x) if isinstance(x, fx.Node) else None

    def tag_for(self, node: fx.Node) -> str:
        return self.tags.get(node) or node_module_fqn(node) or "sequence"

    def gather(self, x: fx.Node, consumer: fx.Node, reason: str, tag: str | None = None):
        """A replicated (all-gathered, true-order) version of sharded ``x``; cached."""
        if x in self._gathered:
            return self._gathered[x]
        sh: Sharded = self.L(x)
        tag = tag or self.tag_for(consumer)
        with self.g.inserting_after(x):
            start = self.g.call_function(
                torch.ops.tspc.all_gather_start.default,
                (x, sh.dim, sh.outer, sh.inner, self.group, self.D, tag),
            )
        with self.g.inserting_after(start):
            wait = self.g.call_function(
                torch.ops.tspc.all_gather_wait.default,
                (start, x, sh.dim, sh.outer, sh.inner, True, self.group, self.D, tag),
            )
        # Rules reason in *global* shapes: a gathered value has its input's global shape.
        set_fake_value(start)
        wait.meta["val"] = x.meta["val"]
        wait.meta["tspc_role"] = "seq_gather"
        wait.meta["tspc_gather_of"] = x
        self.layout[start] = None
        self.layout[wait] = None
        whole = self.unpad(wait, sh)
        self._gathered[x] = whole
        self.report.gathers.append(
            {"value": x.name, "for": consumer.name, "op": op_name(consumer), "reason": reason}
        )
        return whole

    def unpad(self, gathered: fx.Node, sh: Sharded) -> fx.Node:
        """The gathered value cut back to the true sequence length: replicated values never
        hold padding, so whatever reads them sees exactly what one process computes — and the
        padding tokens never become keys of any attention."""
        if self.P == self.S:
            return gathered
        with self.g.inserting_after(gathered):
            node = self.g.call_function(
                drop_padding, (gathered, sh.dim, sh.outer, sh.inner, self.S)
            )
        node.meta["val"] = gathered.meta["val"]
        node.meta["tspc_role"] = "seq_unpad"
        gathered.meta["tspc_unpad"] = node
        self.layout[node] = None
        return node

    def slice(self, x: fx.Node, dim: int, like: Sharded) -> fx.Node:
        """This rank's zigzag part of replicated ``x`` along ``dim`` (structured like ``like``)."""
        key = (x, dim, like.n, like.outer, like.inner)
        if key in self._sliced:
            return self._sliced[key]
        with self.g.inserting_after(x):
            node = self.g.call_function(
                zigzag_slice, (x, dim, self.rank, self.D, like.outer, like.inner, self.P)
            )
        node.meta["val"] = x.meta["val"]  # global shape, like every value the rules see
        node.meta["tspc_role"] = "seq_slice"
        self.layout[node] = like.with_dim(dim)
        self._sliced[key] = node
        return node

    def fill_padding(self, x: fx.Node, value) -> fx.Node:
        """``x`` with its padding tokens set to ``value``, for an operation that combines this
        rank's tokens into one result (a sum, a loss): padding must count for nothing."""
        if self.P == self.S:
            return x
        sh: Sharded = self.L(x)
        with self.g.inserting_after(x):
            node = self.g.call_function(
                fill_padding,
                (x, sh.dim, sh.outer, sh.inner, self.S, self.rank, self.D, value),
            )
        node.meta["val"] = x.meta["val"]
        node.meta["tspc_role"] = "seq_fill_padding"
        self.layout[node] = sh
        return node

    def make_replicated(self, node: fx.Node, reason: str) -> None:
        for i in list(self._tensor_args(node)):
            if isinstance(self.L(i), Sharded):
                replace_input(node, i, self.gather(i, node, reason))
        self.layout[node] = None

    def _tensor_args(self, node):
        from .graph_utils import tensor_inputs

        return tensor_inputs(node)

    # ------------------------------------------------------------------ seeds
    def seed_inputs(self) -> None:
        """Parameters stay whole; user inputs with a dimension of the sequence length are cut
        to the local zigzag tokens where they enter. Inputs that require grad get their
        gradient all-reduced (see the module docstring)."""
        first = next(n for n in self.g.nodes if n.op != "placeholder")
        for inp in self.info.inputs:
            node = inp.node
            self.layout[node] = None
            ex = inp.example
            if not isinstance(ex, torch.Tensor) or not node.users:
                continue
            src = node
            if ex.requires_grad and self.D > 1:
                with self.g.inserting_before(first):
                    src = self.g.call_function(
                        sync_replicated_grad, (node, self.group, self.D, inp.fqn)
                    )
                sync = src
                # identity in forward: its value is the parameter's (no fake run per parameter)
                sync.meta["val"] = node.meta["val"]
                node.replace_all_uses_with(sync, delete_user_cb=lambda u, s=sync: u is not s)
                self.layout[src] = None
            if inp.kind != "input":
                continue
            shp = tuple(ex.shape)
            if len(shp) >= 2 and shp[1] == self.S:
                dim = 1
            elif shp and shp[0] == self.S:
                dim = 0
            else:
                continue
            # values that must stay whole (the key padding of causal attention) keep the input
            users = [u for u in src.users if not u.meta.get("tspc_keep_full")]
            with self.g.inserting_before(first):
                sl = self.g.call_function(zigzag_slice, (src, dim, self.rank, self.D, 1, 1, self.P))
            sl.meta["val"] = src.meta["val"]  # global shape, like every value the rules see
            sl.meta["tspc_role"] = "seq_slice"
            for u in users:
                replace_input(u, src, sl)
            self.layout[sl] = Sharded(dim, self.S, self.P // self.D)
            self.report.sharded_inputs.append((inp.fqn, dim))

    # ------------------------------------------------------------------ kv gather points
    def find_kv_roots(self) -> None:
        for n in self.g.nodes:
            if op_name(n) != "sdpa":
                continue
            a = sdpa_args(n)
            q = a["query"]
            if not isinstance(q, fx.Node):
                continue
            heads = shape(q)[1] if len(shape(q)) == 4 else None
            for which in ("key", "value"):
                kv = a[which]
                if not isinstance(kv, fx.Node) or heads is None:
                    continue
                root, chain = _head_repeat_chain(kv, heads)
                if chain:
                    self.kv_roots[root] = (chain[-1], n)

    # ------------------------------------------------------------------ the walk
    def run(self) -> None:
        self.find_kv_roots()
        self.seed_inputs()
        for node in list(self.g.nodes):
            if node.op in ("placeholder", "output") or node in self.layout:
                continue
            if node.op == "get_attr":
                self.layout[node] = None
                continue
            self.visit(node)
            root_use = self.kv_roots.get(node)
            if root_use is not None and isinstance(self.L(node), Sharded):
                chain_user, sdpa = root_use
                g = self.gather(
                    node, sdpa, "attention keys/values need every token", self.tags.get(sdpa)
                )
                wait = g.args[0] if g.meta.get("tspc_role") == "seq_unpad" else g
                wait.meta["tspc_role"] = "kv_gather"
                wait.meta["tspc_sdpa"] = sdpa
                replace_input(chain_user, node, g)
        self.finish_outputs()

    def visit(self, node: fx.Node) -> None:
        name = op_name(node) or ""
        ins = self._tensor_args(node)
        if not any(isinstance(self.L(i), Sharded) for i in ins) and not (
            is_getitem(node) and isinstance(self.L(node.args[0]), tuple)
        ):
            # Nothing sharded flows in: the op runs as in the original graph (replicated).
            self.layout[node] = None
            return
        if node.op == "call_function" and name in NO_VALUE:
            self.layout[node] = None
            return
        handler = getattr(self, f"rule_{name}", None)
        if handler is None:
            if name in ELEMENTWISE or (name.endswith("_") and name[:-1] in ELEMENTWISE):
                handler = self.rule_elementwise
            elif name in FACTORIES:
                self.layout[node] = None
                return
            elif name in SAME_SHAPE_ALONG_DIM:
                handler = self.rule_along_dim
            elif name in REDUCTIONS:
                handler = self.rule_reduction
        if handler is None or handler(node) is False:
            self.make_replicated(node, f"'{name}' is not known to keep tokens independent")

    # ------------------------------------------------------------------ rules
    def rule_elementwise(self, node: fx.Node):
        name = op_name(node)
        out = tensor_val(node)
        if out is None:
            return False
        out_ndim = out.dim()
        participants = self._tensor_args(node)
        if name in FIRST_ARG_ONLY:
            participants = participants[:1]
        inplace = name.endswith("_") and name not in ("requires_grad_",)
        target: Sharded | None = None
        if inplace:
            self_node = node.args[0]
            sl = self.L(self_node)
            target = map_broadcast(len(shape(self_node)), out_ndim, sl) if sl else None
        else:
            for p in participants:
                sp = self.L(p)
                if isinstance(sp, Sharded):
                    target = map_broadcast(len(shape(p)), out_ndim, sp)
                    break
        out_shape = tuple(out.shape)
        for p in participants:
            sp = self.L(p)
            p_shape = shape(p)
            offset = out_ndim - len(p_shape)
            if isinstance(sp, Sharded):
                mapped = map_broadcast(len(p_shape), out_ndim, sp)
                if target is None or mapped != target:
                    replace_input(node, p, self.gather(p, node, "operands split differently"))
                    sp = None
                else:
                    continue
            if target is None:
                continue
            a = target.dim - offset
            if a >= 0 and p_shape[a] != 1:
                if p_shape[a] != out_shape[target.dim]:
                    return False
                replace_input(node, p, self.slice(p, a, target))
        self.layout[node] = target
        return None

    def rule_along_dim(self, node: fx.Node):
        x = node.args[0]
        sh = self.L(x)
        dim = arg(node, 1, "dim")
        if dim is None or not isinstance(sh, Sharded):
            return False
        if dim % len(shape(x)) == sh.dim:
            return False
        self.layout[node] = sh
        return None

    def rule_reduction(self, node: fx.Node):
        name = op_name(node)
        x = node.args[0]
        sh = self.L(x)
        if not isinstance(sh, Sharded) or len(self._tensor_args(node)) != 1:
            return False
        ndim = len(shape(x))
        dims = arg(node, 1, "dim")
        out_val = node.meta.get("val", node.meta.get("example_value"))
        first_out = out_val[0] if isinstance(out_val, tuple) else out_val
        # keepdim's position differs between reductions (var(dim, unbiased, keepdim)): read it
        # off the result's rank instead.
        keepdim = isinstance(first_out, torch.Tensor) and first_out.dim() == ndim and ndim > 0
        if name in ("max", "min", "argmax", "argmin") and dims is None:
            return False
        mapped = map_reduce(ndim, dims, keepdim, sh)
        if mapped is not None:
            self.layout[node] = (mapped, mapped) if isinstance(out_val, tuple) else mapped
            return None
        if name not in ("sum", "mean"):
            return False
        x = self.fill_padding(x, 0)
        dtype = node.kwargs.get("dtype")
        tag = self.tag_for(node)
        if name == "sum":
            new_target, args = sharded_sum, (x, dims, keepdim, dtype, self.group, self.D, tag)
        else:
            count = 1
            for d in reduced_dims(ndim, dims):
                count *= shape(x)[d]
            new_target = sharded_mean
            args = (x, dims, keepdim, dtype, count, self.group, self.D, tag)
        node.op, node.target, node.args, node.kwargs = "call_function", new_target, args, {}
        self.layout[node] = None
        return None

    def rule_linear(self, node: fx.Node):
        x = node.args[0]
        sh = self.L(x)
        if not isinstance(sh, Sharded) or sh.dim == len(shape(x)) - 1:
            return False
        for w in self._tensor_args(node)[1:]:
            if isinstance(self.L(w), Sharded):
                replace_input(node, w, self.gather(w, node, "linear weight"))
        self.layout[node] = sh
        return None

    def rule_addmm(self, node: fx.Node):
        """``addmm(b, x, W)`` (GPT-2's Conv1D on flattened tokens): token-wise, like linear,
        when only the rows of ``x`` are split."""
        bias, x, w = (node.args + (None, None, None))[:3]
        sh = self.L(x) if isinstance(x, fx.Node) else None
        if not isinstance(sh, Sharded) or sh.dim != 0 or node.kwargs:
            return False
        if any(isinstance(t, fx.Node) and isinstance(self.L(t), Sharded) for t in (bias, w)):
            return False
        self.layout[node] = sh
        return None

    def rule_embedding(self, node: fx.Node):
        ids = node.args[0]
        sh = self.L(ids)
        if not isinstance(sh, Sharded):
            return False
        w = arg(node, 1, "weight")
        if isinstance(self.L(w), Sharded):
            return False
        self.layout[node] = sh
        return None

    def _matmul(self, node: fx.Node):
        a, b = node.args[0], node.args[1]
        if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
            return False
        sa, sb = self.L(a), self.L(b)
        an, bn = len(shape(a)), len(shape(b))
        on = len(shape(node))
        if an < 2 or bn < 2:
            return False
        if isinstance(sa, Sharded) and sa.dim == an - 1:
            a = self.gather(a, node, "contracted dimension")
            replace_input(node, node.args[0], a)
            sa = None
        if isinstance(sb, Sharded) and sb.dim == bn - 2:
            b = self.gather(b, node, "contracted dimension")
            replace_input(node, node.args[1], b)
            sb = None
        if isinstance(sa, Sharded) and isinstance(sb, Sharded):
            oa = map_broadcast(an, on, sa)
            ob = map_broadcast(bn, on, sb)
            if oa != ob or oa.dim >= on - 2:
                replace_input(node, node.args[1], self.gather(node.args[1], node, "both sharded"))
                sb = None
        if isinstance(sa, Sharded):
            out = map_broadcast(an, on, sa)
            if out.dim < on - 2:  # a batch dimension: b must follow
                bd = out.dim - (on - bn)
                if sb is None and bd >= 0 and shape(b)[bd] != 1:
                    replace_input(node, node.args[1], self.slice(node.args[1], bd, out))
        elif isinstance(sb, Sharded):
            out = map_broadcast(bn, on, sb)
            if out.dim < on - 2:
                ad = out.dim - (on - an)
                if ad >= 0 and shape(a)[ad] != 1:
                    replace_input(node, node.args[0], self.slice(node.args[0], ad, out))
        else:
            out = None
        self.layout[node] = out
        return None

    rule_matmul = _matmul
    rule_bmm = _matmul

    # ---- shape ops
    def _sizes_arg(self, node: fx.Node):
        """(sizes, setter) for view/reshape/expand's size argument, in either spelling."""
        if len(node.args) >= 2 and isinstance(node.args[1], (tuple, list, torch.Size)):
            sizes = list(node.args[1])

            def setter(v):
                node.args = (node.args[0], tuple(v), *node.args[2:])

            return sizes, setter
        if len(node.args) >= 2:
            sizes = list(node.args[1:])

            def setter(v):
                node.args = (node.args[0], *v)

            return sizes, setter
        key = "size" if "size" in node.kwargs else "shape"
        sizes = list(node.kwargs.get(key, ()))

        def setter(v):
            kw = dict(node.kwargs)
            kw[key] = tuple(v)
            node.kwargs = kw

        return sizes, setter

    def _view_like(self, node: fx.Node, sizes_rewrite: bool):
        x = node.args[0]
        sh = self.L(x)
        if not isinstance(sh, Sharded):
            return False
        in_shape, out_shape = shape(x), shape(node)
        out = map_view(in_shape, out_shape, sh)
        if out is None:
            return False
        if sizes_rewrite:
            sizes, setter = self._sizes_arg(node)
            if any(isinstance(s, fx.Node) for s in sizes):
                return False
            new = rewrite_sizes(
                sizes, out.dim, out_shape[out.dim], out.local_size(out_shape[out.dim])
            )
            if new is None:
                return False
            setter(new)
        self.layout[node] = out
        return None

    def rule_view(self, node):
        return self._view_like(node, True)

    rule_reshape = rule_view

    def rule_flatten(self, node):
        return self._view_like(node, False)

    rule_squeeze = rule_flatten
    rule_unsqueeze = rule_flatten

    def rule_view_as(self, node):
        other = node.args[1]
        so = self.L(other)
        res = self._view_like(node, False)
        if res is False or so != self.layout.get(node):
            return False
        return None

    rule_reshape_as = rule_view_as

    def rule_view_as_complex(self, node):
        # pairs of the last dim become one complex number (Llama-4's RoPE): every other dim
        # keeps its place, so tokens stay independent unless the sequence is that last dim
        sh = self.L(node.args[0])
        if not isinstance(sh, Sharded) or sh.dim >= len(shape(node)):
            return False
        self.layout[node] = sh
        return None

    def rule_view_as_real(self, node):
        sh = self.L(node.args[0])
        if not isinstance(sh, Sharded):
            return False
        self.layout[node] = sh  # a trailing pair dim is added after every other dim
        return None

    def rule_unflatten(self, node):
        x = node.args[0]
        sh = self.L(x)
        if not isinstance(sh, Sharded):
            return False
        out_shape = shape(node)
        out = map_view(shape(x), out_shape, sh)
        if out is None:
            return False
        dim = arg(node, 1, "dim") % len(shape(x))
        sizes = list(arg(node, 2, "sizes"))
        if dim <= out.dim < dim + len(sizes):
            new = rewrite_sizes(
                sizes, out.dim - dim, out_shape[out.dim], out.local_size(out_shape[out.dim])
            )
            if new is None:
                return False
            set_arg(node, 2, "sizes", tuple(new))
        self.layout[node] = out
        return None

    def rule_expand(self, node):
        x = node.args[0]
        sh = self.L(x)
        if not isinstance(sh, Sharded):
            return False
        out_shape = shape(node)
        out = map_broadcast(len(shape(x)), len(out_shape), sh)
        sizes, setter = self._sizes_arg(node)
        new = rewrite_sizes(sizes, out.dim, out_shape[out.dim], out.local_size(out_shape[out.dim]))
        if new is None:
            return False
        setter(new)
        self.layout[node] = out
        return None

    rule_broadcast_to = rule_expand  # torch.broadcast_to(x, sizes): Falcon's K/V heads

    def rule_expand_as(self, node):
        x, other = node.args[0], node.args[1]
        sh, so = self.L(x), self.L(other)
        out = (
            map_broadcast(len(shape(x)), len(shape(node)), sh) if isinstance(sh, Sharded) else None
        )
        if out != so:
            return False
        self.layout[node] = out
        return None

    def rule_transpose(self, node):
        x = node.args[0]
        sh = self.L(x)
        d0, d1 = arg(node, 1, "dim0"), arg(node, 2, "dim1")
        self.layout[node] = map_transpose(len(shape(x)), d0, d1, sh)
        return None

    rule_swapaxes = rule_transpose
    rule_swapdims = rule_transpose

    def rule_t(self, node):
        x = node.args[0]
        sh = self.L(x)
        n = len(shape(x))
        self.layout[node] = map_transpose(n, 0, 1, sh) if n == 2 else sh
        return None

    def rule_permute(self, node):
        x = node.args[0]
        dims = (
            node.args[1]
            if len(node.args) == 2 and isinstance(node.args[1], (tuple, list))
            else node.args[1:]
        )
        if not dims:
            dims = node.kwargs.get("dims")
        self.layout[node] = map_permute(list(dims), self.L(x))
        return None

    def rule_movedim(self, node):
        x = node.args[0]
        n = len(shape(x))
        src, dst = arg(node, 1, "source"), arg(node, 2, "destination")
        src = [s % n for s in ([src] if isinstance(src, int) else src)]
        dst = [d % n for d in ([dst] if isinstance(dst, int) else dst)]
        # movedim's permutation: out dim dst[i] is in dim src[i]; the rest keep their order.
        perm: list[int | None] = [None] * n
        for s_, d_ in zip(src, dst):
            perm[d_] = s_
        rest = iter(d for d in range(n) if d not in src)
        self.layout[node] = map_permute(
            [p if p is not None else next(rest) for p in perm], self.L(x)
        )
        return None

    rule_moveaxis = rule_movedim

    def rule_getitem(self, node):
        src = node.args[0]
        sl = self.L(src)
        if isinstance(sl, tuple):
            self.layout[node] = sl[node.args[1]]
            return None
        idx = node.args[1]
        items = idx if isinstance(idx, tuple) else (idx,)
        if any(isinstance(i, fx.Node) for i in items):
            return False
        out = map_getitem(shape(src), idx, sl)
        if out is None or out == "unknown":
            return False
        self.layout[node] = out
        return None

    def rule_narrow(self, node):
        x = node.args[0]
        sh = self.L(x)
        dim = arg(node, 1, "dim") % len(shape(x))
        if dim == sh.dim:
            return False
        self.layout[node] = sh
        return None

    def rule_select(self, node):
        x = node.args[0]
        sh = self.L(x)
        dim = arg(node, 1, "dim") % len(shape(x))
        if dim == sh.dim:
            return False
        self.layout[node] = sh.with_dim(sh.dim - (1 if dim < sh.dim else 0))
        return None

    def _split(self, node, dim_index: int, default_dim=0):
        x = node.args[0]
        sh = self.L(x)
        dim = arg(node, dim_index, "dim", default_dim) % len(shape(x))
        if dim == sh.dim:
            return False
        n_out = len(node.meta.get("val", node.meta.get("example_value")))
        self.layout[node] = tuple([sh] * n_out)
        return None

    def rule_split(self, node):
        return self._split(node, 2)

    rule_chunk = rule_split
    rule_split_with_sizes = rule_split
    rule_tensor_split = rule_split

    def rule_unbind(self, node):
        x = node.args[0]
        sh = self.L(x)
        dim = arg(node, 1, "dim", 0) % len(shape(x))
        if dim == sh.dim:
            return False
        n_out = shape(x)[dim]
        self.layout[node] = tuple([sh.with_dim(sh.dim - (1 if dim < sh.dim else 0))] * n_out)
        return None

    def rule_cat(self, node):
        tensors = list(arg(node, 0, "tensors"))
        out_shape = shape(node)
        dim = arg(node, 1, "dim", 0) % len(out_shape)
        live = []
        for t in tensors:
            tv = tensor_val(t)
            if tv is not None and (tv.numel() == 0 and (tv.dim() == 1 or tv.shape[dim] == 0)):
                continue  # an empty tensor (legacy 1-D, or an empty cache) adds nothing
            live.append(t)
        if len(live) == 1:
            self.layout[node] = self.L(live[0]) if len(shape(live[0])) == len(out_shape) else None
            if self.layout[node] is None and isinstance(self.L(live[0]), Sharded):
                return False
            return None
        target = None
        for t in live:
            st = self.L(t)
            if isinstance(st, Sharded):
                if st.dim == dim:
                    return False
                target = target or st
        new = []
        for t in tensors:
            st = self.L(t)
            if t not in live or st == target:
                new.append(t)
            elif isinstance(st, Sharded):
                new.append(self.gather(t, node, "cat of differently split tensors"))
            else:
                new.append(self.slice(t, target.dim, target))
        if len(node.args) >= 1:
            node.args = (new, *node.args[1:])
        else:
            node.kwargs = {**node.kwargs, "tensors": new}
        self.layout[node] = target
        return None

    rule_concat = rule_cat
    rule_concatenate = rule_cat

    def rule_stack(self, node):
        tensors = list(arg(node, 0, "tensors"))
        out_ndim = len(shape(node))
        dim = arg(node, 1, "dim", 0) % out_ndim
        target = None
        for t in tensors:
            st = self.L(t)
            if isinstance(st, Sharded):
                target = target or st
        new = []
        for t in tensors:
            st = self.L(t)
            if st == target:
                new.append(t)
            elif isinstance(st, Sharded):
                new.append(self.gather(t, node, "stack of differently split tensors"))
            else:
                new.append(self.slice(t, target.dim, target))
        node.args = (new, *node.args[1:])
        self.layout[node] = target.with_dim(target.dim + (1 if target.dim >= dim else 0))
        return None

    def rule_pad(self, node):
        x = node.args[0]
        sh = self.L(x)
        pad = list(arg(node, 1, "pad"))
        n = len(shape(x))
        touched = {n - 1 - i // 2 for i, p in enumerate(pad) if p != 0}
        if sh.dim in touched:
            return False
        self.layout[node] = sh
        return None

    def rule_repeat(self, node):
        x = node.args[0]
        sh = self.L(x)
        reps = (
            node.args[1]
            if len(node.args) == 2 and isinstance(node.args[1], (tuple, list))
            else node.args[1:]
        )
        reps = list(reps)
        n = len(shape(x))
        if reps[sh.dim + len(reps) - n] != 1:
            return False
        self.layout[node] = sh.with_dim(sh.dim + len(reps) - n)
        return None

    def rule_repeat_interleave(self, node):
        x = node.args[0]
        sh = self.L(x)
        dim = arg(node, 2, "dim")
        if (
            dim is None
            or dim % len(shape(x)) == sh.dim
            or not isinstance(arg(node, 1, "repeats"), int)
        ):
            return False
        self.layout[node] = sh
        return None

    def _last_two(self, node):
        x = node.args[0]
        sh = self.L(x)
        if sh.dim >= len(shape(x)) - 2:
            return False
        self.layout[node] = sh
        return None

    rule_tril = _last_two
    rule_triu = _last_two

    def rule_flip(self, node):
        x = node.args[0]
        sh = self.L(x)
        dims = arg(node, 1, "dims")
        dims = [dims] if isinstance(dims, int) else list(dims)
        if sh.dim in {d % len(shape(x)) for d in dims}:
            return False
        self.layout[node] = sh
        return None

    def rule_roll(self, node):
        x = node.args[0]
        sh = self.L(x)
        dims = arg(node, 2, "dims")
        if dims is None:
            return False
        dims = [dims] if isinstance(dims, int) else list(dims)
        if sh.dim in {d % len(shape(x)) for d in dims}:
            return False
        self.layout[node] = sh
        return None

    def rule_index_select(self, node):
        x = node.args[0]
        sh = self.L(x)
        dim = arg(node, 1, "dim") % len(shape(x))
        idx = arg(node, 2, "index")
        if not isinstance(sh, Sharded) or dim == sh.dim or isinstance(self.L(idx), Sharded):
            return False
        self.layout[node] = sh
        return None

    def _norm(self, node, shape_index: int):
        x = node.args[0]
        sh = self.L(x)
        nshape = arg(node, shape_index, "normalized_shape")
        k = 1 if isinstance(nshape, int) else len(nshape)
        if not isinstance(sh, Sharded) or sh.dim >= len(shape(x)) - k:
            return False
        for p in self._tensor_args(node)[1:]:
            if isinstance(self.L(p), Sharded):
                return False
        self.layout[node] = sh
        return None

    def rule_layer_norm(self, node):
        return self._norm(node, 1)

    rule_rms_norm = rule_layer_norm

    def rule_sdpa(self, node):
        a = sdpa_args(node)
        q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
        sq = self.L(q)
        q_ndim = len(shape(q))
        if not isinstance(sq, Sharded) or sq.dim != q_ndim - 2 or not sq.is_plain:
            return False
        if sq.n != self.S:
            return False
        tag = self.tags.get(node)
        for t in (k, v):
            if isinstance(self.L(t), Sharded):
                replace_input(
                    node, t, self.gather(t, node, "attention keys/values need every token", tag)
                )
        if isinstance(mask, fx.Node):
            m_shape = shape(mask)
            sm = self.L(mask)
            qd = len(m_shape) - 2
            if isinstance(sm, Sharded) and sm.dim != qd:
                mask_new = self.gather(mask, node, "mask split along keys")
                replace_input(node, mask, mask_new)
                mask, sm = mask_new, None
            if sm is None and qd >= 0 and m_shape[qd] != 1:
                replace_input(node, mask, self.slice(mask, qd, sq))
            node.target = sdpa_local_queries
            node.args = (
                self._arg_now(node, 0, "query"),
                self._arg_now(node, 1, "key"),
                self._arg_now(node, 2, "value"),
                self._arg_now(node, 3, "attn_mask"),
                a["dropout_p"],
                a["scale"],
                bool(a["enable_gqa"]),
            )
            node.kwargs = {}
        elif a["is_causal"]:
            # causal attention of the local zigzag queries: no mask tensor at all
            scale = a["scale"] if a["scale"] is not None else default_scale(shape(q)[-1])
            key_valid, doc_ids = a["key_valid"], a["doc_ids"]
            if isinstance(key_valid, fx.Node) and isinstance(self.L(key_valid), Sharded):
                if key_valid.meta.get("tspc_role") == "seq_slice":
                    key_valid = key_valid.args[0]  # the replicated [B, S] it was cut from
                else:
                    key_valid = self.gather(key_valid, node, "key padding needs every key")
            if isinstance(doc_ids, fx.Node) and isinstance(self.L(doc_ids), Sharded):
                if doc_ids.meta.get("tspc_role") == "seq_slice":
                    doc_ids = doc_ids.args[0]
                else:
                    doc_ids = self.gather(doc_ids, node, "document ids of every key")
            node.target = causal_attention
            node.args = (
                self._arg_now(node, 0, "query"),
                self._arg_now(node, 1, "key"),
                self._arg_now(node, 2, "value"),
                key_valid,
                float(scale),
                self.rank,
                self.D,
            )
            node.kwargs = {
                "window": a["window"],
                "doc_ids": doc_ids,
                "dense_mask": a["dense_mask"],  # an explicit mask input: whole, replicated
            }
        else:
            # No mask, not causal: every query sees every key; local queries need nothing else.
            pass
        node.meta["tspc_role"] = "attention"
        self.layout[node] = sq
        return None

    def _arg_now(self, node, i, name):
        return arg(node, i, name)

    def _loss(self, node, nll: bool):
        logits, target = node.args[0], arg(node, 1, "target")
        sl, st = self.L(logits), self.L(target)
        if not isinstance(logits, fx.Node) or not isinstance(target, fx.Node):
            return False
        if not isinstance(sl, Sharded) or sl.dim != 0 or len(shape(logits)) != 2:
            return False
        if isinstance(st, Sharded):
            if st.dim != 0 or (st.outer, st.inner) != (sl.outer, sl.inner):
                return False
        else:
            target_new = self.slice(target, 0, sl)
            replace_input(node, target, target_new)
            target = target_new
        weight = arg(node, 2, "weight")
        if isinstance(self.L(weight), Sharded):
            return False
        reduction = node.kwargs.get("reduction", "mean")
        if len(node.args) > 5 and not nll:
            reduction = node.args[5]
        ignore_index = node.kwargs.get("ignore_index", -100)
        if len(node.args) > 4:
            ignore_index = node.args[4]
        smoothing = node.kwargs.get("label_smoothing", 0.0)
        if len(node.args) > 6:
            smoothing = node.args[6]
        if node.kwargs.get("size_average") is not None or node.kwargs.get("reduce") is not None:
            return False
        target = self.fill_padding(target, ignore_index)  # padding tokens are not predicted
        node.target = sharded_cross_entropy
        node.args = (
            logits,
            target,
            weight,
            ignore_index,
            reduction,
            smoothing,
            self.group,
            self.D,
            self.tag_for(node),
            nll,
        )
        node.kwargs = {}
        self.layout[node] = sl if reduction == "none" else None
        return None

    def rule_cross_entropy(self, node):
        return self._loss(node, nll=False)

    def rule_nll_loss(self, node):
        return self._loss(node, nll=True)

    # ------------------------------------------------------------------ outputs
    def finish_outputs(self) -> None:
        out = next(n for n in self.g.nodes if n.op == "output")
        done: dict[fx.Node, fx.Node] = {}

        def fix(a):
            if not isinstance(a, fx.Node):
                return a
            if a not in done:
                done[a] = _fix(a)
            return done[a]

        def _fix(a):
            sl = self.L(a)
            if isinstance(sl, Sharded):
                if not self.gather_outputs:
                    return a
                with self.g.inserting_before(out):
                    start = self.g.call_function(
                        torch.ops.tspc.all_gather_start.default,
                        (a, sl.dim, sl.outer, sl.inner, self.group, self.D, "output"),
                    )
                    wait = self.g.call_function(
                        torch.ops.tspc.all_gather_wait.default,
                        (start, a, sl.dim, sl.outer, sl.inner, False, self.group, self.D, "output"),
                    )
                wait.meta["tspc_role"] = "output_gather"
                if self.P == self.S:
                    return wait
                with self.g.inserting_before(out):
                    return self.g.call_function(
                        drop_padding, (wait, sl.dim, sl.outer, sl.inner, self.S)
                    )
            tv = tensor_val(a)
            if tv is not None and tv.requires_grad and self.D > 1:
                with self.g.inserting_before(out):
                    return self.g.call_function(replicated_output, (a, self.rank))
            return a

        out.args = fx.node.map_aggregate(out.args, fix)


def padding_note(seq_len: int, padded: int, world: int, gather_outputs: bool) -> str:
    """The report's line for a padded sequence: by how much, and what a user must know."""
    pad = padded - seq_len
    note = (
        f"sequence length {seq_len} padded to {padded} (+{pad} token{'s' * (pad != 1)}) to "
        f"split into 2D = {2 * world} zigzag chunks; the padding is never attended to and "
        "counts in no sum or loss"
    )
    if not gather_outputs:
        note += (
            f"; outputs left sharded hold {padded // world} tokens per rank, the last {pad} "
            "of the padded sequence being padding"
        )
    return note


def shard_sequence(
    gm: fx.GraphModule,
    info: GraphInfo,
    group: TSPGroup,
    seq_len: int,
    *,
    gather_outputs: bool = True,
    tags: dict[fx.Node, str] | None = None,
) -> SeqShardReport:
    """Rewrite ``gm`` in place to run on this rank's zigzag tokens. ``tags`` names SDPA nodes
    after their attention module, so their K/V gathers are counted under that name."""
    report = SeqShardReport(seq_len=seq_len, world=group.size)
    if group.size == 1:
        report.notes.append("D = 1: nothing to shard")
        return report
    report.padded_len = padded_length(seq_len, group.size)
    if report.padded_len != seq_len:
        report.notes.append(padding_note(seq_len, report.padded_len, group.size, gather_outputs))
    prop = _Propagator(gm, info, seq_len, group, gather_outputs, tags or {}, report)
    prop.run()
    eliminate_dead_code(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return report
