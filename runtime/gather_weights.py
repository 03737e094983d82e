"""Gather-on-use: a whole weight for a graph compiled after tspc released it.

A graph compiled after an earlier one sharded a weight and released its full storage may still
read that weight whole: a later graph that the passes cannot fully match (a new length whose
mask the model builds differently, eval code that differs from training code, a graph break
inside a module), one that runs at level 'sp' or 'replicated', or a plain compile standing in
for a failed one (``tspc/fallback.py``). Such a graph runs on the shards anyway: before each of
its calls, every whole weight it reads is gathered from its owners (the slices each rank holds,
``runtime/shard_store.py``) and handed to the graph in place of the storage-less stand-in. The
gathered tensor lives for that call only (and, when training, until its backward has used it);
nothing keeps it, so the memory is the earlier graphs' again once the call is done.

Gradients: every rank's graph receives the same whole weight, and the graph's own adjoint makes
its gradient the same on every rank (a graph that shards the sequence sums the gradient of a
replicated input over the group, ``passes/seq_propagate.py``; a graph on the full batch computes
the full one everywhere). So the adjoint of the gather is "take this rank's slices", the
adjoint of DTensor's ``Shard -> Replicate`` redistribution; it lands on the DTensor parameter's
local tensor, where the optimizer finds it.

The bytes each gather receives are counted in ``runtime/counters.py`` under the tag
``gather:<weight>`` (kind ``all_gather``), so they show next to the schedules' own traffic.
"""

from __future__ import annotations

import torch

from .counters import COUNTER
from .shard_store import ShardedParam
from .tsp_params import TSPParam

TAG_PREFIX = "gather:"


def gather_bytes(entry: ShardedParam, element_size: int) -> tuple[int, int]:
    """(received, sent) bytes of one gather of ``entry``'s weight on this rank: it receives
    every slice it does not own, and sends its own to each of the other ranks."""
    numel = 1
    for n in entry.full_shape:
        numel *= n
    own = _own_numel(entry)
    return (numel - own) * element_size, own * (entry.world - 1) * element_size


def _own_numel(entry: ShardedParam) -> int:
    numel = 0
    for spec in entry.own:
        rest = 1
        for d, n in enumerate(entry.full_shape):
            rest *= spec.length if d == spec.dim else n
        numel += rest
    return numel


class _GatherWhole(torch.autograd.Function):
    @staticmethod
    def forward(ctx, local: torch.Tensor, tp: TSPParam, tag: str) -> torch.Tensor:
        ctx.entry = tp.entry
        with torch.no_grad():
            full = tp.dparam.detach().full_tensor()
        recv, sent = gather_bytes(tp.entry, full.element_size())
        COUNTER.record("all_gather", tag, recv=recv, sent=sent)
        return full

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        entry: ShardedParam = ctx.entry
        # this rank's slices, concatenated in layout order: the local tensor's own layout
        parts = [grad.narrow(s.dim, s.start, s.length) for s in entry.own]
        if not parts:
            return grad.new_zeros(0), None, None
        return torch.cat(parts, entry.own[0].dim), None, None


def gather_whole(tp: TSPParam, name: str) -> torch.Tensor:
    """The whole value of the sharded DTensor parameter of ``tp``, gathered from every rank of
    its group (a collective: every rank calls it for the same weights in the same order);
    differentiable, its gradient lands on this rank's slices of the DTensor parameter."""
    if tp.entry is None or not tp.sharded:
        raise ValueError(f"tspc: {name} is not a sharded weight; nothing to gather")
    local = tp.dparam.to_local()  # differentiable: the gradient lands on the DTensor
    full = _GatherWhole.apply(local, tp, TAG_PREFIX + name)
    return full if tp.dparam.requires_grad else full.detach()
