"""The user-facing helpers for training with sharded weights.

After the first forward of a ``backend="tsp"`` model, each rank holds only its shards of the
matched weights (the full tensors are released). These helpers speak in terms of the *original*
model — the one given to ``torch.compile``; the compiled wrapper works too:

* ``parameters(model)`` — what an optimizer should own on this rank: the shards of matched
  weights, the original parameters for everything else.
* ``state_dict(model)`` — the full, unsharded state dict, same keys and shapes as before
  compiling (a collective: every rank of the TSP group must call it).
* ``load_state_dict(model, state_dict)`` — load a full state dict into the shards.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping

import torch
import torch.distributed as dist
from torch import nn

from tspc.runtime.group import process_group
from tspc.runtime.release import allow_state_dict, tspc_internal
from tspc.runtime.shard_store import STORE, ShardedParam


def _root(model: nn.Module) -> nn.Module:
    return getattr(model, "_orig_mod", model)


def named_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """``parameters(model)`` with names: a shard is ``<fqn>@<dim>[<start>:<stop>]``."""
    root = _root(model)
    any_sharded = False
    for name, p in root.named_parameters():
        entry = STORE.get(p)
        if entry is None:
            yield name, p
            continue
        any_sharded = True
        for spec, shard in sorted(entry.shards.items(), key=lambda kv: (kv[0].dim, kv[0].start)):
            yield f"{name}@{spec.dim}[{spec.start}:{spec.stop}]", shard
    if (
        not any_sharded
        and model is not root
        and dist.is_initialized()
        and dist.get_world_size() > 1
    ):
        warnings.warn(
            "tspc.parameters(model): no parameter of this model is sharded yet; call it after "
            "the compiled model's first forward (the shards are cut then)",
            stacklevel=3,
        )


def parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    """What an optimizer should own on this rank (valid after the first compiled forward)."""
    for _, p in named_parameters(model):
        yield p


def _full_tensor(entry: ShardedParam) -> torch.Tensor:
    """Rebuild a full parameter: every rank writes its shards into zeros, then a sum over the
    group. Every part of the tensor is owned by exactly one rank, so the sum is exact."""
    device = next(iter(entry.shards.values())).device if entry.shards else None
    buf = torch.zeros(entry.full_shape, dtype=entry.dtype, device=device)
    for spec, shard in entry.shards.items():
        buf.narrow(spec.dim, spec.start, spec.stop - spec.start).copy_(shard.detach())
    if entry.world > 1:
        dist.all_reduce(buf, group=process_group(entry.group))
    return buf


def state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict — same keys and shapes as the model had before compiling.

    A collective over the TSP group for sharded parameters: call it on every rank.
    """
    root = _root(model)
    with allow_state_dict(), tspc_internal():
        own = root.state_dict(keep_vars=True)
    out: dict[str, torch.Tensor] = {}
    for key, t in own.items():
        entry = STORE.get(t)
        out[key] = _full_tensor(entry) if entry is not None else t.detach().clone()
    return out


def load_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor], strict: bool = True):
    """Load a full state dict: sharded parameters take their slices, the rest is copied."""
    root = _root(model)
    with allow_state_dict(), tspc_internal():
        own = root.state_dict(keep_vars=True)
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if strict and (missing or unexpected):
        raise KeyError(
            f"tspc.load_state_dict: missing keys {missing}, unexpected keys {unexpected}"
        )
    with torch.no_grad():
        for key, value in state.items():
            if key not in own:
                continue
            t = own[key]
            if tuple(value.shape) != tuple(t.shape):
                raise ValueError(
                    f"tspc.load_state_dict: {key} has shape {tuple(value.shape)}, the model "
                    f"expects {tuple(t.shape)}"
                )
            entry = STORE.get(t)
            if entry is None:
                t.copy_(value)
                continue
            for spec, shard in entry.shards.items():
                shard.copy_(value.narrow(spec.dim, spec.start, spec.stop - spec.start))
            if not entry.released:
                t.copy_(value)
    return missing, unexpected
