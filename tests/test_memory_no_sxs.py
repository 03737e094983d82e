"""No S x S tensor on the TSP path, and matched weights at 1/D per rank — measured.

A Hugging Face Llama builds a ``[B, 1, S, S]`` mask under torch.compile; at S = 4096 a bool mask
alone is 16 MiB and its float scores four times that, while everything else in this tiny model
is a few MiB. The per-rank peak, measured by the CPU allocator tracker (``tspc/tools/memory.py``),
must stay far below one S x S mask — with SDPA's bool mask and with eager attention's additive
one, whose left-padding rows (they see no key) the kernel computes on their own. The same model
with a mask the passes keep (a causal mask that also sees the next token, not recognised: each
rank cuts its rows) shows that the measurement would see one.
"""

from __future__ import annotations

import pytest
import torch

from tspc.launch import spawn

S = 4096


class LookAhead(torch.nn.Module):
    """The Llama's layer under a mask the passes do not recognise: causal plus the next key."""

    def __init__(self, model):
        super().__init__()
        self.model = model.model

    def forward(self, input_ids, attention_mask):
        import torch.nn.functional as F

        pos = torch.arange(input_ids.shape[1])
        mask = (pos[None, :] <= pos[:, None] + 1)[None, None]
        h = self.model.embed_tokens(input_ids)
        attn = self.model.layers[0].self_attn
        b, s, _ = h.shape
        q, k, v = (
            p(h).view(b, s, -1, 16).transpose(1, 2) for p in (attn.q_proj, attn.k_proj, attn.v_proj)
        )
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return attn.o_proj(o.transpose(1, 2).reshape(b, s, -1))


def peak_worker(rank: int, world: int, attn: str, seq: int = S) -> dict:
    """``attn``: "sdpa" or "eager" (Hugging Face's masks), "kept" (``LookAhead``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import tspc
    from tspc.tools.memory import MemoryTracker

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=seq,
        use_cache=False,
        pad_token_id=0,
    )
    cfg._attn_implementation = "sdpa" if attn == "kept" else attn
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    if attn == "kept":
        model = LookAhead(model)
    ids = torch.randint(1, 64, (1, seq))
    mask = torch.ones(1, seq, dtype=torch.long)
    mask[0, :7] = 0  # left padding
    compiled = torch.compile(model, backend="tsp", options={"outputs": "sharded"})
    with torch.no_grad():
        compiled(input_ids=ids, attention_mask=mask)  # compile outside the measurement
        with MemoryTracker() as mt:
            compiled(input_ids=ids, attention_mask=mask)
    rep = tspc.last_report()
    return {"peak": mt.peak_bytes, "masks": [m["recognised"] for m in rep.masks]}


@pytest.mark.slow
@pytest.mark.parametrize(
    "attn, seq",
    [("sdpa", S), ("sdpa", S - 1), ("eager", S)],  # S - 1: padded to a multiple of 2D inside
)
def test_recognised_causal_mask_allocates_no_s_by_s_tensor(attn, seq):
    sxs_bool = seq * seq
    for r in spawn(peak_worker, 2, attn, seq, timeout=600):
        assert r["masks"] and all(r["masks"]), r
        assert r["peak"] < sxs_bool / 4, f"peak {r['peak']} bytes; one S x S bool mask: {sxs_bool}"


@pytest.mark.slow
def test_the_measurement_sees_a_kept_mask():
    for r in spawn(peak_worker, 2, "kept", timeout=600):
        assert not any(r["masks"]), r  # not causal: kept exact, each rank cuts its rows
        assert r["peak"] >= S * S // 2, r  # this rank's rows of a bool mask, at least
