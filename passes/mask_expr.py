"""Symbolic evaluation of an attention mask's subgraph (used by ``passes/classify_mask.py``).

``MaskEvaluator`` turns each element ``mask[b, h, q, k]`` of a mask built in the graph into an
expression over the index variables and the graph's inputs (``kv_idx <= q_idx``,
``attention_mask[b, kv_idx]``, ...), folding what is constant at this length; a value it does
not model raises ``Opaque``. What the expression means (causal, window, documents, key padding)
is ``classify_mask``'s job.
"""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from .graph_utils import arg, is_getitem, op_name, set_fake_value, shape, tensor_val

# --------------------------------------------------------------------------- expressions
# Tuples, so that they hash and compare structurally:
#   ("idx", i)            the i-th index of the mask (0=b, 1=h, 2=q, 3=k)
#   ("const", v)          a Python number or bool
#   ("leaf", node, idx)   element ``node[idx...]`` of a value this pass does not model
#   ("op", name, args)    an elementwise operation
#   ("bool", x)           x converted to bool (x != 0)


class Opaque(Exception):
    pass


COMPARISONS = {"le", "lt", "ge", "gt", "eq", "ne"}
NEGATED = {"le": "gt", "lt": "ge", "ge": "lt", "gt": "le", "eq": "ne", "ne": "eq"}
_SIZE1_VIEWS = ("view", "reshape", "unsqueeze", "squeeze", "contiguous", "clone", "detach")
_BINARY = {
    "add",
    "sub",
    "mul",
    "bitwise_and",
    "bitwise_or",
    "logical_and",
    "logical_or",
} | COMPARISONS


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
    if name in _PY and name not in ("where", "not") and len(args) == 2:
        # ``tril(ones(S, S)) == 0`` (nanoGPT): a comparison of where(c, 1, 0) with a constant
        # is where(c, 1 == 0, 0 == 0), which the rule below makes ``not c``
        for i in (0, 1):
            w, other = args[i], args[1 - i]
            if w[:2] == ("op", "where") and other[0] == "const":
                c, a, b = w[2]
                if a[0] == "const" and b[0] == "const":
                    branch = [(x, other) if i == 0 else (other, x) for x in (a, b)]
                    return _fold_op("where", (c, *(_fold_op(name, pair) for pair in branch)))
    bool_branches = name == "where" and all(
        a[0] == "const" and type(a[1]) is bool for a in args[1:]
    )
    if bool_branches and args[1][1] != args[2][1]:
        # ``ones(S, S, dtype=bool).tril()`` is where(k <= q, True, False): the condition itself
        return args[0] if args[1][1] else _fold_op("not", (args[0],))
    if name == "not" and args[0][:2] == ("op", "not"):
        return args[0][2][0]  # ``~~m``: a mask negated for masked_fill, then for SDPA
    return ("op", name, args)


class MaskEvaluator:
    def __init__(self, fold_limit: int):
        self.fold_limit = fold_limit
        self.memo: dict = {}

    def expr(self, x, idx: tuple) -> tuple:
        if not isinstance(x, fx.Node):
            if isinstance(x, (bool, int, float)):
                return ("const", x)
            raise Opaque(f"argument {x!r}")
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
                raise Opaque("bitwise and of integers")
            return _fold_op(op, (ea, eb))
        if name in ("bitwise_not", "logical_not") or (name == "neg" and tv.dtype == torch.bool):
            x = node.args[0]
            return _fold_op("not", (self.expr(x, idx),))
        if name in ("to", "bool", "float", "int", "long", "type", "type_as", "half", "bfloat16"):
            x = node.args[0]
            inner = self.expr(x, idx)
            src = tensor_val(x)
            if src is None:
                raise Opaque("cast of a non-tensor")
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
        if name in ("masked_fill", "masked_fill_"):
            # in place too: torch's ``_canonical_mask`` writes a bool mask into zeros with
            # ``masked_fill_`` (nn.MultiheadAttention's and nn.TransformerEncoder's masks); the
            # node's value is the filled tensor
            x, m, v = node.args[0], node.args[1], arg(node, 2, "value")
            return _fold_op(
                "where",
                (
                    self.expr(m, self._bcast(m, out_shape, idx)),
                    self.expr(v, ()),
                    self.expr(x, self._bcast(x, out_shape, idx)),
                ),
            )
        if name in ("triu", "tril") and len(out_shape) >= 2:
            # nanoGPT-style ``full((S, S), -inf).triu(1)``: element [i, j] is kept where
            # j - i >= diagonal (triu) / <= diagonal (tril), else 0
            x, diag = node.args[0], arg(node, 1, "diagonal", 0)
            if not isinstance(diag, int):
                raise Opaque(f"{name} with a diagonal of {diag!r}")
            diff = _fold_op("sub", (idx[-1], idx[-2]))
            keep = _fold_op("ge" if name == "triu" else "le", (diff, ("const", diag)))
            zero = ("const", False if tv.dtype == torch.bool else 0)
            return _fold_op("where", (keep, self.expr(x, idx), zero))
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
            raise Opaque("a reshape that moves data")
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
                raise Opaque("mixed advanced indexing")
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
                raise Opaque(f"index {i!r}")
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
                raise Opaque("depends on an input")
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
        except Opaque:
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


# --------------------------------------------------------------------------- emitting key_valid
# (classify_mask.py: the key padding term of a recognised mask, as a [B, S] tensor)


def _valued(node: fx.Node) -> fx.Node:
    """A new node with its fake value, so that a node built on it can be evaluated too (the
    caller evaluates only the outermost); a node of constants alone is left without."""
    try:
        return set_fake_value(node)
    except ValueError:
        return node


class KeyTermEmitter:
    """FX nodes computing a ``(b, k)`` expression as a ``[B, S]`` bool tensor."""

    def __init__(self, g: fx.Graph, b: int, s: int, like: fx.Node | None = None):
        """``like``: a node whose fake value gives the device (and the fake mode of the
        index tensors, which have no input to take one from)."""
        self.g, self.b, self.s = g, b, s
        self.like = tensor_val(like) if like is not None else None
        self.device = self.like.device if self.like is not None else None

    def emit(self, e):
        g = self.g
        kind = e[0]
        if kind == "const":
            return g.call_function(torch.full, ((self.b, self.s), e[1]), {"device": self.device})
        if kind == "idx" and e[1] in (0, 3) and self.like is not None:
            # the batch or key index itself (``mask[:, :2] = -inf`` hides keys by index)
            n = self.b if e[1] == 0 else self.s
            ar = g.call_function(torch.arange, (n,), {"device": self.device})
            with self.like.fake_mode:
                ar.meta["val"] = torch.arange(n, device=self.device)
            view = (n, 1) if e[1] == 0 else (1, n)
            return _valued(
                g.call_method(
                    "expand", (_valued(g.call_method("view", (ar, *view))), self.b, self.s)
                )
            )
        if kind == "leaf":
            node, idx = e[1], e[2]
            ns = shape(node)
            if idx == (("idx", 0), ("idx", 3)) and ns == (self.b, self.s):
                return node
            if idx == (("const", 0), ("idx", 3)) and len(ns) == 2 and ns[1] == self.s:
                return g.call_function(operator.getitem, (node, (slice(0, 1), slice(None))))
            raise Opaque(f"key term indexes {node} as {idx}")
        if kind == "bool":
            x = self.emit(e[1])
            return _valued(g.call_method("ne", (x, 0)))
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
                raise Opaque(f"op {e[1]}")
            return _valued(g.call_function(fn, tuple(args)))
        raise Opaque(f"expression {kind}")
