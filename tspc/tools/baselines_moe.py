"""The mixture-of-experts baseline of the memory benchmark: TP + EP, written by hand with torch's
own APIs, the way a user without tspc parallelises a transformers MoE model over D ranks
(``bench/memory_moe.py`` measures it against one process and TSP).

* **Attention: tensor parallel** (``parallelize_module``): ``ColwiseParallel`` for q/k/v,
  ``RowwiseParallel`` for o — transformers' own ``base_model_tp_plan`` for these families.
  Activations are replicated: every rank holds every token.
* **Experts: expert parallel** over the same ranks: rank r keeps only its experts
  ``[r c, min((r + 1) c, E))``, ``c = ceil(E / D)`` (``torch.chunk``'s split, as tspc's
  ``Shard(0)``), as plain parameters of its own. Every rank already holds every token, so no
  token moves: each runs its experts on the pairs routed to them (the experts module's own
  forward, ids owned elsewhere set to the sentinel transformers' experts skip, as its own expert
  parallelism does) and one all-reduce sums the ranks' partial outputs. In backward the
  gradients of the experts' inputs (hidden states and router weights) are partial per rank and
  are all-reduced (Megatron's f / g pair: ``_SumForward`` / ``_SumBackward``).
* Embeddings, norms, routers and the LM head are replicated, as in tspc.

The optimizer sees DTensors (attention) and plain tensors (the rest): ``param_groups`` keeps
them apart, as for the dense baselines.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from tspc.runtime.decode_moe import expert_range
from tspc.tools.baselines import default_mesh

__all__ = ["build_tp_ep"]


class _SumForward(torch.autograd.Function):
    """All-reduce (sum) in forward, identity in backward: the ranks' partial expert outputs
    become the block's output, whose gradient every rank already holds whole."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _SumBackward(torch.autograd.Function):
    """Identity in forward, all-reduce (sum) in backward: each rank's gradient of an expert
    input covers its own experts only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


def _stacked_experts(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules holding stacked ``[E, ., .]`` expert weights whose forward takes the routing
    ``(hidden_states, top_k_index, top_k_weights)``."""
    out = []
    for name, m in model.named_modules():
        params = [p for p in m.parameters(recurse=False) if p.dim() == 3]
        if params and isinstance(getattr(m, "num_experts", None), int):
            out.append((name, m))
    return out


def _keep_own_experts(module: nn.Module, rank: int, world: int) -> None:
    total = module.num_experts
    start, stop = expert_range(total, rank, world)
    if stop <= start:
        raise ValueError(
            f"TP+EP over {world} ranks leaves rank {rank} no expert of {total}: use a D that "
            "divides the number of experts"
        )
    for pname, p in list(module.named_parameters(recurse=False)):
        if p.dim() == 3 and p.shape[0] == total:
            setattr(module, pname, nn.Parameter(p.detach()[start:stop].clone()))

    def route(m, args, kwargs):
        args = list(args)
        hidden, index, weights = (args + [None, None, None])[:3]
        index = index if index is not None else kwargs.pop("top_k_index")
        weights = weights if weights is not None else kwargs.pop("top_k_weights")
        owned = (index >= start) & (index < stop)
        local = torch.where(owned, index - start, torch.full_like(index, stop - start))
        m.num_experts = stop - start
        m._is_expert_parallel = True  # the grouped kernel masks the sentinel's rows only then
        return (_SumBackward.apply(hidden), local, _SumBackward.apply(weights)), kwargs

    def combine(m, args, out):
        m.num_experts = total
        return _SumForward.apply(out)

    module.register_forward_pre_hook(route, with_kwargs=True)
    module.register_forward_hook(combine)


def build_tp_ep(model: nn.Module, mesh: DeviceMesh | None = None) -> nn.Module:
    """TP attention + EP experts version of a transformers MoE causal LM (in place; returns
    it). Same weights on every rank in, same full logits on every rank out."""
    mesh = mesh if mesh is not None else default_mesh()
    world, rank = mesh.size(), mesh.get_local_rank()
    cfg = getattr(model, "config", None) or model.model.config
    if cfg.num_attention_heads % world or cfg.num_key_value_heads % world:
        raise ValueError(
            f"tensor parallelism over {world} ranks needs the attention heads "
            f"({cfg.num_attention_heads}) and key/value heads ({cfg.num_key_value_heads}) "
            f"divisible by {world}"
        )
    plan = {}
    for name, m in model.named_modules():
        if all(hasattr(m, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
            plan.update(
                {
                    f"{name}.q_proj": ColwiseParallel(),
                    f"{name}.k_proj": ColwiseParallel(),
                    f"{name}.v_proj": ColwiseParallel(),
                    f"{name}.o_proj": RowwiseParallel(),
                }
            )
    experts = _stacked_experts(model)
    if not plan or not experts:
        raise ValueError("build_tp_ep needs a model with q/k/v/o attention and stacked experts")
    parallelize_module(model, mesh, plan)
    for _, m in experts:
        _keep_own_experts(m, rank, world)
    return model
