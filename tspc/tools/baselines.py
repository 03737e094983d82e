"""Baselines for the benchmarks and the time model: what a user would pick instead of tspc,
with torch's own APIs (``bench/baselines.py`` re-exports them).

* ``build_tp``: Megatron tensor parallelism via ``torch.distributed.tensor.parallel``:
  ``ColwiseParallel`` for q/k/v/gate/up, ``RowwiseParallel`` for o/down. Weights of the matched
  layers are sharded 1/D; every activation is replicated (full sequence on every rank); one
  all-reduce after attention and one after the MLP per layer, and the same two in backward.
* ``build_tp_sp``: the same plus sequence parallelism (Megatron-SP, torch's documented recipe):
  the residual stream between blocks and the norms are sharded on the sequence dim
  (``SequenceParallel``); ``PrepareModuleInput`` all-gathers the sequence before the colwise
  linears and the rowwise linears reduce-scatter back to sequence shards (their backward is the
  mirror image). The embedding output is split to sequence shards and the final norm's output is
  gathered again before the (replicated) LM head. Measured for two layers: forward 5 all-gathers
  + 4 reduce-scatters, backward 5 all-gathers + 4 reduce-scatters (the final gather's adjoint is
  a local slice, as every rank computes the same loss).

Both shard only the matched attention and MLP projections, as tspc does: embedding, norms and
LM head stay replicated on every rank, so the memory table compares like with like.

Local head counts. The reference ``Attention.forward`` reads ``num_heads``/``num_kv_heads`` from
``self.cfg`` to reshape projections, and after colwise sharding each rank holds only its
``num_heads / D`` heads. ``samples/`` is not modified: each ``Attention`` gets its own copy of the
config (``dataclasses.replace``) with ``num_heads``, ``num_kv_heads`` and ``hidden_size`` divided
by D. ``hidden_size`` has to go down too because ``RefConfig.head_dim`` is derived as
``hidden_size // num_heads``; the attention module reads ``hidden_size`` for nothing else. The
model's own ``cfg`` (RoPE tables, mask) is untouched, and contiguous colwise shards line up with
GQA: rank r's query heads ``[r*H/D, (r+1)*H/D)`` use exactly its kv heads ``[r*KV/D, ...)``.

RoPE and the causal mask are built in ``RefModel.forward`` from ``input_ids``, which every rank
passes in full, so they cover the full sequence; both parallel modes run attention on the full
sequence (TP+SP gathers it first), so those tables are used exactly as in one process.

Optimizer. ``model.parameters()`` mixes DTensors (sharded projections; norm weights under SP) and
plain tensors (embedding, LM head). ``AdamW(model.parameters())`` works on CPU, where the default
is the per-tensor loop, but with ``foreach=True`` (the default on GPUs) it fails with "aten.
_foreach_mul_.Scalar got mixed torch.Tensor and DTensor". ``param_groups(model)`` gives the
optimizer one group of each kind, which works either way.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

__all__ = ["build_tp", "build_tp_sp", "default_mesh", "full_parameters", "param_groups"]


def default_mesh() -> DeviceMesh:
    """A 1-D CPU mesh over the whole (gloo) world group."""
    return init_device_mesh("cpu", (dist.get_world_size(),))


def _localize_attention_heads(model: nn.Module, tp: int) -> None:
    cfg = model.cfg
    if cfg.num_heads % tp or cfg.num_kv_heads % tp:
        raise ValueError(
            f"tensor parallelism over {tp} ranks needs num_heads ({cfg.num_heads}) and "
            f"num_kv_heads ({cfg.num_kv_heads}) divisible by {tp}"
        )
    for layer in model.layers:
        attn = layer.attn
        local = dataclasses.replace(
            attn.cfg,
            num_heads=cfg.num_heads // tp,
            num_kv_heads=cfg.num_kv_heads // tp,
            hidden_size=cfg.hidden_size // tp,  # keeps head_dim = hidden_size // num_heads
        )
        assert local.head_dim == cfg.head_dim
        attn.cfg = local  # a per-module copy: model.cfg and the other layers are unaffected


def _check_divisible(model: nn.Module, tp: int) -> None:
    if model.cfg.intermediate_size % tp:
        raise ValueError(f"intermediate_size {model.cfg.intermediate_size} not divisible by {tp}")


def build_tp(model: nn.Module, mesh: DeviceMesh | None = None) -> nn.Module:
    """Tensor-parallel version of the reference model (in place; returns it).

    Same weights on every rank in, same full logits on every rank out."""
    mesh = mesh if mesh is not None else default_mesh()
    tp = mesh.size()
    _check_divisible(model, tp)
    _localize_attention_heads(model, tp)
    plan: dict[str, Any] = {}
    for i in range(len(model.layers)):
        p = f"layers.{i}."
        plan.update(
            {
                # Megatron's "f": make the block input one Replicate DTensor, so the colwise
                # projections' input gradients meet as a Partial DTensor and are all-reduced
                # once per block in backward. Without this each ColwiseParallel wraps the plain
                # input itself and backward runs one all-reduce per projection (measured: 10
                # instead of 4 for two layers).
                p + "attn": PrepareModuleInput(
                    input_layouts=(Replicate(), None, None, None),
                    desired_input_layouts=(Replicate(), None, None, None),
                ),
                p + "attn.q_proj": ColwiseParallel(),
                p + "attn.k_proj": ColwiseParallel(),
                p + "attn.v_proj": ColwiseParallel(),
                p + "attn.o_proj": RowwiseParallel(),  # all-reduce, plain replicated output
                p + "mlp": PrepareModuleInput(
                    input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)
                ),
                p + "mlp.gate_proj": ColwiseParallel(),
                p + "mlp.up_proj": ColwiseParallel(),
                p + "mlp.down_proj": RowwiseParallel(),
            }
        )
    return parallelize_module(model, mesh, plan)


def build_tp_sp(model: nn.Module, mesh: DeviceMesh | None = None) -> nn.Module:
    """Tensor + sequence parallel (Megatron-SP) version of the reference model (in place).

    Between blocks every rank holds S/D tokens of the residual stream (a plain local tensor);
    inside attention and the MLP it holds all S tokens and 1/D of the heads / intermediate dim.
    The sequence length must be divisible by the mesh size (DTensor's Shard(1) would otherwise
    split unevenly, which the plain-tensor residual stream does not describe)."""
    mesh = mesh if mesh is not None else default_mesh()
    tp = mesh.size()
    _check_divisible(model, tp)
    _localize_attention_heads(model, tp)
    seq = Shard(1)
    plan: dict[str, Any] = {
        # Embedding stays replicated; its full output is cut to this rank's sequence shard
        # (a local slice, no communication; the backward all-gathers the gradient).
        "embed": PrepareModuleOutput(
            output_layouts=Replicate(), desired_output_layouts=seq, use_local_output=True
        ),
        "norm": SequenceParallel(),
        # The replicated LM head needs the whole sequence: all-gather the final norm's output.
        "lm_head": PrepareModuleInput(
            input_layouts=(seq,), desired_input_layouts=(Replicate(),), use_local_output=True
        ),
    }
    for i in range(len(model.layers)):
        p = f"layers.{i}."
        plan.update(
            {
                p + "input_norm": SequenceParallel(),
                # (x, cos, sin, mask): all-gather x over the sequence; it stays a Replicate
                # DTensor, so the colwise gradients meet as a Partial DTensor and the backward
                # of this all-gather is one reduce-scatter (not one all-reduce per projection).
                p + "attn": PrepareModuleInput(
                    input_layouts=(seq, None, None, None),
                    desired_input_layouts=(Replicate(), None, None, None),
                ),
                p + "attn.q_proj": ColwiseParallel(),
                p + "attn.k_proj": ColwiseParallel(),
                p + "attn.v_proj": ColwiseParallel(),
                p + "attn.o_proj": RowwiseParallel(output_layouts=seq),  # reduce-scatter
                p + "post_attn_norm": SequenceParallel(),
                p + "mlp": PrepareModuleInput(
                    input_layouts=(seq,), desired_input_layouts=(Replicate(),)
                ),
                p + "mlp.gate_proj": ColwiseParallel(),
                p + "mlp.up_proj": ColwiseParallel(),
                p + "mlp.down_proj": RowwiseParallel(output_layouts=seq),
            }
        )
    model = parallelize_module(model, mesh, plan)
    model.register_forward_pre_hook(partial(_check_sequence, tp))
    return model


def _check_sequence(tp: int, module: nn.Module, args: tuple) -> None:
    # An uneven split would make the local shards disagree with the Shard(1) DTensors built
    # from them (from_local assumes equal shards) and give wrong results, not an error.
    seq_len = args[0].shape[1]
    if seq_len % tp:
        raise ValueError(f"TP+SP needs the sequence length ({seq_len}) divisible by {tp}")


def param_groups(model: nn.Module, **options: Any) -> list[dict[str, Any]]:
    """Optimizer parameter groups with DTensor and plain parameters kept apart."""
    dt = [p for p in model.parameters() if isinstance(p, DTensor)]
    plain = [p for p in model.parameters() if not isinstance(p, DTensor)]
    return [g for g in ({"params": dt, **options}, {"params": plain, **options}) if g["params"]]


def full_parameters(model: nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (or its gradient) as a full tensor, gathered from the shards.

    A collective when anything is sharded: call it on every rank."""
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        t = p.grad if grads else p
        if t is None:
            continue
        out[name] = (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()
    return out
