"""The data-parallel side of a (dp, tsp) or (replicate, shard, tsp) mesh, for the runtime.

``data_parallel="fsdp"`` on a 2-D mesh splits parameters over the dp dim; ``"hsdp"`` on a 3-D
mesh splits them over the shard dim and keeps the replicate dim's copies equal (gradients
all-reduced there), FSDP2's HSDP. ``DPSharding`` is what ``runtime/dp_shard.py`` needs of
the mesh, registered under the name of the TSP group when the backend resolves its options.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist


@dataclass(frozen=True)
class DPSharding:
    """The mesh of ``data_parallel="fsdp"`` / ``"hsdp"``: the shard dim (``dp_*``), the
    replicate dim (hsdp; size 1 for fsdp), and the shard and TSP dims together as one group
    (``flat_group``; empty when its ranks are not in mesh order)."""

    mesh: Any
    dp_dim: int
    tsp_dim: int
    dp_group: str
    dp_size: int
    flat_group: str
    flat_size: int
    rep_group: str = ""
    rep_size: int = 1


_DP_SHARDING: dict[str, DPSharding] = {}


# every mesh ever registered (a model compiled with "fsdp" keeps its parameters on it even if
# another is compiled later with "replicate" on the same TSP group)
_BY_MESH: list[DPSharding] = []


def dp_sharding_of(tsp_group: str) -> DPSharding | None:
    """The sharded data-parallel mesh of a TSP group, or None when its dp axis replicates."""
    return _DP_SHARDING.get(tsp_group)


def dp_sharding_of_mesh(mesh) -> DPSharding | None:
    """What ``register`` recorded for this mesh object, if anything."""
    for sh in _BY_MESH:
        if sh.mesh is mesh:
            return sh
    return None


def register(tsp_name: str, mesh, tsp_dim: int, mode: str) -> tuple[str, int]:
    """Record what ``mode`` does on the mesh's other dims for the TSP group ``tsp_name``; the
    name and size of the whole data-parallel group (all dims but the TSP one), over which a
    graph that fell back to a plain compile averages its gradients."""
    others = [d for d in range(mesh.ndim) if d != tsp_dim]
    if mesh.ndim == 2:
        dp = mesh.get_group(others[0])
        whole_dp = (dp.group_name, dist.get_world_size(dp))
    else:
        whole_dp = _slice_group(mesh, others)
    if mode == "replicate":  # parameters adopted from now on stay on the TSP axis alone
        _DP_SHARDING.pop(tsp_name, None)
        return whole_dp
    old = _DP_SHARDING.get(tsp_name)
    if old is not None and old.mesh is mesh:
        return whole_dp
    shard_dim = others[-1]  # hsdp: (replicate, shard); fsdp: the one dp dim
    dp = mesh.get_group(shard_dim)
    flat_name, flat_size = _slice_group(mesh, sorted([shard_dim, tsp_dim]))
    rep_name, rep_size = "", 1
    if mesh.ndim == 3:
        rep = mesh.get_group(others[0])
        rep_name, rep_size = rep.group_name, dist.get_world_size(rep)
    _DP_SHARDING[tsp_name] = sh = DPSharding(
        mesh, shard_dim, tsp_dim, dp.group_name, dist.get_world_size(dp), flat_name,
        flat_size, rep_name, rep_size,
    )  # fmt: skip
    if dp_sharding_of_mesh(mesh) is None:
        _BY_MESH.append(sh)
    return whole_dp


_SLICES: dict[tuple[int, tuple[int, ...]], tuple[Any, tuple[str, int]]] = {}


def _slice_group(mesh, dims: list[int]) -> tuple[str, int]:
    """The group of the ranks that differ from this one only along ``dims`` (in mesh order),
    and its size; the name is empty when those ranks are not in ascending order (a group's
    ranks are; DTensor's chunks follow the mesh's). Every rank creates every slice's group:
    ``new_group`` needs the whole world, and every rank resolves the same mesh at its first
    compile."""
    cached = _SLICES.get((id(mesh), tuple(dims)))
    if cached is not None and cached[0] is mesh:
        return cached[1]
    ranks = mesh.mesh
    keep = [d for d in range(ranks.dim()) if d not in dims]
    size = math.prod(ranks.shape[d] for d in dims)
    me, name = dist.get_rank(), ""
    for members in ranks.permute(keep + dims).reshape(-1, size).tolist():
        group = dist.new_group(members)
        if me in members and members == sorted(members):
            name = group.group_name
    _SLICES[(id(mesh), tuple(dims))] = (mesh, (name, size))
    return name, size
