"""Each rank's shards of the matched weights, keyed by the full parameter they come from.

The schedules compute only with shards; the full parameter is needed once, when its shards are
cut. Shards are ``nn.Parameter`` objects that live here, keyed by the *identity* of the full
parameter, so that a recompile (a new sequence length, say) finds and reuses them instead of
cutting them again — by then the full tensor's storage may have been released. The store is also
what ``tspc.parameters`` / ``tspc.state_dict`` read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary


@dataclass(frozen=True)
class ShardSpec:
    """Rows ``[start, stop)`` (dim 0) or columns (dim 1) of a 2-D weight, or a slice of a bias."""

    dim: int
    start: int
    stop: int


@dataclass
class ShardedParam:
    """What this rank knows of one full parameter that the schedules shard."""

    shards: dict[ShardSpec, nn.Parameter]
    full_shape: torch.Size
    dtype: torch.dtype
    group: str  # the TSP group's name, for collectives that rebuild the full tensor
    world: int
    rank: int
    released: bool = False


class ShardStore:
    def __init__(self) -> None:
        # keyed by identity: tensors compare elementwise, so a plain weak dict would not do
        self._entries: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def declare(self, full: torch.Tensor, group: str, rank: int, world: int) -> ShardedParam:
        """Record that ``full`` is sharded over the group (this rank may hold none of it)."""
        entry = self._entries.get(full)
        if entry is None:
            entry = ShardedParam({}, full.shape, full.dtype, group, world, rank)
            self._entries[full] = entry
        elif (entry.world, entry.rank) != (world, rank):
            raise RuntimeError(
                f"tspc: a parameter of shape {tuple(full.shape)} was already sharded for rank "
                f"{entry.rank} of {entry.world}; it cannot be re-sharded for rank {rank} of "
                f"{world} in the same process"
            )
        return entry

    def shard(
        self, full: torch.Tensor, spec: ShardSpec, group: str, rank: int, world: int
    ) -> nn.Parameter:
        """This rank's shard ``spec`` of ``full``: cut once, then always the same object."""
        entry = self.declare(full, group, rank, world)
        shard = entry.shards.get(spec)
        if shard is None:
            if entry.released or full.untyped_storage().size() == 0:
                raise RuntimeError(
                    "tspc: a new shard was requested from a parameter whose full storage was "
                    "already released (a recompile asked for a different cut of it); this is a "
                    "bug in the passes"
                )
            data = full.detach().narrow(spec.dim, spec.start, spec.stop - spec.start).clone()
            shard = nn.Parameter(data, requires_grad=full.requires_grad)
            entry.shards[spec] = shard
        return shard

    def get(self, full: torch.Tensor) -> ShardedParam | None:
        return self._entries.get(full)

    def shards_of(self, full: torch.Tensor) -> dict[ShardSpec, nn.Parameter]:
        entry = self._entries.get(full)
        return dict(entry.shards) if entry else {}

    def __contains__(self, full: torch.Tensor) -> bool:
        return full in self._entries


STORE = ShardStore()
"""The process-wide shard store."""
