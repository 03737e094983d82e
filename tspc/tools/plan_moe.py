"""The MoE terms of `tspc plan`'s analytic model (``ModelShape.experts > 0``).

A MoE layer is attention plus a router ``[E, h]`` and E gated experts of width F_e; each token
runs k of them. Per device, with c = ceil(E / D) experts per rank on the TSP axis:

* **model state** (kappa bytes per parameter):
  TSP(D): ``L (P_attn / D + P_exp c / E + P_router) + P_emb + P_norm`` — experts 1/D by expert
  (``Shard(0)``, runtime/moe.py), attention 1/D, router and embeddings whole;
  TP / TP+SP(T): ``(L P_layer + P_emb) / T + P_norm`` — every expert TP-sharded by F;
  TP+EP(T = D): ``L (P_attn / D + P_exp c / E + P_router) + P_emb / D + P_norm`` — attention
  heads and the vocabulary split over D, experts by expert over the same D ranks.
* **activations** per token per layer (elements): ``a_rep`` (5h, as dense), the attention's
  ``2q + 2h_kv``, the experts' ``4 k F_e`` (gate, up, act(gate), act*up of each of the token's k
  pairs) and the routed tokens' buffers ``a_route``:
  TSP: ``5 k h`` per *local* token (this rank's pairs sent, received and computed, returned,
  and put back in pair order: balanced routing, so a rank receives as many rows as it sends);
  TP+SP: ``3 k h`` per token of the sequence shard (the permuted copy, the experts' partial
  outputs, the weighted pair outputs: h-wide on every TP rank, TP splits F only);
  TP+EP: ``2 k h / D`` per token (each rank copies and computes only its experts' pairs; the
  combined ``[N, h]`` output is in a_rep). The attention and expert terms split by T under TP
  (heads; F or experts), not under TSP (whose ranks run all heads and every expert's pairs of
  their own tokens).
* **communication** per layer, TSP: the ring streams the attention weights only (the experts
  stay put) plus the K/V ring, and the all-to-alls move each pair's hidden state to its
  expert's owner and back: forward ``2 (D-1)/D k (B S / D) h b``, backward ``3 (D-1)/D k
  (B S / D) h b`` (the hidden states and output gradients again, the input gradients back),
  plus ``(D-1) c 8`` bytes of counts each way — ``runtime.moe.moe_bytes`` with balanced routing.
  TP+EP moves what TP moves (two activation all-reduces per layer each way: the combine is
  the MLP's all-reduce).
"""

from __future__ import annotations

from tspc.tools.shapes import ModelShape, PlanInputs


def experts_per_rank(model: ModelShape, devices: int) -> int:
    """c = ceil(E / D): rank r owns experts [r c, min((r + 1) c, E)) (runtime/moe.py)."""
    return -(-model.experts // devices)


def model_state_params(model: ModelShape, inputs: PlanInputs, kind: str, tp: int) -> float:
    """Parameters per device of a MoE model under ``kind`` (module doc)."""
    layers = model.layers
    if kind in ("TSP", "TP+EP"):
        expert_share = experts_per_rank(model, tp) / model.experts
        per_layer = model.attn_params / tp + model.expert_params * expert_share
        per_layer += model.router_params
        if kind == "TSP":
            embed_ways = tp if inputs.tsp_embeddings == "sharded" else 1
        else:
            embed_ways = tp
        return layers * per_layer + model.embedding_params / embed_ways + model.norm_params
    return (layers * model.layer_params + model.embedding_params) / tp + model.norm_params


def routed_per_token(model: ModelShape, kind: str, tp: int) -> float:
    """a_route: the routed tokens' buffers per token per layer, in elements (module doc)."""
    k, h = model.experts_per_token, model.hidden
    if kind == "TSP":
        return 5 * k * h
    if kind == "TP+EP":
        return 2 * k * h / tp
    return 3 * k * h


def tsp_all_to_all_bytes(model: ModelShape, inputs: PlanInputs, backward: bool) -> float:
    """Bytes a rank receives in one MoE layer's all-to-alls under balanced routing."""
    d = inputs.devices
    if d == 1:
        return 0.0
    local_pairs = model.experts_per_token * inputs.micro_batch * inputs.seq_len / d
    rows = (d - 1) / d * local_pairs * model.hidden * inputs.act_bytes
    counts = (d - 1) * experts_per_rank(model, d) * 8
    return counts + (3 if backward else 2) * rows


def divisibility_notes(model: ModelShape, ways: int, kind: str) -> tuple[str, ...]:
    """Where the experts do not split evenly over the expert-parallel ranks."""
    if kind not in ("TSP", "TP+EP") or ways == 1:
        return ()
    c = experts_per_rank(model, ways)
    if (ways - 1) * c >= model.experts:
        return (
            f"{model.experts} experts on {ways} ranks: a rank would own none; tspc then holds "
            "the experts whole on every rank (figures above assume the split)",
        )
    if model.experts % ways:
        return (f"{model.experts} experts not divisible by {ways}: {c} on the first ranks",)
    return ()
