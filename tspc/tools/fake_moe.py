"""What ``tspc plan --measure`` needs for a mixture-of-experts shape on fake tensors.

The model: the transformers architecture of the shape's ``family`` (``mixtral``,
``qwen3_moe``), built from its config with the plan's sizes — the model a user compiles, so the
MoE matcher and ``runtime/moe.py``'s expert-parallel op are what run.

The routing. ``tspc::moe_experts`` (and its backward) exchanges a data-dependent number of rows
with each rank, and fake tensors have no data: the op's registered fake implementation returns
its output with the true shape but allocates none of the routed rows it exchanges inside. Those
buffers are sized here under a stated assumption, **perfectly balanced routing**: each rank's
k N pairs (N local tokens) go evenly to the D owners, so every rank receives k N rows, spread
evenly over its c local experts. They are counted as live for the duration of the op (born and
freed at it), at the op's own high-water mark as ``runtime/moe.py`` writes it:

* forward: the pairs' hidden states in expert order and the rows received (``k N h`` each, one
  copy at D = 1, where nothing is exchanged), the experts' outputs (``k N h``), and the larger
  of the returned rows (``k N h``) and one local expert's working set (its ``k N / c`` rows, the
  first matmul's ``2 F`` and the activation's two ``F`` outputs, the second matmul's ``h``);
* backward: the received hidden states and output gradients, the input gradients
  (``k N h`` each), and the larger of the returned gradients (``k N h``) and one expert's
  recomputed forward plus its vector-Jacobian product (twice the forward's working set).

Everything else (the router, the top-k, the weighted sum, the weight-gradient outputs, the
saved tensors) is the real graph's and counted by the tracker as it runs.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

ROUTING_ASSUMPTION = (
    "perfectly balanced routing (fake tensors have no router output): each rank sends k N / D "
    "of its k N (token, choice) pairs to every owner and receives k N rows, even over its "
    "experts; the all-to-all's routed buffers inside tspc::moe_experts are sized from that"
)

FAMILIES = ("mixtral", "qwen3_moe")


def hf_moe_config(shape: Any, layers: int | None = None) -> Any:
    """The transformers config of a planner MoE ``ModelShape`` (``layers`` overrides depth)."""
    from transformers import AutoConfig

    if shape.family not in FAMILIES:
        raise ValueError(
            f"tspc plan --measure builds MoE models of the families {FAMILIES}; this shape's "
            f"family is {shape.family!r} (set ModelShape.family or use a config of those)"
        )
    common = dict(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers if layers is None else layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.resolved_head_dim,
        tie_word_embeddings=shape.tied_embeddings,
        num_experts_per_tok=shape.experts_per_token,
    )
    if shape.family == "mixtral":
        extra = dict(num_local_experts=shape.experts, intermediate_size=shape.expert_intermediate)
    else:
        extra = dict(
            num_experts=shape.experts,
            moe_intermediate_size=shape.expert_intermediate,
            intermediate_size=shape.intermediate,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
        )
    cfg = AutoConfig.for_model(shape.family, **common, **extra)
    cfg._attn_implementation = "sdpa"
    return cfg


def is_hf_config(config: Any) -> bool:
    return hasattr(config, "model_type") and hasattr(config, "to_dict")


class CausalLMLogits(nn.Module):
    """``model(ids) -> logits`` of a transformers causal LM (what ``LossModel`` wraps)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def build_moe_model(config: Any) -> nn.Module:
    """The transformers causal LM of ``config`` in the current default dtype and mode."""
    import logging

    from transformers import AutoModelForCausalLM

    logging.getLogger("transformers").setLevel(logging.ERROR)
    return CausalLMLogits(AutoModelForCausalLM.from_config(config))


def _is_op(func: Any, name: str) -> bool:
    return getattr(func, "namespace", "") == "tspc" and getattr(func, "_opname", "") == name


def routed_buffers(func: Any, args: tuple) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of the buffers ``tspc::moe_experts`` / its backward hold inside, under
    balanced routing (module doc); [] for every other op. The arguments are read by position
    as ``runtime/moe.py`` declares them: forward ``(x, ids, w1, w2, ..., world, ...)``,
    backward ``(grad, x, ids, w1, w2, ..., world, ...)``, ``world`` tenth."""
    if _is_op(func, "moe_experts"):
        x, ids, w1, w2, world, backward = args[0], args[1], args[2], args[3], args[9], False
    elif _is_op(func, "moe_experts_backward"):
        x, ids, w1, w2, world, backward = args[1], args[2], args[3], args[4], args[9], True
    else:
        return []
    h = x.shape[-1]
    pairs = ids.numel()
    local = w1.shape[0]
    rows = pairs  # balanced: a rank receives as many rows as it sends
    first = w1.numel() // max(local * h, 1)  # 2 F (gate and up)
    second = w2.numel() // max(local * h, 1)  # F
    per_expert = -(-rows // local) if local else 0
    expert_work = per_expert * (2 * h + first + 2 * second)
    pair_rows = (rows, h)
    if backward:
        held = [pair_rows, pair_rows, pair_rows]  # hidden states, output grads, input grads
        last = max(rows * h, 2 * expert_work)
    else:
        held = [pair_rows, pair_rows] if world > 1 else [pair_rows]  # sorted pairs, received
        held.append(pair_rows)  # the experts' outputs
        last = max(rows * h if world > 1 else 0, expert_work)
    out = [(s, x.dtype) for s in held]
    if last:
        out.append(((last,), x.dtype))
    return out
