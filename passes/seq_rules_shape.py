"""Sequence-sharding rules for shape operations: views and reshapes (their size arguments
rewritten for the local length), transposes and permutes, indexing, split/cat/stack, padding,
repeats. Same contract as ``seq_rules_math.py``: set ``p.layout[node]``, or return False to
have the inputs gathered."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.fx as fx

from .graph_utils import arg, set_arg, shape, tensor_val
from .layout import (
    Sharded,
    map_broadcast,
    map_getitem,
    map_permute,
    map_transpose,
    map_view,
    rewrite_sizes,
)

if TYPE_CHECKING:
    from .seq_rule_api import SequencePropagator


# ---- shape ops
def _sizes_arg(node: fx.Node):
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


def _local_sizes(sizes: list, index: int, out: Sharded, out_shape) -> list | None:
    """``sizes`` with entry ``index`` (the split dim's size) made the local length (None: the
    sizes do not keep the split factor whole)."""
    n = out_shape[out.dim]
    return rewrite_sizes(sizes, index, n, out.local_size(n))


def _set_local_sizes(node: fx.Node, out: Sharded, out_shape) -> bool:
    """Rewrite ``node``'s size argument for the local length of the split dim (False: the
    sizes do not keep the split factor whole)."""
    sizes, setter = _sizes_arg(node)
    new = _local_sizes(sizes, out.dim, out, out_shape)
    if new is None:
        return False
    setter(new)
    return True


def _set_local_view_sizes(node: fx.Node, out: Sharded, out_shape) -> bool:
    """``_set_local_sizes`` for view and reshape, declined for sizes computed in the graph."""
    sizes, _ = _sizes_arg(node)
    return not any(isinstance(s, fx.Node) for s in sizes) and _set_local_sizes(node, out, out_shape)


def _set_local_unflatten_sizes(node: fx.Node, out: Sharded, out_shape) -> bool:
    """``_set_local_sizes`` for unflatten, whose sizes stand for dims dim.. of its output."""
    dim = arg(node, 1, "dim") % len(shape(node.args[0]))
    sizes = list(arg(node, 2, "sizes"))
    if dim <= out.dim < dim + len(sizes):
        new = _local_sizes(sizes, out.dim - dim, out, out_shape)
        if new is None:
            return False
        set_arg(node, 2, "sizes", tuple(new))
    return True


def _view_like(p: SequencePropagator, node: fx.Node, set_local_sizes=None):
    """A view of the tokens' layout (``map_view``); an op that spells out its output sizes has
    them rewritten for the local length by ``set_local_sizes(node, out, out_shape)``."""
    x = node.args[0]
    sh = p.L(x)
    if not isinstance(sh, Sharded):
        return False
    in_shape, out_shape = shape(x), shape(node)
    out = map_view(in_shape, out_shape, sh)
    if out is None:
        return False
    if set_local_sizes is not None and not set_local_sizes(node, out, out_shape):
        return False
    p.layout[node] = out
    return None


def rule_view(p: SequencePropagator, node):
    return _view_like(p, node, _set_local_view_sizes)


def rule_flatten(p: SequencePropagator, node):
    return _view_like(p, node)


def rule_view_as(p: SequencePropagator, node):
    other = node.args[1]
    so = p.L(other)
    res = _view_like(p, node)
    if res is False or so != p.layout.get(node):
        return False
    return None


def rule_view_as_complex(p: SequencePropagator, node):
    # pairs of the last dim become one complex number (Llama-4's RoPE): every other dim
    # keeps its place, so tokens stay independent unless the sequence is that last dim
    sh = p.L(node.args[0])
    if not isinstance(sh, Sharded) or sh.dim >= len(shape(node)):
        return False
    p.layout[node] = sh
    return None


def rule_view_as_real(p: SequencePropagator, node):
    sh = p.L(node.args[0])
    if not isinstance(sh, Sharded):
        return False
    p.layout[node] = sh  # a trailing pair dim is added after every other dim
    return None


def rule_unflatten(p: SequencePropagator, node):
    return _view_like(p, node, _set_local_unflatten_sizes)


def rule_expand(p: SequencePropagator, node):
    x = node.args[0]
    sh = p.L(x)
    if not isinstance(sh, Sharded):
        return False
    out_shape = shape(node)
    out = map_broadcast(len(shape(x)), len(out_shape), sh)
    if not _set_local_sizes(node, out, out_shape):
        return False
    p.layout[node] = out
    return None


def rule_expand_as(p: SequencePropagator, node):
    x, other = node.args[0], node.args[1]
    sh, so = p.L(x), p.L(other)
    out = map_broadcast(len(shape(x)), len(shape(node)), sh) if isinstance(sh, Sharded) else None
    if out != so:
        return False
    p.layout[node] = out
    return None


def rule_transpose(p: SequencePropagator, node):
    x = node.args[0]
    sh = p.L(x)
    d0, d1 = arg(node, 1, "dim0"), arg(node, 2, "dim1")
    p.layout[node] = map_transpose(len(shape(x)), d0, d1, sh)
    return None


def rule_t(p: SequencePropagator, node):
    x = node.args[0]
    sh = p.L(x)
    n = len(shape(x))
    p.layout[node] = map_transpose(n, 0, 1, sh) if n == 2 else sh
    return None


def _ints_after_tensor(node: fx.Node) -> list:
    """The ints after the tensor (permute's dims, repeat's counts) in either spelling: one
    sequence, ``x.permute((0, 2, 1))``, or one argument each, ``x.permute(0, 2, 1)``."""
    if len(node.args) == 2 and isinstance(node.args[1], (tuple, list)):
        return list(node.args[1])
    return list(node.args[1:])


def rule_permute(p: SequencePropagator, node):
    x = node.args[0]
    dims = _ints_after_tensor(node)
    if not dims:
        dims = node.kwargs.get("dims")
    p.layout[node] = map_permute(list(dims), p.L(x))
    return None


def rule_movedim(p: SequencePropagator, node):
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
    p.layout[node] = map_permute([d if d is not None else next(rest) for d in perm], p.L(x))
    return None


def rule_getitem(p: SequencePropagator, node):
    src = node.args[0]
    sl = p.L(src)
    if isinstance(sl, tuple):
        p.layout[node] = sl[node.args[1]]
        return None
    idx = node.args[1]
    items = idx if isinstance(idx, tuple) else (idx,)
    if any(isinstance(i, fx.Node) for i in items):
        return False
    out = map_getitem(shape(src), idx, sl)
    if out is None or out == "unknown":
        return False
    p.layout[node] = out
    return None


def tokens_kept(p: SequencePropagator, node: fx.Node, dims) -> Sharded | None:
    """The layout of ``node``'s first argument when the op acts only along ``dims`` (an int, a
    list, or None for "unknown": declined) and none of them is the tokens' dimension."""
    x = node.args[0]
    sh = p.L(x)
    if not isinstance(sh, Sharded) or dims is None:
        return None
    n = len(shape(x))
    if sh.dim in {d % n for d in ([dims] if isinstance(dims, int) else dims)}:
        return None
    return sh


def acting_along(dims_of: Callable[[fx.Node], object]):
    """The rule of an op that keeps its input's shape and acts only along the dims
    ``dims_of(node)`` names (as ``tokens_kept`` takes them): the tokens stay split unless the op
    acts along them."""

    def rule(p: SequencePropagator, node: fx.Node):
        sh = tokens_kept(p, node, dims_of(node))
        if sh is None:
            return False
        p.layout[node] = sh
        return None

    return rule


def acts_along(index: int, name: str):
    """``acting_along`` the dims given by argument ``index`` / ``name`` (narrow, flip, roll,
    softmax, cumsum)."""
    return acting_along(lambda node: arg(node, index, name))


rule_narrow = acts_along(1, "dim")
rule_flip = acts_along(1, "dims")
rule_roll = acts_along(2, "dims")


def _removed_dim(sh: Sharded, dim: int, ndim: int) -> Sharded:
    """``sh`` after dimension ``dim`` (not its own) is removed (select, unbind)."""
    return sh.with_dim(sh.dim - (1 if dim % ndim < sh.dim else 0))


def rule_select(p: SequencePropagator, node):
    dim = arg(node, 1, "dim")
    sh = tokens_kept(p, node, dim)
    if sh is None:
        return False
    p.layout[node] = _removed_dim(sh, dim, len(shape(node.args[0])))
    return None


def rule_split(p: SequencePropagator, node):
    sh = tokens_kept(p, node, arg(node, 2, "dim", 0))
    if sh is None:
        return False
    n_out = len(node.meta.get("val", node.meta.get("example_value")))
    p.layout[node] = tuple([sh] * n_out)
    return None


def rule_unbind(p: SequencePropagator, node):
    dim = arg(node, 1, "dim", 0)
    sh = tokens_kept(p, node, dim)
    if sh is None:
        return False
    x_shape = shape(node.args[0])
    p.layout[node] = tuple([_removed_dim(sh, dim, len(x_shape))] * x_shape[dim])
    return None


def rule_cat(p: SequencePropagator, node):
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
        p.layout[node] = p.L(live[0]) if len(shape(live[0])) == len(out_shape) else None
        if p.layout[node] is None and isinstance(p.L(live[0]), Sharded):
            return False
        return None
    target = None
    for t in live:
        st = p.L(t)
        if isinstance(st, Sharded):
            if st.dim == dim:
                return False
            target = target or st
    new = []
    for t in tensors:
        st = p.L(t)
        if t not in live or st == target:
            new.append(t)
        elif isinstance(st, Sharded):
            new.append(p.gather(t, node, "cat of differently split tensors"))
        else:
            new.append(p.slice(t, target.dim, target))
    if len(node.args) >= 1:
        node.args = (new, *node.args[1:])
    else:
        node.kwargs = {**node.kwargs, "tensors": new}
    p.layout[node] = target
    return None


def rule_stack(p: SequencePropagator, node):
    tensors = list(arg(node, 0, "tensors"))
    out_ndim = len(shape(node))
    dim = arg(node, 1, "dim", 0) % out_ndim
    target = None
    for t in tensors:
        st = p.L(t)
        if isinstance(st, Sharded):
            target = target or st
    new = []
    for t in tensors:
        st = p.L(t)
        if st == target:
            new.append(t)
        elif isinstance(st, Sharded):
            new.append(p.gather(t, node, "stack of differently split tensors"))
        else:
            new.append(p.slice(t, target.dim, target))
    node.args = (new, *node.args[1:])
    p.layout[node] = target.with_dim(target.dim + (1 if target.dim >= dim else 0))
    return None


def _padded_dims(node: fx.Node) -> list[int]:
    """The dims ``pad`` pads: its amounts come in (before, after) pairs from the last dim on."""
    n = len(shape(node.args[0]))
    return [n - 1 - i // 2 for i, amount in enumerate(arg(node, 1, "pad")) if amount != 0]


rule_pad = acting_along(_padded_dims)


def rule_repeat(p: SequencePropagator, node):
    x = node.args[0]
    sh = p.L(x)
    reps = _ints_after_tensor(node)
    n = len(shape(x))
    if reps[sh.dim + len(reps) - n] != 1:
        return False
    p.layout[node] = sh.with_dim(sh.dim + len(reps) - n)
    return None


def rule_repeat_interleave(p: SequencePropagator, node):
    sh = tokens_kept(p, node, arg(node, 2, "dim"))
    if sh is None or not isinstance(arg(node, 1, "repeats"), int):
        return False
    p.layout[node] = sh
    return None


rule_tril = acting_along(lambda node: (-2, -1))  # a triangle of the last two dims


def rule_index_select(p: SequencePropagator, node):
    sh = tokens_kept(p, node, arg(node, 1, "dim"))
    if sh is None or isinstance(p.L(arg(node, 2, "index")), Sharded):
        return False
    p.layout[node] = sh
    return None


RULES = {
    "view reshape": rule_view,
    "flatten squeeze unsqueeze": rule_flatten,
    "view_as reshape_as": rule_view_as,
    "view_as_complex": rule_view_as_complex,
    "view_as_real": rule_view_as_real,
    "unflatten": rule_unflatten,
    "expand broadcast_to": rule_expand,
    "expand_as": rule_expand_as,
    "transpose swapaxes swapdims": rule_transpose,
    "t": rule_t,
    "permute": rule_permute,
    "movedim moveaxis": rule_movedim,
    "getitem": rule_getitem,
    "narrow": rule_narrow,
    "select": rule_select,
    "split chunk split_with_sizes tensor_split": rule_split,
    "unbind": rule_unbind,
    "cat concat concatenate": rule_cat,
    "stack": rule_stack,
    "pad": rule_pad,
    "repeat": rule_repeat,
    "repeat_interleave": rule_repeat_interleave,
    "tril triu": rule_tril,
    "flip": rule_flip,
    "roll": rule_roll,
    "index_select": rule_index_select,
}
