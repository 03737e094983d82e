"""Pass 1b — classify attention masks: recognise causal masks built in-graph, and what narrows them.

Hugging Face models under ``torch.compile`` build an explicit ``[B, 1, S, S]`` mask from index
comparisons and the ``attention_mask`` input and call SDPA with ``is_causal=False``. At long
context that mask alone outweighs everything else. This pass works out what the mask *means* by
evaluating its subgraph symbolically: every element ``mask[b, h, q, k]`` becomes an expression
over the index variables and the graph's inputs (``kv_idx <= q_idx``,
``attention_mask[b, kv_idx]``, ...). When the expression is a conjunction of

* the causal comparison ``k <= q`` (possibly written any way a linear comparison can be),
* a sliding window ``q - k < W`` (however written; W narrower than the sequence narrows each
  query's keys, a wider one is always true and dropped; layers may differ: each SDPA call's
  mask is classified on its own),
* documents: ``ids[b, q] == ids[b, k]`` where ``ids`` is a cumulative sum of a bool along the
  sequence (so equal ids are contiguous runs). Packed sequences are the case transformers
  builds from restarting ``position_ids``: ids ``cumsum(diff(P) != 1)`` and the causal (and
  window) comparisons written on the positions ``P[b, k] <= P[b, q]``, which equal the index
  comparisons exactly because the documents are P's runs of +1 steps (checked in the graph),
* terms of ``(b, k)`` only — key padding — that can be computed as a ``[B, S]`` tensor,
* comparisons that are always true at this length,

the SDPA call becomes ``causal_attention(q, k, v, key_valid, scale, window=W, doc_ids=ids)``:
the zigzag kernel, which skips key blocks outside the window or the document, with no
``S x S`` (or ``c x S``) tensor anywhere (the mask subgraph becomes dead code).

An explicit ``[B|1, 1, S, S]`` mask passed in by the user (a packed batch's block-diagonal
mask) is data: ``tspc::documents_of_mask`` derives document ids from it on every call,
checking a band of rows at a time that each batch row is block-diagonal causal; a row that is
not runs exactly on its own mask rows, a tile at a time (the input itself is S x S; nothing
else is). Anything else is left alone and reported; the sequence pass then cuts the mask's
query rows, which is always exact.

Additive float masks (``0`` where attending, a very negative value elsewhere, as eager attention
uses) are recognised through ``where``/``masked_fill`` forms of a boolean condition.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from tspc.ops.zigzag_attention import causal_attention  # also registers tspc::documents_of_mask

from .graph_utils import (
    arg,
    eliminate_dead_code,
    is_getitem,
    op_name,
    set_fake_value,
    shape,
    tensor_val,
)
from .match_attention import sdpa_args

# --------------------------------------------------------------------------- expressions
# Tuples, so that they hash and compare structurally:
#   ("idx", i)            the i-th index of the mask (0=b, 1=h, 2=q, 3=k)
#   ("const", v)          a Python number or bool
#   ("leaf", node, idx)   element ``node[idx...]`` of a value this pass does not model
#   ("op", name, args)    an elementwise operation
#   ("bool", x)           x converted to bool (x != 0)


class _Opaque(Exception):
    pass


_CMP = {"le", "lt", "ge", "gt", "eq", "ne"}
_NEGATE = {"le": "gt", "lt": "ge", "ge": "lt", "gt": "le", "eq": "ne", "ne": "eq"}
_SIZE1_VIEWS = ("view", "reshape", "unsqueeze", "squeeze", "contiguous", "clone", "detach")
_BINARY = {"add", "sub", "mul", "bitwise_and", "bitwise_or", "logical_and", "logical_or"} | _CMP


def _kind(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    return "float" if dtype.is_floating_point else "int"


_PY = {
    "add": operator.add,
    "sub": operator.sub,
    "mul": operator.mul,
    "le": operator.le,
    "lt": operator.lt,
    "ge": operator.ge,
    "gt": operator.gt,
    "eq": operator.eq,
    "ne": operator.ne,
    "and": lambda a, b: bool(a) and bool(b),
    "or": lambda a, b: bool(a) or bool(b),
    "not": lambda a: not a,
    "where": lambda c, a, b: a if c else b,
}


def _fold_op(name: str, args: tuple) -> tuple:
    """An operation on constants is a constant; ``x and True`` is ``x``."""
    if all(a[0] == "const" for a in args) and name in _PY:
        return ("const", _PY[name](*(a[1] for a in args)))
    if name == "and":
        live = [a for a in args if a not in (("const", True), ("const", 1))]
        if any(a in (("const", False), ("const", 0)) for a in args):
            return ("const", False)
        if len(live) == 1:
            return live[0]
    if name == "where" and args[0][0] == "const":
        return args[1] if args[0][1] else args[2]
    return ("op", name, args)


class _Evaluator:
    def __init__(self, fold_limit: int):
        self.fold_limit = fold_limit
        self.memo: dict = {}

    def expr(self, x, idx: tuple) -> tuple:
        if not isinstance(x, fx.Node):
            if isinstance(x, (bool, int, float)):
                return ("const", x)
            raise _Opaque(f"argument {x!r}")
        key = (x, idx)
        if key not in self.memo:
            self.memo[key] = self._expr(x, idx)
        return self.memo[key]

    def _bcast(self, t, out_shape, idx):
        """Indices into ``t`` for output indices ``idx`` under broadcasting."""
        if not isinstance(t, fx.Node):
            return ()
        ts = shape(t)
        off = len(out_shape) - len(ts)
        return tuple(
            ("const", 0) if ts[j] == 1 and out_shape[j + off] != 1 else idx[j + off]
            for j in range(len(ts))
        )

    def _expr(self, node: fx.Node, idx: tuple) -> tuple:
        name = op_name(node) or ""
        tv = tensor_val(node)
        if node.op in ("placeholder", "get_attr") or tv is None:
            return ("leaf", node, idx)
        out_shape = tuple(tv.shape)
        if name == "arange":
            args = [a for a in node.args]
            start, step = (0, 1) if len(args) == 1 else (args[0], args[2] if len(args) > 2 else 1)
            e = idx[0]
            if step != 1:
                e = ("op", "mul", (e, ("const", step)))
            return e if start == 0 else ("op", "add", (e, ("const", start)))
        if name in _BINARY and len(node.args) == 2:
            a, b = node.args
            ea = self.expr(a, self._bcast(a, out_shape, idx))
            eb = self.expr(b, self._bcast(b, out_shape, idx))
            op = {"logical_and": "and", "bitwise_and": "and"}.get(name, name)
            op = {"logical_or": "or", "bitwise_or": "or"}.get(op, op)
            if op == "add" and eb == ("const", 0):
                return ea
            if op == "and" and _kind(tv.dtype) != "bool":
                raise _Opaque("bitwise and of integers")
            return _fold_op(op, (ea, eb))
        if name in ("bitwise_not", "logical_not") or (name == "neg" and tv.dtype == torch.bool):
            x = node.args[0]
            return _fold_op("not", (self.expr(x, idx),))
        if name in ("to", "bool", "float", "int", "long", "type", "type_as", "half", "bfloat16"):
            x = node.args[0]
            inner = self.expr(x, idx)
            src = tensor_val(x)
            if src is None:
                raise _Opaque("cast of a non-tensor")
            if _kind(tv.dtype) == "bool" and _kind(src.dtype) != "bool":
                return ("const", bool(inner[1])) if inner[0] == "const" else ("bool", inner)
            if _kind(tv.dtype) != "bool" and _kind(src.dtype) == "bool":
                return ("op", "where", (inner, ("const", 1), ("const", 0)))
            return inner
        if name in ("new_ones", "ones", "ones_like", "full", "new_full", "full_like"):
            fill = 1
            if name in ("full", "new_full", "full_like"):
                fill = arg(node, 2 if name == "new_full" else 1, "fill_value")
                if name == "new_full":
                    fill = node.args[2] if len(node.args) > 2 else node.kwargs.get("fill_value")
            return ("const", bool(fill) if tv.dtype == torch.bool else fill)
        if name in ("zeros", "new_zeros", "zeros_like"):
            return ("const", False if tv.dtype == torch.bool else 0)
        if name == "expand":
            x = node.args[0]
            return self.expr(x, self._bcast(x, out_shape, idx))
        if name in _SIZE1_VIEWS:
            x = node.args[0]
            return self.expr(x, self._size1_map(shape(x), out_shape, idx))
        if name == "where":
            c, a, b = (arg(node, i, n) for i, n in enumerate(("condition", "input", "other")))
            return _fold_op(
                "where", tuple(self.expr(t, self._bcast(t, out_shape, idx)) for t in (c, a, b))
            )
        if name == "masked_fill":
            x, m, v = node.args[0], node.args[1], arg(node, 2, "value")
            return _fold_op(
                "where",
                (
                    self.expr(m, self._bcast(m, out_shape, idx)),
                    self.expr(v, ()),
                    self.expr(x, self._bcast(x, out_shape, idx)),
                ),
            )
        if is_getitem(node) and isinstance(node.args[0], fx.Node):
            return self._getitem(node, out_shape, idx)
        folded = self._fold(node)
        if folded is not None:
            return folded if folded[0] == "const" else ("leaf", folded[1], idx)
        return ("leaf", node, idx)

    def _size1_map(self, in_shape, out_shape, idx):
        """Index map of a view that only adds or removes size-1 dimensions."""
        ins = [(j, s) for j, s in enumerate(in_shape) if s != 1]
        outs = [(j, s) for j, s in enumerate(out_shape) if s != 1]
        if [s for _, s in ins] != [s for _, s in outs]:
            raise _Opaque("a reshape that moves data")
        m = [("const", 0)] * len(in_shape)
        for (ji, _), (jo, _) in zip(ins, outs):
            m[ji] = idx[jo]
        return tuple(m)

    def _getitem(self, node, out_shape, idx):
        x, index = node.args
        items = index if isinstance(index, tuple) else (index,)
        xs = shape(x)
        tensors = [i for i in items if isinstance(i, fx.Node)]
        if tensors:
            # advanced indexing with one index tensor per dimension of x
            if len(items) != len(xs) or len(tensors) != len(items):
                raise _Opaque("mixed advanced indexing")
            return self.expr(
                x, tuple(self.expr(t, self._bcast(t, out_shape, idx)) for t in tensors)
            )
        n_consume = sum(1 for i in items if isinstance(i, (int, slice)))
        expanded = []
        for i in items:
            if i is Ellipsis:
                expanded += [slice(None)] * (len(xs) - n_consume)
            else:
                expanded.append(i)
        expanded += [slice(None)] * (len(xs) - sum(isinstance(i, (int, slice)) for i in expanded))
        in_idx, o = [], 0
        for i in expanded:
            if i is None:
                o += 1
            elif isinstance(i, int):
                in_idx.append(("const", i % xs[len(in_idx)]))
            elif isinstance(i, slice):
                start = i.start or 0
                step = i.step or 1
                e = idx[o]
                if step != 1:
                    e = ("op", "mul", (e, ("const", step)))
                if start:
                    e = ("op", "add", (e, ("const", start % xs[len(in_idx)])))
                in_idx.append(e)
                o += 1
            else:
                raise _Opaque(f"index {i!r}")
        return self.expr(x, tuple(in_idx))

    def _fold(self, node: fx.Node):
        """Evaluate a small value that depends on no input (HF's packed-sequence ids from
        in-graph position ids). Returns ("const", v) if uniform, ("tensor", node) if not."""
        tv = tensor_val(node)
        if tv is None or tv.numel() > self.fold_limit:
            return None
        env: dict[fx.Node, object] = {}

        def run(n: fx.Node):
            if n in env:
                return env[n]
            if n.op != "call_function" and n.op != "call_method":
                raise _Opaque("depends on an input")
            args = fx.node.map_arg(n.args, run)
            kwargs = fx.node.map_arg(n.kwargs, run)
            if n.op == "call_function":
                v = n.target(*args, **kwargs)
            else:
                v = getattr(args[0], n.target)(*args[1:], **kwargs)
            env[n] = v
            return v

        try:
            value = run(node)
        except _Opaque:
            return None
        except Exception:  # noqa: BLE001 - anything we cannot evaluate stays opaque
            return None
        if not isinstance(value, torch.Tensor):
            return None
        flat = value.flatten()
        if flat.numel() and bool((flat == flat[0]).all()):
            v = flat[0].item()
            return ("const", bool(v) if value.dtype == torch.bool else v)
        return ("tensor", node)


# --------------------------------------------------------------------------- classification


def _linear(e) -> dict | None:
    """A linear form {var or 1: coeff} of an index expression, or None."""
    if e[0] == "idx":
        return {e[1]: 1}
    if e[0] == "const" and isinstance(e[1], int) and not isinstance(e[1], bool):
        return {1: e[1]}
    if e[0] == "leaf":  # an element of a value (position ids at q or k): a variable of its own
        return {e: 1}
    if e[0] == "op" and e[1] in ("add", "sub") and len(e[2]) == 2:
        a, b = _linear(e[2][0]), _linear(e[2][1])
        if a is None or b is None:
            return None
        sign = 1 if e[1] == "add" else -1
        out = dict(a)
        for k, v in b.items():
            out[k] = out.get(k, 0) + sign * v
        return out
    if e[0] == "op" and e[1] == "mul":
        a, b = e[2]
        if b[0] == "const":
            la = _linear(a)
            return None if la is None else {k: v * b[1] for k, v in la.items()}
    return None


def _comparison(e, negated: bool) -> tuple[dict, int] | None:
    """``sum(coeff * idx) <= bound`` equivalent to a comparison of linear index expressions."""
    if e[0] != "op" or e[1] not in _CMP or e[1] in ("eq", "ne"):
        return None
    name = _NEGATE[e[1]] if negated else e[1]
    a, b = _linear(e[2][0]), _linear(e[2][1])
    if a is None or b is None:
        return None
    diff = dict(a)
    for k, v in b.items():
        diff[k] = diff.get(k, 0) - v
    c = diff.pop(1, 0)
    if name in ("ge", "gt"):
        diff = {k: -v for k, v in diff.items()}
        c = -c
    bound = -c - (1 if name in ("lt", "gt") else 0)  # integer indices: x < 0 <=> x <= -1
    return {k: v for k, v in diff.items() if v}, bound


def _conjuncts(e, out: list) -> None:
    if e[0] == "op" and e[1] == "and":
        for a in e[2]:
            _conjuncts(a, out)
    elif e[0] == "bool" and e[1][0] == "op" and e[1][1] in _CMP | {"and", "not"}:
        _conjuncts(e[1], out)
    else:
        out.append(e)


def _vars(e) -> set:
    if e[0] == "idx":
        return {e[1]}
    if e[0] == "const" or e[0] == "tensor":
        return set()
    if e[0] == "leaf":
        return set().union(*(_vars(i) for i in e[2])) if e[2] else set()
    if e[0] == "bool":
        return _vars(e[1])
    return set().union(*(_vars(a) for a in e[2]))


def _has_leaf(e) -> bool:
    if e[0] == "leaf":
        return True
    if e[0] in ("op",):
        return any(_has_leaf(a) for a in e[2])
    if e[0] == "bool":
        return _has_leaf(e[1])
    return False


def _condition(e, dtype: torch.dtype):
    """(condition, masked value) of a mask: a bool mask is its own condition; an additive
    float mask encodes where(C, 0, very negative)."""
    if dtype == torch.bool:
        return e, None
    if e[0] == "op" and e[1] == "where":
        c, a, b = e[2]
        if a == ("const", 0) and b[0] == "const" and b[1] <= -1e4:
            return c, b[1]
        if b == ("const", 0) and a[0] == "const" and a[1] <= -1e4:
            return ("op", "not", (c,)), a[1]
    return None, None


@dataclass
class MaskMeaning:
    kind: str  # "causal"
    key_valid: tuple | None  # expression of (b, k), or None when every key is valid
    dropped: list[str]
    window: int | None = None  # query q sees keys q - window < k <= q
    doc_ids: fx.Node | None = None  # [B|1, S]: q sees only keys of its own (contiguous) run
    doc_source: str = ""  # how the documents were found (for the report)
    # an explicit [B|1, 1, S, S] mask input: documents derived from it (and checked) per call
    user_mask: fx.Node | None = None
    # the longest sequence at which the dropped terms are still always true (a window at least
    # as wide as the sequence); None: the meaning holds at every length
    longest: int | None = None

    def describe(self, key_padding: bool) -> str:
        if self.user_mask is not None:
            return f"documents from {self.doc_source}"
        out = "causal"
        if self.window is not None:
            out += f" + sliding window {self.window}"
        if self.doc_ids is not None or self.user_mask is not None:
            out += f" + documents ({self.doc_source})"
        if key_padding:
            out += " + key padding"
        if self.dropped:
            out += " (" + "; ".join(self.dropped) + ")"
        return out


def _position_leaf(e) -> tuple[fx.Node, int] | None:
    """(node, 2 or 3) when ``e`` is ``node[b, q]`` or ``node[b, k]`` of a [B|1, S] value."""
    if e[0] != "leaf" or len(e[2]) != 2:
        return None
    b, i = e[2]
    if b not in (("idx", 0), ("const", 0)) or i not in (("idx", 2), ("idx", 3)):
        return None
    return e[1], i[1]


def _input_name(n: fx.Node) -> str:
    """``position_ids`` for Dynamo's placeholder ``l_kwargs_position_ids_``."""
    if n.op != "placeholder":
        return n.name
    name = n.name
    for prefix in ("l_kwargs_", "l_args_"):
        if name.startswith(prefix):
            name = name[len(prefix) :]
    return name.strip("_")


def _through_casts(n):
    while isinstance(n, fx.Node) and op_name(n) in ("to", "int", "long", "type") and n.args:
        n = n.args[0]
    return n


def _consecutive(ev: _Evaluator, pos: fx.Node) -> bool:
    """Are the position ids ``pos[b, q]`` the index ``q`` plus a constant (built in the graph
    from ``arange``)?"""
    tv = tensor_val(pos)
    if tv is None or tv.dim() != 2:
        return False
    try:
        e = ev.expr(pos, (("idx", 0), ("idx", 2)))
    except (_Opaque, ValueError, TypeError):
        return False
    lin = _linear(e)
    return lin is not None and {k: v for k, v in lin.items() if k != 1} == {2: 1}


def _run_ids(doc: fx.Node) -> tuple[bool, fx.Node | None]:
    """Is ``doc`` a cumulative sum along the sequence of a bool (so equal ids are contiguous
    runs)? And, when the bool is ``diff(P) != 1``, the position ids P whose runs of +1 steps
    the documents are (transformers' ``find_packed_sequence_indices``)."""
    doc = _through_casts(doc)
    if op_name(doc) != "cumsum":
        return False, None
    dim = arg(doc, 1, "dim")
    tv = tensor_val(doc)
    if tv is None or tv.dim() != 2 or dim not in (1, -1):
        return False, None
    x = _through_casts(doc.args[0])
    xv = tensor_val(x)
    if xv is None or xv.dtype != torch.bool:
        return False, None
    if op_name(x) == "ne" and len(x.args) == 2 and x.args[1] == 1:
        d = x.args[0]
        is_diff = isinstance(d, fx.Node) and op_name(d) == "diff"
        if is_diff and arg(d, 2, "dim", -1) in (1, -1) and arg(d, 1, "n", 1) == 1:
            return True, d.args[0]
    return True, None


USER_MASK_SOURCE = (
    "a 4-D mask input: every call checks, a band of rows at a time, that each batch row is "
    "block-diagonal causal (per-document causal attention, no S x S tensor); a row that is not "
    "runs on its own mask rows, a tile at a time (exact)"
)


def _user_mask(e, s: int) -> MaskMeaning | str | None:
    """An explicit ``[B|1, 1, S, S]`` mask input used as it is (a packed batch's block mask):
    its values are data, so what it means is decided per call (``documents_of_mask``)."""
    if e[0] != "leaf" or e[1].op != "placeholder" or len(e[2]) != 4:
        return None
    node, (b, _, q, k) = e[1], e[2]
    tv = tensor_val(node)
    if tv is None or tv.dim() != 4 or tuple(tv.shape[1:]) != (1, s, s):
        return None
    if b not in (("idx", 0), ("const", 0)) or q != ("idx", 2) or k != ("idx", 3):
        return None
    if tv.dtype != torch.bool and not tv.dtype.is_floating_point:
        return f"an integer 4-D mask input ({tv.dtype})"
    return MaskMeaning("causal", None, [], doc_source=USER_MASK_SOURCE, user_mask=node)


# Largest value (elements) evaluated on real data when it depends on no input (in-graph ids).
FOLD_LIMIT = 1 << 16


def classify(mask: fx.Node, s_q: int, s_k: int, fold_limit: int | None = None) -> MaskMeaning | str:
    """What ``mask`` (an SDPA attn_mask node) means, or a string saying why it is not known."""
    fold_limit = FOLD_LIMIT if fold_limit is None else fold_limit
    tv = tensor_val(mask)
    if tv is None:
        return "the mask is not a tensor"
    ndim = tv.dim()
    idx = tuple(("idx", 4 - ndim + i) for i in range(ndim))
    ev = _Evaluator(fold_limit)
    try:
        e = ev.expr(mask, idx)
    except (_Opaque, ValueError, TypeError) as err:
        return f"mask not analysable: {err}"
    user = _user_mask(e, s_q)
    if user is not None:
        return user
    cond, off_value = _condition(e, tv.dtype)
    if cond is None:
        return "float mask is not of the form where(condition, 0, -large)"
    parts: list = []
    _conjuncts(cond, parts)
    causal = False
    windows: list[int] = []
    key_terms = []
    dropped = []
    longest: list[int] = []  # the longest length at which each dropped term is always true
    docs: set[fx.Node] = set()
    # comparisons of position ids P[b, q], P[b, k] (packed sequences): (P, "causal" | W)
    positional: list[tuple[fx.Node, object]] = []
    for p in parts:
        if p == ("const", True) or p == ("const", 1):
            continue
        negated = False
        q = p
        while q[0] == "op" and q[1] == "not":
            negated, q = not negated, q[2][0]
        cmp = _comparison(q, negated)
        if not _has_leaf(q):
            if cmp is None:
                return f"unrecognised index condition {p}"
            coeffs, bound = cmp
            if coeffs == {3: 1, 2: -1} and bound == 0:
                causal = True
                continue
            if coeffs == {2: 1, 3: -1} and bound >= s_q - 1:  # q - k <= W - 1 with W >= S
                dropped.append(f"window q-k <= {bound} (always true at length {s_q})")
                longest.append(bound + 1)
                continue
            if coeffs == {2: 1, 3: -1} and bound >= 0:  # a sliding window q - k < W
                windows.append(bound + 1)
                continue
            if coeffs == {3: 1, 2: -1} and bound >= s_k - 1:
                dropped.append("an always-true comparison")
                longest.append(bound + 1)
                continue
            return f"unsupported index condition {p}"
        if _vars(p) <= {0, 3}:
            key_terms.append(p)
            continue
        if not negated and q[0] == "op" and q[1] == "eq":
            sides = [_position_leaf(x) for x in q[2]]
            if all(sides) and sides[0][0] is sides[1][0] and {sides[0][1], sides[1][1]} == {2, 3}:
                if _run_ids(sides[0][0])[0]:
                    docs.add(sides[0][0])
                    continue
                return f"documents whose ids are not contiguous runs (not a cumsum): {p}"
        if cmp is not None and len(cmp[0]) == 2:
            coeffs, bound = cmp
            (a, ca), (b, cb) = coeffs.items()
            la, lb = _position_leaf(a), _position_leaf(b)
            if la and lb and la[0] is lb[0] and {ca, cb} == {1, -1}:
                pos = {la[1]: ca, lb[1]: cb}
                if pos == {3: 1, 2: -1} and bound == 0:
                    positional.append((la[0], "causal"))
                    continue
                if pos == {2: 1, 3: -1} and bound >= 0:
                    positional.append((la[0], bound + 1))
                    continue
        return f"a mask term depends on the query position and an input: {p}"
    if len(docs) > 1:
        return "more than one document-id tensor"
    doc = next(iter(docs), None)
    doc_source = ""
    if doc is not None:
        doc_source = "ids from a cumulative sum"
        pos = _run_ids(doc)[1]
        if pos is not None and _consecutive(ev, pos):
            # position ids built in the graph (arange): one run, one document per row —
            # what transformers' packed-sequence check gives when nothing is packed
            dropped.append(f"documents of consecutive {_input_name(pos)}: one per row")
            doc = None
    for pos, what in positional:
        # Comparing positions equals comparing indices only inside a run of +1 steps of P:
        # the documents must be exactly those runs.
        if doc is None or _run_ids(doc)[1] is not pos:
            return (
                f"the mask compares position ids ({pos.name}) without documents that are "
                "their runs of consecutive positions"
            )
        doc_source = f"runs of consecutive {_input_name(pos)}"
        if what == "causal":
            causal = True
        elif what >= s_q:
            dropped.append(f"window {what} (always true at length {s_q})")
            longest.append(what)
        else:
            windows.append(what)
    if not causal:
        return "the mask is not causal"
    if key_terms and off_value is not None:
        # With key padding some query rows (left padding) see no key at all. An additive mask
        # makes such a row attend *uniformly to every key* (finite minimum) or produce NaN
        # (-inf) — not what the causal kernel does (zeros). Keep those semantics exact: the
        # sequence pass cuts the mask's local rows instead.
        return (
            "additive mask with key padding: fully masked (padding) query rows would attend "
            "uniformly to all keys; kept exact by cutting the mask's local rows"
        )
    key = None
    for t in key_terms:
        key = t if key is None else ("op", "and", (key, t))
    window = min(windows) if windows else None
    return MaskMeaning(
        "causal", key, dropped, window, doc, doc_source, longest=min(longest, default=None)
    )


# --------------------------------------------------------------------------- emitting key_valid


class _Emitter:
    """FX nodes computing a ``(b, k)`` expression as a ``[B, S]`` bool tensor."""

    def __init__(self, g: fx.Graph, b: int, s: int):
        self.g, self.b, self.s = g, b, s

    def emit(self, e):
        g = self.g
        kind = e[0]
        if kind == "const":
            return g.call_function(torch.full, ((self.b, self.s), e[1]))
        if kind == "leaf":
            node, idx = e[1], e[2]
            ns = shape(node)
            if idx == (("idx", 0), ("idx", 3)) and ns == (self.b, self.s):
                return node
            if idx == (("const", 0), ("idx", 3)) and len(ns) == 2 and ns[1] == self.s:
                return g.call_function(operator.getitem, (node, (slice(0, 1), slice(None))))
            raise _Opaque(f"key term indexes {node} as {idx}")
        if kind == "bool":
            x = self.emit(e[1])
            return g.call_method("ne", (x, 0))
        if kind == "op":
            args = [self.emit(a) if a[0] != "const" else a[1] for a in e[2]]
            fn = {
                "and": torch.logical_and,
                "or": torch.logical_or,
                "not": torch.logical_not,
                "eq": torch.eq,
                "ne": torch.ne,
                "le": torch.le,
                "lt": torch.lt,
                "ge": torch.ge,
                "gt": torch.gt,
                "add": torch.add,
                "sub": torch.sub,
                "mul": torch.mul,
                "where": torch.where,
            }.get(e[1])
            if fn is None:
                raise _Opaque(f"op {e[1]}")
            return g.call_function(fn, tuple(args))
        raise _Opaque(f"expression {kind}")


def _new_nodes_feeding(kv: fx.Node, stop: fx.Node) -> list[fx.Node]:
    out, stack = [], [kv]
    while stack:
        n = stack.pop()
        for i in n.all_input_nodes:
            if i.op in ("call_function", "call_method") and "val" in i.meta and i not in out:
                out.append(i)
    return out


@dataclass
class MaskReport:
    sdpa: str
    module: str
    recognised: bool
    detail: str
    # what ran: "causal", "sliding_window", "documents", "sliding_window+documents", or
    # "dense_rows" (not recognised: each rank cuts its query rows of the mask — exact)
    kind: str = "dense_rows"
    window: int | None = None
    documents: str | None = None  # where the document ids came from
    # the longest sequence this meaning holds at (a window dropped as at least as wide as the
    # sequence); None: every length (``tspc/length_family.py`` reads it)
    longest: int | None = None


def _kind_of(meaning: MaskMeaning) -> str:
    parts = []
    if meaning.window is not None:
        parts.append("sliding_window")
    if meaning.doc_ids is not None or meaning.user_mask is not None:
        parts.append("documents")
    return "+".join(parts) or "causal"


def _keep_full(n: fx.Node) -> None:
    """``n`` and the values it is computed from stay whole on every rank: every query
    chunk needs every key's document id (they are [B, S] integers, not S x S)."""
    stack = [n]
    while stack:
        x = stack.pop()
        if x.op not in ("call_function", "call_method") or x.meta.get("tspc_keep_full"):
            continue
        x.meta["tspc_keep_full"] = True
        stack.extend(x.all_input_nodes)


def _document_ids(g: fx.Graph, doc: fx.Node, batch: int, before: fx.Node) -> fx.Node:
    """The [B, S] document ids the kernel takes (``doc`` may have batch 1)."""
    _keep_full(doc)
    if shape(doc)[0] == batch:
        return doc
    with g.inserting_before(before):
        out = set_fake_value(g.call_method("expand", (doc, batch, -1)))
    out.meta["tspc_keep_full"] = True
    return out


def classify_masks(gm: fx.GraphModule) -> list[MaskReport]:
    """Replace SDPA calls whose explicit mask is causal (+ window, documents, key padding) by
    ``causal_attention``; report what every mask was recognised as, or why not."""
    from .graph_utils import node_module_fqn

    reports = []
    cache: dict[fx.Node, MaskMeaning | str] = {}
    key_nodes: dict[tuple, fx.Node] = {}
    doc_nodes: dict[fx.Node, fx.Node] = {}
    g = gm.graph
    for node in list(g.nodes):
        if op_name(node) != "sdpa" or node.target is causal_attention:
            continue
        a = sdpa_args(node)
        mask = a["attn_mask"]
        if not isinstance(mask, fx.Node) or a["is_causal"] or a["dropout_p"] not in (0, 0.0):
            continue
        qs, ks = shape(a["query"]), shape(a["key"])
        if len(qs) != 4 or qs[2] != ks[2]:
            continue
        if mask not in cache:
            cache[mask] = classify(mask, qs[2], ks[2])
        meaning = cache[mask]
        where = node_module_fqn(node)
        if isinstance(meaning, str):
            reports.append(MaskReport(node.name, where, False, meaning))
            continue
        key_valid = None
        if meaning.key_valid is not None:
            if meaning.key_valid not in key_nodes:
                try:
                    with g.inserting_before(node):
                        kv = _Emitter(g, qs[0], ks[2]).emit(meaning.key_valid)
                        if tensor_val(kv) is None:
                            set_fake_value(kv)
                        if tensor_val(kv).dtype != torch.bool:
                            kv = set_fake_value(g.call_method("bool", (kv,)))
                except _Opaque as err:
                    reports.append(MaskReport(node.name, where, False, f"key padding: {err}"))
                    continue
                # the key padding must stay whole: every rank attends to every key
                kv.meta["tspc_keep_full"] = True
                for n in _new_nodes_feeding(kv, node):
                    n.meta["tspc_keep_full"] = True
                key_nodes[meaning.key_valid] = kv
            key_valid = key_nodes[meaning.key_valid]
        doc_ids = None
        if meaning.user_mask is not None and meaning.user_mask not in doc_nodes:
            with g.inserting_before(node):
                op = torch.ops.tspc.documents_of_mask.default
                ids = set_fake_value(g.call_function(op, (meaning.user_mask,)))
            doc_nodes[meaning.user_mask] = _document_ids(g, ids, qs[0], node)
        doc_src = meaning.doc_ids if meaning.user_mask is None else meaning.user_mask
        if doc_src is not None:
            if doc_src not in doc_nodes:
                doc_nodes[doc_src] = _document_ids(g, doc_src, qs[0], node)
            doc_ids = doc_nodes[doc_src]
        scale = a["scale"] if a["scale"] is not None else 1.0 / math.sqrt(qs[3])
        node.target = causal_attention
        node.args = (a["query"], a["key"], a["value"], key_valid, float(scale))
        node.kwargs = {"window": meaning.window, "doc_ids": doc_ids}
        if meaning.user_mask is not None:
            node.kwargs = {**node.kwargs, "dense_mask": meaning.user_mask}
        reports.append(
            MaskReport(
                node.name,
                where,
                True,
                meaning.describe(key_valid is not None),
                kind=_kind_of(meaning),
                window=meaning.window,
                documents=meaning.doc_source or None,
                longest=meaning.longest,
            )
        )
    eliminate_dead_code(g)
    gm.recompile()
    return reports
