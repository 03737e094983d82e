"""No S x S tensor on the TSP path, and matched weights at 1/D per rank — measured.

A Hugging Face Llama builds a ``[B, 1, S, S]`` mask under torch.compile; at S = 4096 a bool mask
alone is 16 MiB and its float scores four times that, while everything else in this tiny model
is a few MiB. The per-rank peak, measured by the CPU allocator tracker (``tspc/memory.py``),
must stay far below one S x S mask. The same model with a mask the passes keep (eager attention
with left padding, kept exact by cutting the mask's rows) shows that the measurement would see
one.
"""

from __future__ import annotations

import pytest
import torch

from tspc.launch import spawn

S = 4096


def peak_worker(rank: int, world: int, attn: str, seq: int = S) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    import tspc
    from tspc.memory import MemoryTracker

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
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
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
@pytest.mark.parametrize("seq", [S, S - 1])  # S - 1: padded to a multiple of 2D inside
def test_recognised_causal_mask_allocates_no_s_by_s_tensor(seq):
    sxs_bool = seq * seq
    for r in spawn(peak_worker, 2, "sdpa", seq, timeout=600):
        assert r["masks"] and all(r["masks"]), r
        assert r["peak"] < sxs_bool / 4, f"peak {r['peak']} bytes; one S x S bool mask: {sxs_bool}"


@pytest.mark.slow
def test_the_measurement_sees_a_kept_mask():
    for r in spawn(peak_worker, 2, "eager", timeout=600):
        assert not any(r["masks"]), r  # additive mask + left padding: kept exact
        assert r["peak"] >= S * S // 2, r  # this rank's rows of a float mask, at least
