"""Pack several weight shards into one flat buffer (one transfer) and view them back out."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def unpack(flat: torch.Tensor, shapes: Sequence[Sequence[int]]) -> tuple[torch.Tensor, ...]:
    # One split, not a slice per tensor: the split's gradient is a single concatenation,
    # where slices each scatter into a zero buffer of the packed size that are then summed
    # (a backward node per tensor and D packed-size buffers per step).
    sizes = [math.prod(s) for s in shapes]
    return tuple(p.view(tuple(s)) for p, s in zip(torch.split(flat, sizes), shapes))
