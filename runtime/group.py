"""Which ranks form the TSP axis: the default world group, a given group, or a mesh dimension."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from .dp_mesh import register


@dataclass(frozen=True)
class TSPGroup:
    """The TSP axis as the passes see it: a name for the custom ops, this rank and the size D.

    The passes bake ``size`` into shapes and ``rank`` into which shard a rank slices; they never
    hold the ProcessGroup object itself, so a rewritten graph is plain data. ``name`` is the
    c10d group name that the runtime resolves back to the group when an op runs.
    """

    name: str
    rank: int
    size: int
    # Data parallelism on top: the other axis of a 2-D mesh, over which gradients are averaged.
    dp_name: str = ""
    dp_size: int = 1
    # "replicate" (gradients all-reduced over dp, runtime/data_parallel.py), "fsdp" or "hsdp"
    # (parameters, gradients and optimizer state split over dp too, runtime/dp_shard.py)
    dp_mode: str = "replicate"


class GroupResolutionError(ValueError):
    pass


def resolve_group(
    group: Any = None, mesh_dim: str | int | None = None, data_parallel: str = "replicate"
) -> TSPGroup:
    """Resolve the ``group`` option into a TSPGroup.

    ``group`` may be None (the default world group, or a single-process run when no process
    group is initialised), a ``ProcessGroup``, or a ``DeviceMesh`` together with ``mesh_dim``
    (a dimension name or index; a 1-D mesh needs none). ``data_parallel="fsdp"`` needs a 2-D
    mesh (its other dimension is the data-parallel axis), ``"hsdp"`` a 3-D one
    (replicate, shard, tsp) (``runtime/dp_mesh.py``).
    """
    need = {"fsdp": 2, "hsdp": 3}.get(data_parallel)
    if need is not None and getattr(group, "ndim", 0) != need:
        raise GroupResolutionError(
            f"data_parallel={data_parallel!r} needs a {need}-D DeviceMesh "
            f"{'(dp, tsp)' if need == 2 else '(replicate, shard, tsp)'} as 'group', e.g. "
            "options={'group': init_device_mesh(device, (dp, D), mesh_dim_names=('dp', "
            "'tsp')), 'mesh_dim': 'tsp', 'data_parallel': 'fsdp'}"
        )
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            _refuse_launcher_without_group()
            return TSPGroup(name="", rank=0, size=1)
        group = dist.group.WORLD
    try:
        from torch.distributed.device_mesh import DeviceMesh
    except ImportError:  # pragma: no cover - torch without distributed
        DeviceMesh = ()  # type: ignore[assignment]
    if isinstance(group, DeviceMesh):
        if mesh_dim is None:
            if group.ndim != 1:
                raise GroupResolutionError(
                    f"a {group.ndim}-D DeviceMesh was given as the TSP group without "
                    f"'mesh_dim'; pass options={{'group': mesh, 'mesh_dim': <name or index>}} "
                    f"(mesh dims: {group.mesh_dim_names})"
                )
            mesh_dim = 0
        mesh = group
        try:
            group = mesh.get_group(mesh_dim)
        except Exception as e:  # noqa: BLE001 - re-raised with the option named
            raise GroupResolutionError(
                f"mesh_dim={mesh_dim!r} is not a dimension of the DeviceMesh "
                f"(dims: {mesh.mesh_dim_names}): {e}"
            ) from e
        if mesh.ndim > 3 or mesh.ndim == 3 and data_parallel != "hsdp":
            raise GroupResolutionError(
                f"a {mesh.ndim}-D DeviceMesh: tspc composes with one data-parallel axis (a 2-D "
                "(dp, tsp) mesh), or with HSDP's two (a 3-D (replicate, shard, tsp) mesh with "
                "data_parallel='hsdp'); or pass the TSP axis's own ProcessGroup"
            )
        if mesh.ndim >= 2:
            names = mesh.mesh_dim_names or tuple(str(d) for d in range(mesh.ndim))
            tsp_index = names.index(mesh_dim) if isinstance(mesh_dim, str) else int(mesh_dim)
            base = _plain(group)
            dp_name, dp_size = register(base.name, mesh, tsp_index, data_parallel)
            return TSPGroup(base.name, base.rank, base.size, dp_name, dp_size, data_parallel)
    elif mesh_dim is not None:
        raise GroupResolutionError("'mesh_dim' is only meaningful when 'group' is a DeviceMesh")
    return _plain(group)


def _refuse_launcher_without_group() -> None:
    """A launcher (torchrun, mpirun, SLURM via torchrun) started several processes but none
    joined a process group: each would silently run the whole model as D = 1."""
    world = os.environ.get("WORLD_SIZE")
    if world is not None and world.isdigit() and int(world) > 1:
        from .errors import TSPConfigError

        raise TSPConfigError(
            f"tspc: WORLD_SIZE={world} is set but torch.distributed is not initialised, so "
            "every process would run alone (D = 1). Call torch.distributed.init_process_group() "
            "before the compiled model's first call (or unset WORLD_SIZE for one process)."
        )


def _plain(group) -> TSPGroup:
    if not isinstance(group, dist.ProcessGroup):
        raise GroupResolutionError(
            f"option 'group' must be None, a ProcessGroup or a DeviceMesh, got "
            f"{type(group).__name__}"
        )
    if not dist.is_initialized():
        raise GroupResolutionError(
            "a process group was given but torch.distributed is not initialised"
        )
    rank = dist.get_rank(group)
    if rank < 0:
        raise GroupResolutionError(
            f"this process (global rank {dist.get_rank()}) is not a member of the TSP group"
        )
    size = dist.get_world_size(group)
    if size > dist.get_world_size():
        raise GroupResolutionError(
            f"the TSP group has {size} ranks but the world has only {dist.get_world_size()}"
        )
    return TSPGroup(name=group.group_name, rank=rank, size=size)


def process_group(name: str) -> dist.ProcessGroup:
    """The ProcessGroup behind a TSPGroup name (called by the runtime ops, never by passes)."""
    from .compat import resolve_process_group

    return resolve_process_group(name)
