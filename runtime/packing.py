"""Pack several weight shards into one flat buffer (one transfer) and view them back out."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def pack(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def unpack(flat: torch.Tensor, shapes: Sequence[Sequence[int]]) -> tuple[torch.Tensor, ...]:
    out, off = [], 0
    for s in shapes:
        n = math.prod(s)
        out.append(flat[off : off + n].view(tuple(s)))
        off += n
    return tuple(out)
