"""One decode step's attention on the shards: transformers' attention-interface function that
``tspc/generate.py`` registers for decoding.

``query`` holds this rank's head group (or every head when the projection is kept whole); the
cache holds this rank's tokens of every head (``TSPCacheLayer``), or a head group's every token
once the cache is laid out by heads (``decode_layout="heads"``). Sharded q/k/v of the new tokens
are all-gathered once; each rank attends over its own cached tokens and the partial results are
merged with their log-sum-exps (a distributed flash-decoding step, ``runtime/decode.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tspc.generate_cache import GenerateUnsupportedError, cache_by_heads, current_step
from tspc.runtime.decode import DecodeComm, merge_partials, partial_attention

ATTN_NAME = "tspc_decode"


# --------------------------------------------------------------------------- one decode step


@dataclass
class DecodeStep:
    comm: DecodeComm
    cache: Any
    tag_of_layer: dict[int, str] = field(default_factory=dict)  # layer index -> counter tag
    touched: bool = False  # the cache saw this step (a failure after that cannot be retried)
    layout: str = "sequence"  # the decode_layout option: "heads" re-lays the cache by heads

    def kv_sharded(self, k: torch.Tensor, kv_heads: int) -> bool:
        """Whether the new token's ``k`` holds this rank's group of the ``kv_heads`` heads the
        cache holds (the prompt's K/V came out of the graph with every head: the cache, not a
        config attribute, says how many there are)."""
        n = k.shape[1]
        if n == kv_heads:
            return False
        if n * self.comm.world == kv_heads:
            return True
        raise GenerateUnsupportedError(
            f"tspc: a decode step produced {n} KV heads on this rank of {self.comm.world}, "
            f"neither all {kv_heads} nor an even share: the K/V projection is not sharded "
            "by whole head groups"
        )


def decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
    """transformers attention-interface function for one decode step: ``query`` [B, H_l, T, d]
    holds this rank's head group (or all heads when the projection is not sharded); ``key`` /
    ``value`` are this rank's cached tokens (``TSPCacheLayer.update`` returned them)."""
    step = current_step()
    for name in ("softcap", "sinks", "s_aux"):
        if kw.get(name) is not None:
            raise GenerateUnsupportedError(f"tspc: decode attention with {name} is not supported")
    layer_idx = module.layer_idx
    layer = step.cache.layers[layer_idx]
    tag = step.tag_of_layer.get(layer_idx, "decode")
    comm = step.comm
    B, h_local, T, d = query.shape
    heads = module.config.num_attention_heads
    if h_local == heads:
        q_sharded = False
    elif h_local * comm.world == heads:
        q_sharded = True
    else:
        raise GenerateUnsupportedError(
            f"tspc: {h_local} query heads on this rank of {comm.world} ({heads} in all): the "
            "query projection is not sharded by whole head groups"
        )
    k_new, v_new = layer.pending
    layer.pending = None
    scale = scaling if scaling is not None else d**-0.5
    by_heads_possible = layer.window is None and k_new.shape[1] * comm.world == layer.keys.shape[1]
    if step.layout == "heads" and q_sharded and not layer.by_heads and by_heads_possible:
        cache_by_heads(layer, comm, tag)  # once per layer: then no collective here
    if layer.by_heads:
        layer.append_by_heads(k_new, v_new)
        return _local_attention(query, layer, attention_mask, T, scale)
    kv_sharded = step.kv_sharded(k_new, layer.keys.shape[1])
    # one all-gather of what is sharded: [q; k; v] of this rank's head groups
    mine = ([query] if q_sharded else []) + ([k_new, v_new] if kv_sharded else [])
    if mine:
        parts = comm.all_gather(torch.cat(mine, dim=1), tag)
        sizes = [t.shape[1] for t in mine]
        split = [p.split(sizes, dim=1) for p in parts]
        gathered = [torch.cat([s[i] for s in split], dim=1) for i in range(len(mine))]
        if q_sharded:
            query_all, gathered = gathered[0], gathered[1:]
        if kv_sharded:
            k_new, v_new = gathered
    q_all = query_all if q_sharded else query
    layer.append(k_new, v_new)
    if comm.world == 1:  # every key is here: no partial to merge, the fused kernel
        return _local_attention(q_all, layer, attention_mask, T, scale)
    key, value = layer.keys, layer.values
    keep = _kept_keys(attention_mask, layer, T)
    out, lse = partial_attention(q_all, key, value, keep, scale)  # every head, these keys
    packed = torch.cat([out, lse.unsqueeze(-1)], dim=-1)  # [B, H, T, d+1] fp32
    if q_sharded:
        parts = packed.reshape(B, comm.world, h_local, T, d + 1).transpose(0, 1)
        recv = comm.all_to_all(parts, tag)  # [D, B, H_l, T, d+1]: my group, from every rank
    else:
        recv = torch.stack(comm.all_gather(packed, tag))
    merged = merge_partials(recv[..., :d], recv[..., d])  # [B, H_l, T, d]
    return merged.to(query.dtype).transpose(1, 2).contiguous(), None


def _kept_keys(attention_mask, layer, T: int) -> torch.Tensor | None:
    """[B, T, L_p] bool: which of the layer's cached tokens each new query may see (None: all),
    read from the model's mask at the cached tokens' true positions."""
    if attention_mask is None:
        return None
    cols = attention_mask[:, 0, -T:, :].index_select(-1, layer.positions)
    return cols if cols.dtype == torch.bool else cols > torch.finfo(cols.dtype).min / 2


def _local_attention(query, layer, attention_mask, T: int, scale: float):
    """Attention of ``query`` [B, H_q, T, d] over every cached token of its heads (D = 1, or a
    cache held by head groups): one fused SDPA, no partial to merge."""
    key, value = layer.keys, layer.values
    keep = _kept_keys(attention_mask, layer, T)
    mask = None if keep is None else keep[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        query, key, value, attn_mask=mask, scale=scale, enable_gqa=key.shape[1] != query.shape[1]
    )
    return out.transpose(1, 2).contiguous(), None


def register_decode_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_NAME, decode_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
