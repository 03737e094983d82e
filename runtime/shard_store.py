"""What each rank holds of the weights the schedules shard, keyed by the full parameter.

The passes declare, for every matched weight, which slices each rank of the TSP group owns (its
*layout*); the first compiled call cuts this rank's slices out of the full tensor into one local
tensor, which becomes the local part of the module's DTensor parameter
(``runtime/tsp_params.py``). Entries are keyed by the *identity* of the full parameter (and of
the stand-in that takes its place during later calls), so that a recompile (a new sequence
length, say) finds the local data instead of cutting it again — by then the full tensor's storage
has been released.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from .dp_shard import is_dp_sharded


@dataclass(frozen=True)
class ShardSpec:
    """Rows ``[start, stop)`` (dim 0) or columns (dim 1) of a 2-D weight, or a slice of a bias."""

    dim: int
    start: int
    stop: int

    @property
    def length(self) -> int:
        return self.stop - self.start


Layout = tuple[tuple[ShardSpec, ...], ...]
"""Every rank's slices of one parameter, rank by rank, each rank's sorted by start."""


def normalize_layout(per_rank: list[list[ShardSpec]] | Layout) -> Layout:
    return tuple(tuple(sorted(set(specs), key=lambda s: (s.dim, s.start))) for specs in per_rank)


@dataclass
class ShardedParam:
    """What this rank knows of one full parameter that the schedules shard."""

    full_shape: torch.Size
    dtype: torch.dtype
    group: str  # the TSP group's name
    world: int
    rank: int
    layout: Layout
    # How the module holds it (runtime/tsp_params.py): "shard", "strided" or "replicate".
    placement: tuple = ()
    # The module's DTensor parameter; its local tensor is this rank's slices concatenated
    # along their dim in layout order. None until the first compiled call cuts them.
    dparam: nn.Parameter | None = None
    released: bool = False
    offsets: dict[ShardSpec, int] = field(default_factory=dict)

    @property
    def own(self) -> tuple[ShardSpec, ...]:
        return self.layout[self.rank]


class ShardStore:
    def __init__(self) -> None:
        # keyed by identity: tensors compare elementwise, so a plain weak dict would not do
        self._entries: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # parameters a plain compile reads whole (``tspc/fallback.py``): never released
        self._held_whole: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def declare(
        self, full: torch.Tensor, layout: Layout, group: str, rank: int, world: int
    ) -> ShardedParam:
        """Record that ``full`` is sharded over the group with ``layout`` (every rank's slices)."""
        layout = normalize_layout(layout)
        if len(layout) != world:
            raise ValueError(f"a layout for {len(layout)} ranks on a group of {world}")
        entry = self._entries.get(full)
        if entry is None:
            entry = ShardedParam(full.shape, full.dtype, group, world, rank, layout)
            self._entries[full] = entry
            return entry
        if (entry.world, entry.rank) != (world, rank):
            raise RuntimeError(
                f"tspc: a parameter of shape {tuple(full.shape)} was already sharded for rank "
                f"{entry.rank} of {entry.world}; it cannot be re-sharded for rank {rank} of "
                f"{world} in the same process"
            )
        if entry.layout != layout:
            raise RuntimeError(
                f"tspc: a parameter of shape {tuple(full.shape)} was sharded two different ways "
                f"by two compiled graphs ({entry.layout[rank]} and {layout[rank]} on this rank); "
                "this is a bug in the passes"
            )
        return entry

    def alias(self, other: torch.Tensor, full: torch.Tensor) -> None:
        """``other`` (the stand-in that takes ``full``'s place in later calls) has its entry."""
        self._entries[other] = self._entries[full]

    def example_shard(self, full: torch.Tensor, spec: ShardSpec) -> torch.Tensor:
        """This rank's ``spec`` slice of ``full`` as a leaf tensor with ``full``'s
        ``requires_grad``: the example value of a shard input while compiling (dropped once
        compiled: a copied slice must not outlive the compile)."""
        entry = self._entries[full]
        if spec not in entry.own:
            raise KeyError(f"tspc: {spec} is not one of this rank's slices {entry.own}")
        if entry.dparam is not None and is_dp_sharded(entry.dparam):
            # split over dp as well: gathering it here would be a collective inside one
            # rank's compile; the value of an example input does not matter, its shape does
            shape = list(full.shape)
            shape[spec.dim] = spec.length
            src = full.new_zeros(shape)
        elif entry.dparam is not None:  # cut already: the DTensor's local tensor has it
            with torch.no_grad():
                local = entry.dparam.to_local()
            src = local.narrow(spec.dim, entry.offsets[spec], spec.length)
        elif full.untyped_storage().size() == 0:
            raise RuntimeError(
                "tspc: a shard was requested from a parameter whose full storage was already "
                "released before its slices were cut; this is a bug in the passes"
            )
        else:
            src = full.narrow(spec.dim, spec.start, spec.length)
        # contiguous, as the runtime's views of the local tensor are (a column slice of the full
        # weight is not): the graph is compiled for the strides it will be called with
        return src.detach().contiguous().requires_grad_(full.requires_grad)

    def get(self, full: torch.Tensor) -> ShardedParam | None:
        return self._entries.get(full)

    def scratch_copy(self, tensors) -> ShardStore:
        """A new store holding this store's entries of ``tensors`` (the same entry objects, so
        shards already cut are found there and a declaration is checked against them), in which
        new declarations stay: for running the passes again without changing this store."""
        copy = ShardStore()
        for t in tensors:
            if isinstance(t, torch.Tensor) and t in self._entries:
                copy._entries[t] = self._entries[t]
        return copy

    def keep_declarations(self, scratch: ShardStore) -> None:
        """Take the declarations made in ``scratch`` (a ``scratch_copy`` of this store): a
        compile declares in a scratch copy and keeps them only once its passes ran through, so
        an attempt that failed half-way leaves no layout behind (``tspc/module_isolation.py``)."""
        for full, entry in scratch._entries.items():
            self._entries.setdefault(full, entry)

    def forget(self, tensors) -> None:
        """Drop the declarations of ``tensors`` whose slices were never cut: a compile that
        fell back to a plain graph (which reads them whole) leaves no layout that no compiled
        graph uses."""
        for t in tensors:
            entry = self._entries.get(t) if isinstance(t, torch.Tensor) else None
            if entry is not None and entry.dparam is None and not entry.released:
                del self._entries[t]

    def hold_whole(self, tensors) -> None:
        """``tensors`` are read whole by a graph compiled without tspc's passes (a fallback):
        a TSP graph that shards one keeps it whole (a Replicate() DTensor) instead of releasing
        its storage, which the plain graph would read freed."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._held_whole[t] = True

    def held_whole(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t in self._held_whole

    def __contains__(self, full: torch.Tensor) -> bool:
        return full in self._entries


STORE = ShardStore()
"""The process-wide shard store."""
