"""Fully sharded data parallelism on a 2-D (dp, tsp) mesh: ``options={"data_parallel": "fsdp"}``.

With ``data_parallel="fsdp"`` every parameter tspc adopts is a DTensor on the user's 2-D mesh
instead of the TSP axis alone, so parameters, gradients and optimizer state are split over the
data-parallel axis as well as over the TSP axis (as FSDP2 holds the parameters of FSDP + TP):

* a weight tspc shards over the TSP axis (placement ``P`` there) is also cut into dp equal
  parts along another dim: ``(Shard(d), P)``, d the first dim other than ``P``'s that dp
  divides (``Shard(1)`` for a row-sharded ``[out, in]`` weight). Another dim, so that no
  ``_StridedShard`` over dp is needed and DCP sees plain boxes;
* a parameter the TSP axis holds whole (norms, embeddings, the LM head) is cut over all
  dp x D ranks of the mesh: ``(Shard(d), Shard(d))``, d the first dim dp x D divides; failing
  that over dp alone ``(Shard(d), Replicate())``; failing that it stays whole on every rank
  ``(Replicate(), Replicate())`` and its gradient is averaged over dp.

The compiled graphs read the TSP-local tensor (what the 1-D mode keeps): at each call
``tsp_local`` all-gathers it from the dp parts, through an autograd function whose backward
reduce-scatters the gradient and divides by dp (the mean over the global batch, as DDP and
FSDP do; each dp rank's loss is the mean over its own batch). For a parameter cut over the whole
mesh the graph's gradient is already summed over the TSP axis, so every TSP rank holds the same
sum and the reduce-scatter over dp x D ranks is divided by dp x D.

Every dp rank runs the same graphs with the same parameters in the same order, so the gathers
(forward) and reduce-scatters (backward, in the autograd engine's deterministic order) pair up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard

from .dp_mesh import dp_sharding_of, dp_sharding_of_mesh
from .group import process_group


@dataclass(frozen=True)
class _Spread:
    """How one parameter's TSP-local tensor is cut over the mesh: along ``dim`` over the
    group ``group`` of ``size`` ranks (dp, or the whole mesh), or not at all (``dim`` None:
    only the gradient is averaged over dp)."""

    dim: int | None
    group: str
    size: int
    grad_divisor: int
    rep_group: str = ""  # hsdp: the replicate dim, over which gradients are also averaged
    rep_size: int = 1


def _spread_of(dparam: torch.Tensor) -> _Spread | None:
    """How a parameter is cut over the data-parallel dims, read from its placements (an
    attribute would not survive ``model.to()``: ``swap_tensors`` swaps ``__dict__``). Over dp
    along the TSP placement's own dim only when cut over the whole mesh (``make_dparam``)."""
    if not isinstance(dparam, DTensor) or dparam.device_mesh.ndim < 2:
        return None
    sh = dp_sharding_of_mesh(dparam.device_mesh)
    if sh is None:
        return None
    dp_pl, tsp_pl = dparam.placements[sh.dp_dim], dparam.placements[sh.tsp_dim]
    rep = {"rep_group": sh.rep_group, "rep_size": sh.rep_size}
    if not isinstance(dp_pl, Shard):
        return _Spread(None, sh.dp_group, sh.dp_size, sh.dp_size, **rep)
    if type(tsp_pl) is Shard and tsp_pl.dim == dp_pl.dim:
        return _Spread(dp_pl.dim, sh.flat_group, sh.flat_size, sh.flat_size, **rep)
    return _Spread(dp_pl.dim, sh.dp_group, sh.dp_size, sh.dp_size, **rep)


def is_dp_sharded(dparam: torch.Tensor) -> bool:
    return _spread_of(dparam) is not None


def whole_over_dp(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """The parameters whose gradients the bucketed all-reduce averages over dp: all of them
    with ``data_parallel="replicate"``; with "fsdp"/"hsdp" those left off the mesh (read whole
    by a plain fallback graph too), whose gradients nothing else averages."""
    return [p for p in params if not is_dp_sharded(p)]


def make_dparam(
    tsp_local: torch.Tensor,
    tsp_placement,
    group: str,
    like: torch.Tensor,
    read_whole: bool,
) -> nn.Parameter | None:
    """The DTensor parameter on the data-parallel mesh whose TSP-local tensor is ``tsp_local``
    (placement ``tsp_placement`` on the TSP axis; the shape, strides and ``requires_grad`` of
    the original ``like``), or None when the TSP group ``group`` has no sharded data-parallel
    mesh, or the original is ``read_whole`` by a plain (fallback) graph: it then stays on the
    TSP axis and its gradient is averaged over dp by the bucketed all-reduce."""
    sh = dp_sharding_of(group)
    if sh is None or read_whole:
        return None
    mesh: DeviceMesh = sh.mesh
    whole_on_tsp = isinstance(tsp_placement, Replicate)
    tsp_dim = getattr(tsp_placement, "dim", None)
    spread = None
    if whole_on_tsp and sh.flat_group:
        spread = _pick(tsp_local, None, sh.flat_group, sh.flat_size)
    if spread is None:
        spread = _pick(tsp_local, tsp_dim, sh.dp_group, sh.dp_size)
    if spread is None:
        spread = _Spread(None, sh.dp_group, sh.dp_size, sh.dp_size)
        dp_pl, tsp_pl, mine = Replicate(), tsp_placement, tsp_local
    else:
        rank = dist.get_rank(process_group(spread.group))
        mine = tsp_local.chunk(spread.size, spread.dim)[rank]
        dp_pl = Shard(spread.dim)
        tsp_pl = Shard(spread.dim) if spread.group == sh.flat_group else tsp_placement
    placements = [Replicate()] * mesh.ndim  # hsdp's replicate dim stays Replicate
    placements[sh.dp_dim], placements[sh.tsp_dim] = dp_pl, tsp_pl
    with torch.no_grad():
        dt = DTensor.from_local(
            mine.detach().clone(), mesh, placements, run_check=False, shape=like.shape,
            stride=like.stride(),
        )  # fmt: skip
    return nn.Parameter(dt, requires_grad=like.requires_grad)


def _pick(t: torch.Tensor, avoid: int | None, group: str, size: int) -> _Spread | None:
    for d in range(t.dim()):
        if d != avoid and t.shape[d] >= size and t.shape[d] % size == 0:
            return _Spread(d, group, size, size)
    return None


def tsp_local(dparam: torch.Tensor) -> torch.Tensor:
    """The TSP-local tensor of a parameter (differentiable): ``to_local()`` of a 1-D one; of
    a 2-D one the gather of its parts, whose gradient is reduce-scattered and averaged."""
    local = dparam.to_local()
    spread = _spread_of(dparam)
    if spread is None:
        return local
    if spread.dim is None:
        if not (torch.is_grad_enabled() and local.requires_grad):
            return local
        return _AverageGrad.apply(local, spread)
    return _GatherParts.apply(local, spread)


def dp_part(tsp_local_value: torch.Tensor, dparam: torch.Tensor) -> torch.Tensor:
    """This rank's part of a TSP-local value (a loaded checkpoint's) for a 2-D ``dparam``."""
    spread = _spread_of(dparam)
    if spread is None or spread.dim is None:
        return tsp_local_value
    rank = dist.get_rank(process_group(spread.group))
    return tsp_local_value.chunk(spread.size, spread.dim)[rank]


class _GatherParts(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, spread: _Spread) -> torch.Tensor:
        ctx.spread = spread
        moved = local.movedim(spread.dim, 0).contiguous()
        out = moved.new_empty((moved.shape[0] * spread.size, *moved.shape[1:]))
        dist.all_gather_single(out, moved, group=process_group(spread.group))
        return out.movedim(0, spread.dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        spread = ctx.spread
        moved = grad.movedim(spread.dim, 0).contiguous()
        out = moved.new_empty((moved.shape[0] // spread.size, *moved.shape[1:]))
        dist.reduce_scatter_single(out, moved, group=process_group(spread.group))
        return _over_replicas(out, spread).movedim(0, spread.dim), None


class _AverageGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, spread: _Spread) -> torch.Tensor:
        ctx.spread = spread
        return local.view_as(local)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=process_group(ctx.spread.group))
        return _over_replicas(grad, ctx.spread), None


def _over_replicas(grad: torch.Tensor, spread: _Spread) -> torch.Tensor:
    """The summed gradient of this rank's part, averaged (hsdp: over the replicas as well)."""
    if spread.rep_size > 1:
        dist.all_reduce(grad, group=process_group(spread.rep_group))
    return grad.div_(spread.grad_divisor * spread.rep_size)
