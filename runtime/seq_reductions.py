"""Reductions over the sharded sequence: reduce locally, then one small all-reduce.

Gathering the inputs of a reduction over tokens would move the whole activation (the logits, for
a loss); reducing the local tokens first moves one number. Used by ``shard_sequence`` for
``sum``/``mean`` over the sharded dimension and for token-level losses.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .comm import all_reduce


def sharded_sum(
    x: torch.Tensor, dims, keepdim: bool, dtype, group: str, world: int, tag: str
) -> torch.Tensor:
    local = (
        x.sum(dim=dims, keepdim=keepdim, dtype=dtype) if dims is not None else x.sum(dtype=dtype)
    )
    return all_reduce(local, "sum", group, world, tag)


def sharded_mean(
    x: torch.Tensor, dims, keepdim: bool, dtype, count: int, group: str, world: int, tag: str
) -> torch.Tensor:
    """Mean over dims that include the sharded one; ``count`` is the global number of elements
    averaged (known at compile time)."""
    if dtype is not None:
        x = x.to(dtype)
    return sharded_sum(x, dims, keepdim, None, group, world, tag) / count


def sharded_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    ignore_index: int,
    reduction: str,
    label_smoothing: float,
    group: str,
    world: int,
    tag: str,
    nll: bool = False,
) -> torch.Tensor:
    """``F.cross_entropy`` (or ``F.nll_loss``) of this rank's tokens, reduced over all ranks."""
    fn = F.nll_loss if nll else F.cross_entropy
    kwargs = {"weight": weight, "ignore_index": ignore_index}
    if not nll:
        kwargs["label_smoothing"] = label_smoothing
    if reduction == "none":
        return fn(logits, target, reduction="none", **kwargs)
    local = fn(logits, target, reduction="sum", **kwargs)
    return reduce_local_loss(local, target, weight, ignore_index, reduction, group, world, tag)


def reduce_local_loss(
    local: torch.Tensor,
    target: torch.Tensor,
    weight: torch.Tensor | None,
    ignore_index: int,
    reduction: str,
    group: str,
    world: int,
    tag: str,
) -> torch.Tensor:
    """This rank's summed loss ``local`` -> the loss of all ranks' tokens: their sum, or their
    mean over the (weighted) tokens that are not ``ignore_index``."""
    total = all_reduce(local, "sum", group, world, tag)
    if reduction == "sum":
        return total
    valid = target != ignore_index
    if weight is None:
        count = valid.sum().to(total.dtype)
    else:
        w = weight.index_select(0, target.clamp(min=0).flatten()).view_as(target)
        count = (w * valid).sum().to(total.dtype)
    count = all_reduce(count.detach(), "sum", group, world, tag)
    return total / count
