"""The mixture-of-experts baselines of the memory benchmark, written by hand with torch's own
APIs, the ways a user without tspc parallelises a transformers MoE model over D ranks
(``bench/memory_moe.py`` measures them against one process and TSP).

``build_tp_ep``:

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

``build_tp_sp``: Megatron-SP with the experts tensor-parallel (Megatron's MoE without EP):

* between the blocks every rank holds S/D tokens of the residual stream (contiguous chunks;
  ``SequenceParallel`` norms); attention all-gathers the tokens, runs its heads / D and
  reduce-scatters after o (torch's ``PrepareModuleInput`` / ``RowwiseParallel(output_layouts=
  Shard(1))``);
* the MoE block all-gathers the tokens too; the router runs on all of them (replicated), every
  expert holds its 1/D slice of the intermediate dim (``gate_up_proj`` rows of gate and of up,
  ``down_proj`` columns), so each rank's expert outputs are partial sums over F, reduce-scattered
  back to the rank's tokens (``_ReduceScatterTokens``); the experts' input gradients are
  all-reduced (``_SumBackward``), the router's are whole on every rank already;
* the embedding, the final norm's weight and the LM head are replicated; the final norm's
  output is all-gathered before the LM head. The sequence length must be divisible by D.

The optimizer sees DTensors (attention, norms) and plain tensors (the rest): ``param_groups``
keeps them apart, as for the dense baselines.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from tspc.runtime.decode_moe import expert_range
from tspc.tools.baselines import default_mesh

__all__ = ["build_tp_ep", "build_tp_sp"]


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


class _ReduceScatterTokens(torch.autograd.Function):
    """``[B, S, h]`` partial sums -> this rank's ``[B, S/D, h]`` tokens, summed over ranks;
    backward all-gathers the tokens' gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, world: int) -> torch.Tensor:
        ctx.world = world
        moved = x.movedim(1, 0).contiguous()
        out = moved.new_empty((moved.shape[0] // world, *moved.shape[1:]))
        dist.reduce_scatter_tensor(out, moved)
        return out.movedim(0, 1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        moved = grad.movedim(1, 0).contiguous()
        out = moved.new_empty((moved.shape[0] * ctx.world, *moved.shape[1:]))
        dist.all_gather_into_tensor(out, moved)
        return out.movedim(0, 1), None


def _split_experts_by_f(module: nn.Module, rank: int, world: int) -> None:
    """Keep this rank's 1/D of every expert's intermediate dim: ``gate_up_proj`` ``[E, 2F, h]``
    (gate rows, then up rows: each sliced, so ``chunk(2)`` still splits gate from up) and
    ``down_proj`` ``[E, h, F]``; the experts' input gradients are partial per rank."""
    gate_up, down = module.gate_up_proj, module.down_proj
    f = down.shape[-1]
    if f % world:
        raise ValueError(f"TP+SP needs the experts' intermediate size {f} divisible by {world}")
    c = f // world
    rows = torch.cat(
        [torch.arange(rank * c, (rank + 1) * c), f + torch.arange(rank * c, (rank + 1) * c)]
    )
    module.gate_up_proj = nn.Parameter(gate_up.detach()[:, rows].clone())
    module.down_proj = nn.Parameter(down.detach()[..., rank * c : (rank + 1) * c].clone())

    def route(m, args):
        hidden, index, weights = args
        return _SumBackward.apply(hidden), index, _SumBackward.apply(weights)

    module.register_forward_pre_hook(route)


def build_tp_sp(model: nn.Module, mesh: DeviceMesh | None = None) -> nn.Module:
    """Megatron-SP attention + tensor-parallel experts version of a transformers Mixtral-style
    causal LM (``model.model.layers[i].self_attn`` / ``.mlp.experts``; in place; returns it).
    Same weights and the same full ``input_ids`` on every rank in, the same full logits out."""
    mesh = mesh if mesh is not None else default_mesh()
    world, rank = mesh.size(), mesh.get_local_rank()
    cfg = model.config
    if cfg.num_attention_heads % world or cfg.num_key_value_heads % world:
        raise ValueError(
            f"tensor parallelism over {world} ranks needs the attention heads "
            f"({cfg.num_attention_heads}) and key/value heads ({cfg.num_key_value_heads}) "
            f"divisible by {world}"
        )
    seq = Shard(1)
    plan: dict = {
        # the decoder stack's input cut to this rank's tokens (a local slice; the mask and the
        # RoPE tables were built from the whole embedding output, for the whole sequence)
        "model.layers.0": PrepareModuleInput(
            input_layouts=(Replicate(),), desired_input_layouts=(seq,), use_local_output=True
        ),
        "model.norm": SequenceParallel(use_local_output=True),
        "lm_head": PrepareModuleInput(
            input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
    }
    for i in range(len(model.model.layers)):
        p = f"model.layers.{i}."
        plan.update(
            {
                p + "input_layernorm": SequenceParallel(),
                p + "self_attn": PrepareModuleInput(
                    input_kwarg_layouts={"hidden_states": seq},
                    desired_input_kwarg_layouts={"hidden_states": Replicate()},
                ),
                p + "self_attn.q_proj": ColwiseParallel(),
                p + "self_attn.k_proj": ColwiseParallel(),
                p + "self_attn.v_proj": ColwiseParallel(),
                p + "self_attn.o_proj": RowwiseParallel(output_layouts=seq),
                p + "post_attention_layernorm": SequenceParallel(),
                p + "mlp": PrepareModuleInput(
                    input_layouts=(seq,),
                    desired_input_layouts=(Replicate(),),
                    use_local_output=True,
                ),
            }
        )
    parallelize_module(model, mesh, plan)
    for layer in model.model.layers:
        _split_experts_by_f(layer.mlp.experts, rank, world)
        layer.mlp.register_forward_hook(lambda m, a, out: _ReduceScatterTokens.apply(out, world))
    return model
