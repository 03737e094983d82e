"""Decoding through expert-parallel MoE blocks: every rank holds the same new tokens' hidden
states (decode is tensor-parallel, not sequence-parallel), so no token needs to move. Each rank
runs its own experts (its ``Shard(0)`` slice of the stacked weights, ``torch.chunk``'s split) on
the tokens routed to them, weighted by the router's weights, and one all-reduce sums the ranks'
partial outputs: exactly what one process's loop over every expert adds up.

The module's own forward runs on the local slice: the routed expert ids are renumbered to this
rank's slice, ``num_experts`` is this rank's count for the call, and ids owned elsewhere are set
to it: the sentinel id transformers' experts implementations skip. Its batched and grouped
implementations skip it only in expert-parallel mode (``_is_expert_parallel``: the grouped
kernel leaves a skipped row's output uninitialised and masks it only then), so the hook sets
that flag for the call, as transformers' own expert parallelism does."""

from __future__ import annotations

import inspect

import torch
from torch import nn


def is_stacked_experts(module: nn.Module, name: str, param: torch.Tensor) -> bool:
    """A transformers experts module (``num_experts`` and 3-D stacked weights) whose ``forward``
    takes ``(hidden_states, top_k_index, top_k_weights)``."""
    return (
        param.dim() == 3
        and isinstance(getattr(module, "num_experts", None), int)
        and param.shape[0] <= module.num_experts
    )


def expert_range(num_experts: int, rank: int, world: int) -> tuple[int, int]:
    """The experts this rank owns under ``torch.chunk`` (what ``Shard(0)`` gives)."""
    size = -(-num_experts // world)
    start = min(rank * size, num_experts)
    return start, min(start + size, num_experts)


def takes_routing(module: nn.Module) -> bool:
    """The experts module's ``forward`` takes the routing (``hidden_states, top_k_index,
    top_k_weights``); Llama-4's takes only ``[E N, h]`` rows, every expert's copy of every
    token (expert-major), already scaled by its score."""
    try:
        params = inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return True
    return len(params) >= 2


def every_expert_hooks(module: nn.Module, comm, fqn: str) -> list:
    """Hooks for an experts module run on every expert's rows (Llama-4): this rank runs its
    slice's rows ``[start N, stop N)`` and the ``[E N, h]`` output, zero in the other experts'
    rows, is summed over ranks (one all-reduce of E N h values: every expert's rows are
    needed by the block's own sum over experts after it). Exact: each row is one rank's."""
    total = module.num_experts
    start, stop = expert_range(total, comm.rank, comm.world)

    tokens = [0]  # N of the current call

    def narrow(m, args):
        rows = args[0]
        tokens[0] = n = rows.shape[0] // total
        return (rows[start * n : stop * n], *args[1:])

    def reduce(m, args, out, tag=f"decode:{fqn}"):
        n = tokens[0]
        full = out.new_zeros((total * n, *out.shape[1:]))
        full[start * n : stop * n] = out
        return comm.all_reduce(full, tag)

    return [module.register_forward_pre_hook(narrow), module.register_forward_hook(reduce)]


def local_experts_hooks(module: nn.Module, comm, fqn: str) -> list:
    """Hooks that run ``module`` (holding this rank's slice) on this rank's experts only and
    sum the output over ranks."""
    if not takes_routing(module):
        return every_expert_hooks(module, comm, fqn)
    total = module.num_experts
    start, stop = expert_range(total, comm.rank, comm.world)

    def renumber(m, args, kwargs):
        args = list(args)
        if len(args) >= 2:
            index = args[1]
        else:
            index = kwargs["top_k_index"]
        owned = (index >= start) & (index < stop)
        # every experts implementation (loop, batched, grouped) sizes itself by num_experts
        m.num_experts = stop - start
        m._tspc_was_ep = getattr(m, "_is_expert_parallel", None)
        m._is_expert_parallel = True
        local = torch.where(owned, index - start, torch.full_like(index, stop - start))
        if len(args) >= 2:
            args[1] = local
        else:
            kwargs["top_k_index"] = local
        return tuple(args), kwargs

    def reduce(m, args, out, tag=f"decode:{fqn}"):
        m.num_experts = total
        if m._tspc_was_ep is None:
            del m._is_expert_parallel
        else:
            m._is_expert_parallel = m._tspc_was_ep
        return comm.all_reduce(out, tag)

    return [
        module.register_forward_pre_hook(renumber, with_kwargs=True),
        module.register_forward_hook(reduce),
    ]
