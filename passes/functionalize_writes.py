"""Pass 1a — in-place writes into tensors the graph itself builds, made pure before any pass reads the graph.

Every pass reads a node's value as what the node computes. An in-place write breaks that: after
``mask = torch.zeros(S, S); mask.masked_fill_(upper, -inf)`` the attention reads the ``zeros``
node, whose value the write changed later in the graph; after ``h = torch.zeros_like(x);
h[:, 1:] = x[:, :-1]`` or ``x = x.clone(); x[:, 0] = 0`` the sequence pass cuts each rank's
tokens from the node as computed, and the write lands on a gathered copy nobody reads. Both ran
at D = 2 with 0.2-0.9 relative error, silently, before this pass.

Which nodes a write reaches is read from the fake values, not from op names: two nodes alias
when their values share a storage (``StorageWeakRef``), so every view — ``x[i]``, ``transpose``,
``view``, a ``split``'s piece, however written — is seen. For each storage the graph creates
itself (no graph input or attribute among its nodes) that something writes in place, one walk
in graph order keeps the storage's *current value* as a node:

* a write makes a new current value, out of place: the write's out-of-place twin when it writes
  the whole tensor (``masked_fill_`` -> ``masked_fill``, ``triu_``, ``x += y``), a
  ``masked_fill`` over the written region when it writes one number into a basic index
  (``mask[:, :2] = -inf``, ``m[:3].fill_(0)``: index comparisons the mask classifier reads as
  such), and otherwise ``tspc.ops.writes.written_copy`` — torch itself doing the write on a
  clone (a tensor written through any chain of views, advanced indices, anything);
* a node that reads the storage (the tensor or any view of it) after a write reads the view
  replayed on the current value (the same view ops, copied), so readers before and after a
  write see what torch's aliasing gives them.

Writes into the inputs the caller names (``inputs``: the pipeline names the user's inputs, which
the sequence pass cuts to each rank's tokens — a write at a token index, ``x[:, -1] = 0``, would
land on the wrong token) are made pure the same way, and the last value is copied back into the
caller's tensor at the end of the graph. Writes into module tensors (a KV cache, a running
statistic) are left as they are: they are whole on every rank, and the caller sees them. A write into a graph-created storage this pass cannot express (an ``out=``
argument, an ATen op writing several arguments, a view it cannot replay) raises
``UnsupportedWrite``: the pipeline then runs the graph unsharded, which is exact.
"""

from __future__ import annotations

import functools
import inspect
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from tspc.ops.writes import written_copy

from .graph_utils import INPLACE_OPERATORS, is_view, mutated_args, tensor_val

# ``x += y`` and the like: Dynamo records them as these operator calls on tensors
_OPERATOR_TWINS = {
    operator.iadd: operator.add,
    operator.isub: operator.sub,
    operator.imul: operator.mul,
    operator.itruediv: operator.truediv,
}
# in-place by name, no data written
_METADATA_ONLY = {"requires_grad_", "retain_grad", "share_memory_"}


class UnsupportedWrite(Exception):
    """An in-place write into a tensor the graph creates that this pass cannot make pure."""


def _storage(n: object):
    v = tensor_val(n) if isinstance(n, fx.Node) else None
    if v is None:
        return None
    try:
        return StorageWeakRef(v.untyped_storage())
    except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, nested)
        return None


def _method_name(n: fx.Node) -> str | None:
    """The Tensor method a node calls on its first argument: ``x.view(...)``, ``x[i]``
    (``__getitem__``), ``x[i] = v`` (``__setitem__``), ``torch.transpose(x, ...)``
    (``transpose``); None for anything else."""
    if n.op == "call_method":
        return n.target
    if n.op != "call_function":
        return None
    if n.target in INPLACE_OPERATORS:
        return INPLACE_OPERATORS[n.target]
    if n.target is operator.getitem:
        return "__getitem__"
    name = getattr(n.target, "__name__", None)
    if name and not isinstance(n.target, type) and callable(getattr(torch.Tensor, name, None)):
        return name
    return None


def _step(n: fx.Node) -> tuple:
    """``n`` as a ``written_copy`` step: (method name, args after the first, kwargs)."""
    name = _method_name(n)
    if name is None or not n.args:
        raise UnsupportedWrite(f"'{n.name}' ({n.target}) is not a Tensor method call")
    return (name, tuple(n.args[1:]), dict(n.kwargs))


@functools.cache
def _inplace_position(fn) -> int | None:
    try:
        params = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature
        return None
    return params.index("inplace") if "inplace" in params else None


def _inplace_flag(n: fx.Node) -> tuple[tuple, dict] | None:
    """``n``'s arguments with its ``inplace=True`` set to False (``F.relu(x, inplace=True)``,
    ``F.dropout(x, 0.1, True, True)``, as Dynamo records ``nn.ReLU(inplace=True)`` and
    ``nn.Dropout(inplace=True)``), or None."""
    if n.op != "call_function" or not n.args or not isinstance(n.args[0], fx.Node):
        return None
    if n.kwargs.get("inplace") is True:
        return n.args, {**n.kwargs, "inplace": False}
    at = _inplace_position(n.target)
    if at is not None and len(n.args) > at and n.args[at] is True:
        return (*n.args[:at], False, *n.args[at + 1 :]), dict(n.kwargs)
    return None


def _written(n: fx.Node) -> fx.Node | None:
    """The node ``n`` writes in place, if it is a data write."""
    if n.op == "call_method" and n.target in _METADATA_ONLY:
        return None
    written = mutated_args(n)
    if not written:
        if isinstance(n.kwargs.get("out"), fx.Node):
            return n.kwargs["out"]
        return n.args[0] if _inplace_flag(n) is not None else None
    return written[-1]


@dataclass
class _Storage:
    """One storage the graph creates and writes: its nodes, current value and version."""

    base: fx.Node
    current: fx.Node
    version: int = 0
    # node -> the view nodes from the base (exclusive) to it: how to replay it
    paths: dict[fx.Node, list[fx.Node]] = field(default_factory=dict)
    # node -> the version its value reflects
    reflects: dict[fx.Node, int] = field(default_factory=dict)
    replayed: dict[tuple[fx.Node, int], fx.Node] = field(default_factory=dict)


def _path(n: fx.Node, base: fx.Node, key) -> list[fx.Node]:
    """The view nodes from ``base`` to ``n`` (each reads the previous as its first argument;
    a ``split``'s tuple in between), or raise."""
    out = []
    while n is not base:
        out.append(n)
        src = n.args[0] if n.args else None
        k = _storage(src) if isinstance(src, fx.Node) else None
        if not isinstance(src, fx.Node) or (k is not None and k != key):
            raise UnsupportedWrite(f"'{n.name}' views the written tensor in a way not replayable")
        n = src
        if len(out) > 64:
            raise UnsupportedWrite("a view chain too long to replay")
    out.reverse()
    return out


def _meta_like(n: object) -> object:
    v = tensor_val(n) if isinstance(n, fx.Node) else None
    if v is None:
        return n
    return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")


def _twin_keeps_dtype(fn, base: fx.Node, args: tuple, kwargs: dict) -> bool:
    """Whether the out-of-place twin gives the in-place op's result (same dtype and shape):
    ``x.add_(y)`` keeps ``x``'s dtype, ``x.add(y)`` promotes."""
    meta = fx.node.map_aggregate((args, kwargs), _meta_like)
    try:
        out = fn(_meta_like(base), *meta[0], **meta[1])
    except Exception:  # noqa: BLE001 - no twin after all: the generic form is used
        return False
    b = tensor_val(base)
    return isinstance(out, torch.Tensor) and out.dtype == b.dtype and out.shape == b.shape


def _is_scalar(v: object) -> bool:
    if isinstance(v, bool | int | float):
        return True
    t = tensor_val(v) if isinstance(v, fx.Node) else None
    return t is not None and t.dim() == 0


def _basic_index(idx: object, ndim: int) -> list | None:
    """A per-dimension list (an int, a ``slice``, or None for "all") of a basic index with
    static bounds, or None for anything else (tensors, symbolic bounds)."""
    items = list(idx) if isinstance(idx, tuple) else [idx]
    if any(i is not None and not isinstance(i, int | slice | type(Ellipsis)) for i in items):
        return None
    if isinstance(idx, bool) or any(isinstance(i, bool) for i in items):
        return None
    for i in items:
        if isinstance(i, slice) and not all(
            b is None or (isinstance(b, int) and not isinstance(b, bool))
            for b in (i.start, i.stop, i.step)
        ):
            return None
    real = [i for i in items if i is not None and i is not Ellipsis]
    if items.count(Ellipsis) > 1 or len(real) > ndim:
        return None
    if Ellipsis in items:
        at = items.index(Ellipsis)
        before = [i for i in items[:at] if i is not None]
        after = [i for i in items[at + 1 :] if i is not None]
        dims = before + [slice(None)] * (ndim - len(before) - len(after)) + after
    else:
        dims = real + [slice(None)] * (ndim - len(real))
    return dims


class _Builder:
    """Inserts nodes before one node, each carrying the write's source metadata."""

    def __init__(self, g: fx.Graph, before: fx.Node, meta_from: fx.Node) -> None:
        self.g, self.before = g, before
        self.meta = {k: v for k, v in meta_from.meta.items() if k not in ("val", "example_value")}

    def __call__(self, op: str, target, args: tuple, kwargs: dict | None = None) -> fx.Node:
        with self.g.inserting_before(self.before):
            n = self.g.create_node(op, target, args, kwargs or {})
        n.meta.update(self.meta)
        return n


def _region(make: _Builder, dims: list, shape: tuple, device) -> fx.Node | None:
    """A bool node, broadcastable to ``shape``, true where the basic index ``dims`` writes;
    None when the index writes everything."""
    cond = None
    for d, sel in enumerate(dims):
        n = int(shape[d])
        if isinstance(sel, slice):
            start, stop, step = sel.indices(n)
            if (start, stop, step) == (0, n, 1):
                continue
        ar = make("call_function", torch.arange, (n,), {"device": device})
        if isinstance(sel, int):
            c = make("call_function", operator.eq, (ar, sel % n if sel < 0 else sel))
        else:
            parts = []
            if start > 0:
                parts.append(make("call_function", operator.ge, (ar, start)))
            if stop < n:
                parts.append(make("call_function", operator.lt, (ar, stop)))
            if step != 1:
                off = make("call_function", operator.sub, (ar, start)) if start else ar
                rem = make("call_function", operator.mod, (off, step))
                parts.append(make("call_function", operator.eq, (rem, 0)))
            c = parts[0]
            for other in parts[1:]:
                c = make("call_function", operator.and_, (c, other))
        view = [1] * len(shape)
        view[d] = n
        c = make("call_method", "view", (c, *view))
        cond = c if cond is None else make("call_function", operator.and_, (cond, c))
    return cond


def _fill_value(write: fx.Node, name: str) -> object | None:
    """The one number a write stores everywhere it writes (``fill_(v)``, ``zero_()``,
    ``x[i] = v``), or None."""
    if name == "zero_" and len(write.args) == 1:
        return 0
    if name == "fill_" and len(write.args) == 2 and _is_scalar(write.args[1]):
        return write.args[1]
    if name == "__setitem__" and len(write.args) == 3 and _is_scalar(write.args[2]):
        return write.args[2]
    return None


def _fill_fits(base: fx.Node, value: object) -> bool:
    """``masked_fill`` stores ``value`` as the write would (no int/float mismatch)."""
    dtype = tensor_val(base).dtype
    if isinstance(value, fx.Node):
        return tensor_val(value).dtype == dtype
    if dtype == torch.bool:
        return isinstance(value, bool)
    if dtype.is_floating_point or dtype.is_complex:
        return True
    return isinstance(value, int)


def _new_value(make: _Builder, st: _Storage, write: fx.Node, target: fx.Node) -> fx.Node:
    """The storage's value after ``write`` (into ``target``, a node of the storage)."""
    path = st.paths[target]
    cur, b = st.current, st.base
    flagged = _inplace_flag(write)
    if flagged is not None:  # F.relu(x, inplace=True): the same call with inplace=False
        if path:
            raise UnsupportedWrite(f"'{write.name}' ({write.target}) writes a view in place")
        args, kwargs = flagged
        return make("call_function", write.target, (cur, *args[1:]), kwargs)
    name = _method_name(write)
    if name is None:
        raise UnsupportedWrite(f"'{write.name}' ({write.target}) writes in a form not replayable")
    if isinstance(write.kwargs.get("out"), fx.Node):
        raise UnsupportedWrite(f"'{write.name}' ({write.target}) writes through out=")
    shape, device = tensor_val(b).shape, tensor_val(b).device
    if not path:  # the whole tensor: the out-of-place twin
        rest = (cur, *write.args[1:])
        if write.target in _OPERATOR_TWINS:
            fn = _OPERATOR_TWINS[write.target]
            twin = ("call_function", fn, rest, write.kwargs)
        elif name.endswith("_") and hasattr(torch.Tensor, name[:-1]):
            fn = getattr(torch.Tensor, name[:-1])
            twin = ("call_method", name[:-1], rest, write.kwargs)
        else:
            fn = None
        if fn is not None and _twin_keeps_dtype(fn, b, write.args[1:], write.kwargs):
            return make(*twin)
    value = _fill_value(write, name)
    index = None
    if value is not None and _fill_fits(b, value):
        if not path and name == "__setitem__":
            index = _basic_index(write.args[1], len(shape))
        elif len(path) == 1 and _method_name(path[0]) == "__getitem__" and name != "__setitem__":
            index = _basic_index(path[0].args[1], len(shape))
        elif not path:
            index = [slice(None)] * len(shape)
    if index is not None:
        region = _region(make, index, shape, device)
        if region is None:
            return make("call_function", torch.full_like, (cur, value))
        return make("call_method", "masked_fill", (cur, region, value))
    views = tuple(_step(p) for p in path)
    return make("call_function", written_copy, (cur, views, _step(write)))


def functionalize_writes(gm: fx.GraphModule, inputs: Iterable[fx.Node] = ()) -> list[str]:
    """Make every in-place write into a storage the graph creates pure (module docstring);
    the written nodes' names. ``inputs``: graph inputs (placeholders) whose writes are made
    pure too, each written back to the caller's tensor once, at the end of the graph (a node
    marked ``tspc_keep_full``: it writes the whole input, not this rank's tokens). Raises
    ``UnsupportedWrite`` for a write it cannot express."""
    g = gm.graph
    pure_inputs = set(inputs)
    nodes = list(g.nodes)
    by_key: dict = {}
    for n in nodes:
        k = _storage(n)
        if k is not None:
            by_key.setdefault(k, []).append(n)
    writes: dict[fx.Node, tuple] = {}  # write -> (storage key, the node it writes)
    for n in nodes:
        t = _written(n)
        k = _storage(t)
        if k is None or k not in by_key:
            continue
        members = by_key[k]
        outside = [m for m in members if m.op in ("placeholder", "get_attr")]
        if outside and (len(outside) > 1 or outside[0] not in pure_inputs):
            continue  # a module's tensor or an input left to the caller: it sees the write
        while t in writes:  # ``w += 1; w.relu_()``: the second writes what the first returned
            t = writes[t][1]
        writes[n] = (k, t)
    if not writes:
        return []

    storages: dict = {}
    owner: dict[fx.Node, _Storage] = {}
    for k in {k for k, _ in writes.values()}:
        members = by_key[k]
        st = _Storage(base=members[0], current=members[0])
        for m in members:
            # ``y.mul_(2)`` returns ``y``: reading it reads what it wrote
            target = writes[m][1] if m in writes else m
            if target not in st.paths:
                st.paths[target] = _path(target, st.base, k)
            st.paths[m] = st.paths[target]
            owner[m] = st
            st.reflects[m] = 0
        storages[k] = st

    def replay(a: fx.Node, before: fx.Node) -> fx.Node:
        """``a`` as it reads now: its views replayed on the storage's current value."""
        st = owner[a]
        if st.reflects.get(a) == st.version:
            return a
        path = st.paths[a]
        key = (path[-1] if path else st.base, st.version)
        if key in st.replayed:
            return st.replayed[key]
        src = st.current
        for p in path:
            first = p.args[0]
            with g.inserting_before(before):
                new = g.node_copy(p, lambda x, first=first, src=src: src if x is first else x)
            src = new
        st.paths[src] = path
        st.reflects[src] = st.version
        owner[src] = st
        st.replayed[key] = src
        return src

    def read_now(n: fx.Node) -> None:
        for a in list(n.all_input_nodes):
            if a in owner and owner[a].reflects.get(a) != owner[a].version:
                n.replace_input_with(a, replay(a, n))

    done = []
    for n in nodes:
        if n not in writes:
            read_now(n)
            if n in owner:  # a view read now: it reflects the current value
                owner[n].reflects[n] = owner[n].version
            continue
        k, target = writes[n]
        st = storages[k]
        read_now(n)
        make = _Builder(g, n, n)
        new = _new_value(make, st, n, target)
        st.version += 1
        st.current = new
        st.paths[new], st.reflects[new] = [], st.version
        owner[new] = st
        if n.users:  # an in-place method returns the tensor it wrote
            n.replace_all_uses_with(replay(target, n))
        done.append(f"{_method_name(n)} on {st.base.name}")
        g.erase_node(n)
    for st in storages.values():  # the caller's tensor gets what the writes left in it
        if st.base.op == "placeholder":
            with g.inserting_before(g.output_node()):
                back = g.call_method("copy_", (st.base, st.current))
            back.meta["tspc_keep_full"] = True
            done.append(f"{st.base.name} written back")
    # views of old values that only the erased writes read
    original = set(nodes)
    for n in reversed(list(g.nodes)):
        if n in owner and not n.users and (n not in original or is_view(n)):
            g.erase_node(n)
    gm.recompile()
    return done
