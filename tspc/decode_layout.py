"""Which way each sharded projection runs in a decode step, and the index maps that move its
output or input between this rank's slices and the whole feature dimension.

A projection whose weight holds this rank's output features (``nn.Linear`` rows, a Conv1D's
columns) is *column-parallel*; one holding its input features (``nn.Linear`` columns, a
Conv1D's rows) is *row-parallel*, its output a partial sum that is all-reduced.

A column-parallel output normally stays this rank's head group / F-slice (``generate.py``):
what the model code does next must then work on a slice. Where it cannot, the output is
*gathered* to every feature in its true order, so the model's code sees exactly what it sees in
one process:

* a fused weight held as ``_StridedShard`` (Phi-3's ``qkv_proj`` of unequal parts split by the
  config's sizes) and a Conv1D (GPT-2's ``c_attn``, split by ``split_size``): always;
* every column-parallel projection when the model's first decode step failed on slices before it
  touched the cache (OLMo-2's q/k norms over every head's features): ``generate.py`` retries the
  step with all of them gathered.

A row-parallel projection takes whichever it is given: this rank's slice as is, or the whole
feature dimension (a gathered input), which it narrows to its own columns first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tspc.runtime.shard_store import Layout


def _conv1d_class() -> type | None:
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # transformers is optional: no Conv1D without it
        return None
    return Conv1D


def feature_dims(module: nn.Module) -> tuple[int, int] | None:
    """(output-feature dim, input-feature dim) of the module's weight, None for a module that
    is no projection (``nn.Linear``: [out, in]; transformers' Conv1D: [in, out])."""
    if isinstance(module, nn.Linear):
        return 0, 1
    conv1d = _conv1d_class()
    if conv1d is not None and isinstance(module, conv1d):
        return 1, 0
    return None


def is_conv1d(module: nn.Module) -> bool:
    conv1d = _conv1d_class()
    return conv1d is not None and isinstance(module, conv1d)


@dataclass
class GatherOutput:
    """A column-parallel projection's output put back in full: every rank's slices, padded to
    ``width`` (the widest rank's), concatenated and picked by ``index`` into feature order."""

    width: int
    index: torch.Tensor  # [out features] positions in the concatenated padded parts

    def __call__(self, local: torch.Tensor, parts: list[torch.Tensor]) -> torch.Tensor:
        padded = [
            p if p.shape[-1] == self.width else nn.functional.pad(p, (0, self.width - p.shape[-1]))
            for p in parts
        ]
        index = self.index.to(local.device)
        return torch.cat(padded, dim=-1).index_select(-1, index)

    def pad(self, local: torch.Tensor) -> torch.Tensor:
        extra = self.width - local.shape[-1]
        return local if extra == 0 else nn.functional.pad(local, (0, extra))


def gather_output_map(layout: Layout, features: int) -> GatherOutput:
    """The map of ``layout`` (every rank's slices of the output-feature dim, in the order the
    rank's local tensor holds them) over ``features`` output features."""
    width = max(sum(s.length for s in own) for own in layout)
    index = torch.empty(features, dtype=torch.long)
    for r, own in enumerate(layout):
        offset = r * width
        for s in own:
            index[s.start : s.stop] = torch.arange(offset, offset + s.length)
            offset += s.length
    return GatherOutput(width, index)


def own_input_index(layout: Layout, rank: int) -> torch.Tensor:
    """This rank's input features of a row-parallel weight, in its local tensor's order."""
    return torch.cat([torch.arange(s.start, s.stop) for s in layout[rank]])
