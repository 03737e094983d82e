"""Opt-in check that every rank passed the same inputs (``options={"check_inputs": True}``).

In replicated-input mode each rank must pass the full, identical batch; each takes its zigzag
part. If ranks disagree the result is silently wrong, so this check fingerprints every user
input (two float64 sums: plain and position-weighted) and all-gathers the fingerprints before
each call. Cost: one pass over the inputs and one all-gather of 2 x (number of inputs) float64
values per call — negligible next to a forward, but a synchronisation point, hence opt-in.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.fx as fx

from .errors import TSPConfigError
from .group import process_group


class InputMismatchError(RuntimeError):
    pass


def _fingerprint(t: torch.Tensor) -> torch.Tensor:
    x = t.detach().reshape(-1).to(torch.float64)
    weights = torch.arange(1, x.numel() + 1, dtype=torch.float64, device=x.device)
    return torch.stack([x.sum(), (x * weights.remainder(65521)).sum()])


def check_same_inputs(inputs: list[tuple[str, torch.Tensor]], group: str, world: int) -> None:
    if world == 1 or not inputs:
        return
    mine = torch.stack([_fingerprint(t) for _, t in inputs]).cpu()
    pg = process_group(group)
    everyone = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=pg)
    for i, (name, _) in enumerate(inputs):
        differing = [r for r in range(1, world) if not torch.equal(everyone[r][i], everyone[0][i])]
        if differing:
            raise InputMismatchError(
                f"tspc (check_inputs): input '{name}' differs between ranks: rank(s) "
                f"{differing} passed different values than rank 0. In replicated-input mode "
                "every rank of the TSP group must pass the same full batch."
            )


def refuse_presharded(example_inputs: list[Any], gm: fx.GraphModule) -> None:
    """A model already sharded by FSDP or DTensor-based TP: tspc must see the plain model."""
    from torch.distributed.tensor import DTensor

    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    for name, ex in zip(names, example_inputs):
        kind = None
        if isinstance(ex, DTensor):
            kind = "a DTensor (FSDP2 fully_shard or tensor-parallel parallelize_module)"
        elif type(ex).__name__ == "FlatParameter" or "_fsdp_wrapped_module" in name:
            kind = "an FSDP flat parameter"
        if kind:
            raise TSPConfigError(
                f"tspc: input '{name}' is {kind}: the model is already sharded. tspc shards "
                "weights and tokens itself; compile the unwrapped model with backend='tsp' "
                "(combine with data parallelism through a 2-D mesh, see docs/training.md)."
            )
