"""Decoding one token per sequence on weights that lie as tensor parallelism lays them out.

After the prompt (prefill) ran the TSP schedules, every rank holds 1/D of each matched weight —
its head group's rows of W_Q, W_K, W_V and columns of W_O, its F-slice of the MLP — and its own
prompt tokens' K/V of every head (1/D of one process's cache). A decoded token is one row per
sequence: streaming the weights for it would move the whole model per token. Instead each rank
applies the shards where they lie (tensor parallelism) and reads the sequence-sharded cache with a
distributed flash-decoding merge:

1. q, k, v of the new token for this rank's head group (no communication);
2. one all-gather of [q; k; v] (the head groups a rank holds): every rank gets q of every head,
   and the new token's k, v of every KV head, kept only by the rank that owns the new position
   (``owner_of_next``: the rank with the fewest cached tokens, so the cache stays balanced);
3. each rank attends with every head over *its* cached tokens, giving a partial output and its
   log-sum-exp per head (``partial_attention``);
4. an all-to-all sends each head group's partials to the rank that owns the group (``merge``);
   the log-sum-exp merge (``merge_partials``) gives exactly softmax attention over all tokens;
5. the output projection (W_O's columns) and the MLP's down projection (F-slice) give partial
   sums of h, all-reduced (``o_proj``, ``mlp``).

Bytes received per rank per decoded token and layer (β bytes per element, B sequences, H query
heads, H_kv KV heads of dimension d, hidden h; the all-reduce counted as 2(D-1)/D of the buffer,
``runtime/counters.py``'s convention)::

    (D-1)/D · β · B · (2·H_kv·d·[K/V sharded]  +  H·d  +  H·(d+1))  +  2 · 2(D-1)/D · β · B · h

(the log-sum-exp travels in fp32 with the output: β = 4 for that part when the model is 16-bit,
counted exactly by ``decode_bytes_per_token``). Compare with one layer's matched weights,
β·(2·h·H·d + 2·h·H_kv·d + 3·h·F): the per-token traffic is a few rows of h, not the model.

With ``decode_layout="heads"`` (``tspc.generate_cache.cache_by_heads``) each layer's cache is
re-laid once, at the first decode step, by head groups: an all-to-all of the keys and one of
the values (each rank's part padded to the longest rank's L_max tokens, receiving
(D-1)·β·B·(H_kv/D)·L_max·d for each), then steps 2-4 are one local attention of this rank's
query heads over every token of its KV heads: only step 5's two all-reduces remain per token,
``2 · 2(D-1)/D · β · B · h`` per layer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .counters import count_collective
from .group import process_group
from .precision import upcast


def owner_of_next(counts: list[int]) -> int:
    """The rank that caches the next token: the fewest tokens cached, the lowest rank on a tie
    (every rank computes the same answer from the same counts: no communication)."""
    return min(range(len(counts)), key=lambda r: (counts[r], r))


def decode_bytes_per_token(
    *,
    world: int,
    batch: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    hidden: int,
    layers: int,
    itemsize: int,
    kv_sharded: bool = True,
    mlp_layers: int | None = None,
    layout: str = "sequence",
) -> int:
    """Bytes each rank receives for one decoded token of every sequence (the module docstring's
    formula), summed over ``layers`` attention layers and ``mlp_layers`` (default: as many)
    tensor-parallel MLPs."""
    D = world
    if D == 1:
        return 0
    mlp_layers = layers if mlp_layers is None else mlp_layers
    # each all-gather part is one rank's head group, each all-to-all part one group's partials
    kv = 2 * (kv_heads // D) * head_dim * itemsize if kv_sharded else 0
    q = (heads // D) * head_dim * itemsize
    merge = (heads // D) * (head_dim + 1) * 4  # fp32 partial outputs with their log-sum-exps
    attn = (D - 1) * batch * (kv + q + merge) if layout == "sequence" else 0
    all_reduce = 2 * (D - 1) * batch * hidden * itemsize // D
    return layers * (attn + all_reduce) + mlp_layers * all_reduce


class DecodeComm:
    """The eager collectives of one decode step on the TSP group, counted in ``COUNTER`` under
    ``decode:<layer>`` tags (bytes as in ``runtime/counters.py``)."""

    def __init__(self, group: str, world: int, rank: int) -> None:
        self.group_name = group
        self.pg = process_group(group) if world > 1 else None
        self.world = world
        self.rank = rank

    def all_gather(self, x: torch.Tensor, tag: str) -> list[torch.Tensor]:
        """Every rank's ``x``, in rank order."""
        if self.world == 1:
            return [x]
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x, group=self.pg)
        count_collective("all_gather", tag, x, self.world)
        return parts

    def all_to_all(self, x: torch.Tensor, tag: str) -> torch.Tensor:
        """``x`` of shape [D, ...]: part r goes to rank r; returns [D, ...], part s from rank s."""
        if self.world == 1:
            return x
        x = x.contiguous()
        out = torch.empty_like(x)
        dist.all_to_all_single(out, x, group=self.pg)
        count_collective("all_to_all", tag, x[0], self.world)  # one rank's part
        return out

    def all_reduce(self, x: torch.Tensor, tag: str) -> torch.Tensor:
        if self.world == 1:
            return x
        x = x.contiguous()
        dist.all_reduce(x, group=self.pg)
        count_collective("all_reduce", tag, x, self.world)
        return x


def partial_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor | None, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q`` [B, H, T, d] over this rank's cached keys ``k``, ``v`` [B, H_kv, L, d]
    (query head i reads KV head i // (H / H_kv)); ``keep`` [B, T, L] bool or None (all keys).

    Returns the output normalised over these keys [B, H, T, d] and the log-sum-exp of the
    scores [B, H, T], both in the accumulation dtype (fp32 for 16-bit floats); a row with no
    key here has log-sum-exp -inf and output 0, so it weighs nothing in ``merge_partials``."""
    B, H, T, d = q.shape
    hkv, L = k.shape[1], k.shape[2]
    qf = upcast(q).reshape(B, hkv, H // hkv, T, d)
    kf, vf = upcast(k).unsqueeze(2), upcast(v).unsqueeze(2)  # [B, H_kv, 1, L, d]
    scores = torch.matmul(qf, kf.transpose(-1, -2)) * scale  # [B, H_kv, g, T, L]
    if keep is not None:
        scores = scores.masked_fill(~keep[:, None, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, H_kv, g, T]
    finite = torch.isfinite(lse)
    probs = torch.exp(scores - torch.where(finite, lse, 0.0).unsqueeze(-1))
    out = torch.matmul(probs, vf)  # [B, H_kv, g, T, d]; an empty row gives exp(-inf) = 0
    if L == 0:
        out = qf.new_zeros(B, hkv, H // hkv, T, d)
    return out.reshape(B, H, T, d), lse.reshape(B, H, T)


def merge_partials(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Combine per-rank partial attention ``out`` [D, B, H, T, d] with log-sum-exps ``lse``
    [D, B, H, T] into attention over the union of the ranks' keys [B, H, T, d] (fp32)."""
    m = lse.amax(dim=0)
    m = torch.where(torch.isfinite(m), m, 0.0)
    w = torch.exp(lse - m)  # [D, B, H, T]; a rank with no key weighs 0
    total = w.sum(dim=0).clamp_min(torch.finfo(w.dtype).tiny)
    return (w.unsqueeze(-1) * out).sum(dim=0) / total.unsqueeze(-1)
