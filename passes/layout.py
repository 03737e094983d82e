"""Where a tensor is split across ranks, and how that moves through shape operations.

A value in a rewritten graph is either replicated (every rank holds all of it) or ``Sharded``:
one of its dimensions holds only this rank's part of a factor of size ``n``. The dimension may be
that factor alone or the factor merged with others, as after ``x.view(B * S, h)``: its global size
is ``outer * n * inner`` (row-major) and the split applies to ``n``. The same description serves
the sequence (split into the zigzag chunks of each rank) and attention heads (split into head
groups): only ``n_local`` and the way a replicated tensor is cut differ, and those are the
caller's business.

Everything here is pure shape arithmetic on *global* shapes, so it is testable without a graph.
A function returns ``None`` when an operation does not keep the split factor intact in a single
dimension — the caller must then gather (sequence) or give up (heads).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Sharded:
    dim: int
    n: int  # global size of the split factor
    n_local: int  # this rank's part of it
    outer: int = 1
    inner: int = 1

    def with_dim(self, dim: int, outer: int | None = None, inner: int | None = None) -> Sharded:
        return replace(
            self,
            dim=dim,
            outer=self.outer if outer is None else outer,
            inner=self.inner if inner is None else inner,
        )

    def local_size(self, global_size: int) -> int:
        return global_size // self.n * self.n_local

    @property
    def is_plain(self) -> bool:
        return self.outer == 1 and self.inner == 1


def _suffix_products(shape: Sequence[int]) -> list[int]:
    out = [1] * (len(shape) + 1)
    for i in range(len(shape) - 1, -1, -1):
        out[i] = out[i + 1] * shape[i]
    return out


def map_view(in_shape: Sequence[int], out_shape: Sequence[int], sh: Sharded) -> Sharded | None:
    """The split factor's place after a reshape from ``in_shape`` to ``out_shape``.

    A reshape keeps the row-major flat index. The factor occupies the flat-index "digits" with
    stride ``T = inner * prod(in_shape[dim+1:])`` and extent ``n``; it survives intact iff some
    output dimension's digit range contains ``[T, T*n)``.
    """
    if math.prod(in_shape) != math.prod(out_shape):
        return None
    post_in = _suffix_products(in_shape)
    t = sh.inner * post_in[sh.dim + 1]
    post_out = _suffix_products(out_shape)
    for j, size in enumerate(out_shape):
        p = post_out[j + 1]
        if size > 1 and t % p == 0 and (p * size) % (t * sh.n) == 0:
            inner = t // p
            return sh.with_dim(j, outer=size // (sh.n * inner), inner=inner)
    return None


def map_permute(perm: Sequence[int], sh: Sharded) -> Sharded:
    perm = [p % len(perm) for p in perm]
    return sh.with_dim(perm.index(sh.dim))


def map_transpose(ndim: int, d0: int, d1: int, sh: Sharded) -> Sharded:
    d0, d1 = d0 % ndim, d1 % ndim
    if sh.dim == d0:
        return sh.with_dim(d1)
    if sh.dim == d1:
        return sh.with_dim(d0)
    return sh


def map_broadcast(in_ndim: int, out_ndim: int, sh: Sharded) -> Sharded:
    """Elementwise ops align shapes from the right."""
    return sh.with_dim(sh.dim + out_ndim - in_ndim)


def reduced_dims(ndim: int, dims) -> set[int]:
    if dims is None:
        return set(range(ndim))
    if isinstance(dims, int):
        dims = [dims]
    return {d % ndim for d in dims} if ndim else set()


def map_reduce(ndim: int, dims, keepdim: bool, sh: Sharded) -> Sharded | None:
    """After a reduction over ``dims``; None when the split dimension itself is reduced."""
    rd = reduced_dims(ndim, dims)
    if sh.dim in rd:
        return None
    if keepdim:
        return sh
    return sh.with_dim(sh.dim - sum(1 for d in rd if d < sh.dim))


def is_full_slice(s: slice, size: int) -> bool:
    start = 0 if s.start is None else s.start
    stop = size if s.stop is None else s.stop
    step = 1 if s.step is None else s.step
    if start < 0:
        start += size
    if stop < 0:
        stop += size
    return start <= 0 and stop >= size and step == 1


def map_getitem(in_shape: Sequence[int], index, sh: Sharded) -> Sharded | None | str:
    """After basic indexing ``x[index]``.

    Returns the new placement, ``None`` if the index cuts the split dimension, or ``"unknown"``
    for advanced (tensor) indexing, which the caller handles like any op it does not know.
    """
    items = index if isinstance(index, tuple) else (index,)
    # One list of ints (Falcon's ``qkv[..., [-2]]``) picks entries of one dim, which stays in
    # its place; with an int or a second list, numpy's rules may move the picked dims to the
    # front, so that stays unknown.
    lists = [i for i in items if isinstance(i, list)]
    if lists and (
        len(lists) > 1
        or not all(isinstance(j, int) and not isinstance(j, bool) for j in lists[0])
        or any(isinstance(i, int) for i in items)
    ):
        return "unknown"
    if any(not isinstance(i, (int, slice, list, type(None), type(Ellipsis))) for i in items):
        return "unknown"
    n_consuming = sum(1 for i in items if isinstance(i, (int, slice, list)))
    expanded: list = []
    for i in items:
        if i is Ellipsis:
            expanded += [slice(None)] * (len(in_shape) - n_consuming)
        else:
            expanded.append(i)
    expanded += [slice(None)] * (
        len(in_shape) - sum(1 for i in expanded if isinstance(i, (int, slice, list)))
    )
    in_dim = out_dim = 0
    result = None
    for i in expanded:
        if i is None:
            out_dim += 1
            continue
        if in_dim == sh.dim:
            if not isinstance(i, slice) or not is_full_slice(i, in_shape[in_dim]):
                return None
            result = sh.with_dim(out_dim)
        if isinstance(i, (slice, list)):
            out_dim += 1
        in_dim += 1
    return result


def rewrite_sizes(sizes: Sequence, out_dim: int, global_size: int, local_size: int) -> list | None:
    """Replace the global size at ``out_dim`` of a shape argument by the local one.

    ``-1`` entries stay as they are (they infer the right size either way). Returns None if the
    entry is neither the global size nor -1, which means the shape argument does not describe
    the dimension we think it does.
    """
    sizes = list(sizes)
    if out_dim >= len(sizes):
        return None
    v = sizes[out_dim]
    if v == -1:
        return sizes
    if v != global_size:
        return None
    sizes[out_dim] = local_size
    return sizes
