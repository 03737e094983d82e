"""Refuse a model that is already sharded (FSDP, DTensor tensor parallelism): tspc shards the
weights and the tokens itself, from the plain model."""

from __future__ import annotations

from typing import Any

import torch.fx as fx

from .errors import TSPConfigError


def over_own_parameters(example_inputs: list[Any]) -> bool:
    """A graph reading DTensors on the mesh of parameters tspc already made: an optimizer step,
    gradient clipping or a weight average compiled after the model's first call (parameters,
    their gradients, optimizer state) — not a model sharded before tspc saw it (refused at
    its first compile, before tspc made any DTensor).

    A DTensor parameter tspc did not make marks the graph as a user-sharded model even when
    its mesh is one tspc uses: torch hands out the same world-mesh object again, and an
    earlier model of the same process may still be alive."""
    import torch.nn as nn
    from torch.distributed.tensor import DTensor

    from .tsp_params import REGISTRY, is_tsp_dtensor

    dtensors = [x for x in example_inputs if isinstance(x, DTensor)]
    if any(isinstance(x, nn.Parameter) and not is_tsp_dtensor(x) for x in dtensors):
        return False
    meshes = REGISTRY.meshes()
    return any(is_tsp_dtensor(x) or any(x.device_mesh is m for m in meshes) for x in dtensors)


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
