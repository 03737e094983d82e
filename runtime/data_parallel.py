"""Data parallelism on top of TSP: average gradients over the data-parallel axis of the mesh.

Every data-parallel replica runs the same TSP graphs on its own batch, so the gradients a rank
holds (its shards, and the replicated parameters, already summed over the TSP axis in-graph)
are exact for its replica's loss; averaging them over the dp axis gives the gradient of the
mean loss over the global batch, as DDP does. A post-accumulate-grad hook per parameter does it
when the gradient is ready, so the all-reduces start during the backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .group import process_group

# A flag on the tensor marks a hooked parameter: a weak reference to a DTensor parameter would
# make ``model.to()`` fail (``torch.utils.swap_tensors`` refuses weakly referenced tensors).
_FLAG = "_tspc_dp_averaged"


def average_grads_over(params, group_name: str, size: int) -> int:
    """Install (once per parameter) a hook averaging its gradient over ``group_name``."""
    installed = 0
    for p in params:
        if not isinstance(p, torch.Tensor) or not p.requires_grad or getattr(p, _FLAG, False):
            continue

        def hook(param: torch.Tensor, name=group_name, n=size) -> None:
            g = param.grad
            if g is not None:
                if isinstance(g, DTensor):  # a DTensor parameter's gradient: its local part
                    g = g.to_local()
                dist.all_reduce(g, group=process_group(name))
                g.div_(n)

        p.register_post_accumulate_grad_hook(hook)
        setattr(p, _FLAG, True)
        installed += 1
    return installed
