"""Identity-forward functions that fix up gradients at the edges of the sharded program.

The rewritten graph follows one convention for gradients (``passes/shard_sequence.py``): the
gradient a rank holds for a *replicated* value is a partial sum, and the true gradient is the sum
over ranks. Two places need a conversion:

* ``sync_replicated_grad`` sits right after a replicated input that requires grad (parameters
  that are not sharded: norms, embeddings, unmatched layers; replicated user inputs). Its backward
  all-reduces the partial gradient, so ``.grad`` is the full, single-device gradient on every rank.
* ``replicated_output`` sits right before a replicated graph output. The user's code after the
  graph runs identically on every rank and hands each rank the *same*, complete gradient; its
  backward turns that into a partial (rank 0 keeps it, the others contribute zero).
"""

from __future__ import annotations

import torch

from .comm import all_reduce


class _SyncReplicatedGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, world, tag):
        ctx.args = (group, world, tag)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        group, world, tag = ctx.args
        return all_reduce(grad, "sum", group, world, tag), None, None, None


def sync_replicated_grad(x: torch.Tensor, group: str, world: int, tag: str) -> torch.Tensor:
    return _SyncReplicatedGrad.apply(x, group, world, tag)


class _ReplicatedOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rank):
        ctx.rank = rank
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        # A multiply on every rank rather than a branch on the rank. Nothing here needs the
        # ranks' backward graphs to agree (they differ anyway: the weight broadcast's source
        # alone keeps the reduced gradient, runtime/comm.py); what must agree is the order of
        # the collectives, and this op issues none.
        return grad * (1.0 if ctx.rank == 0 else 0.0), None


def replicated_output(x: torch.Tensor, rank: int) -> torch.Tensor:
    return _ReplicatedOutput.apply(x, rank)


def plain_tangents(outputs):
    """The compiled graph's outputs, each plain one that requires grad hooked so that a
    DTensor gradient reaching it becomes the plain tensor the graph's backward expects.

    Code after the graph may combine an output with tspc's DTensor parameters (an L2 penalty
    over ``model.parameters()``: ``loss + sum(p.pow(2).sum() ...)`` is a replicated DTensor),
    and autograd then hands the output a DTensor gradient, which aot_autograd's backward
    refuses ("a tensor subclass where we guessed its metadata incorrectly"). The output is the
    same on every rank, so its gradient is the DTensor's full value."""
    for out in outputs if isinstance(outputs, (list, tuple)) else (outputs,):
        if isinstance(out, torch.Tensor) and out.requires_grad and out.grad_fn is not None:
            out.register_hook(_full_value)
    return outputs


def _full_value(grad: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return grad.full_tensor() if isinstance(grad, DTensor) else grad
