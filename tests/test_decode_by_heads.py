"""``decode_layout="heads"``: the sequence-sharded cache re-laid by head groups at the first
decode step (``tspc.generate_cache.cache_by_heads``), decode attention then local to each rank.

Against one process (transformers' own ``generate``, no tspc) at D = 2: a Llama (GQA 4:2) on a
left-padded batch, greedy, two prompts (the second reuses the compiled prompt program): tokens
equal, every step's logits within 1e-5; each rank holds half of the cache's bytes; the decode
steps' collectives (counted by the runtime) are the all-reduces only (their bytes
``decode_bytes_per_token(layout="heads")`` per token) and the re-layout's, once per layer. A Qwen2 with 2 KV heads at D = 4 (fewer KV heads than ranks: K/V held whole) stays
sequence-sharded and still equals one process.
"""

from __future__ import annotations

import pytest
import torch

from tspc.launch import spawn
from tspc.runtime.decode import decode_bytes_per_token

SMALL = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0,
    use_cache=True, attn_implementation="sdpa",
)  # fmt: skip
NEW = 6


def _model(family: str = "llama"):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **SMALL)).eval()


def _generate(model, width: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (2, width), generator=g)
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
            return_dict_in_generate=True, output_logits=True,
        )  # fmt: skip
    return out


def _run(rank: int, world: int, family: str, tsp: bool) -> dict:
    import tspc
    from tspc.runtime.counters import COUNTER

    model = _model(family)
    if tsp:
        opts = {"inner": "aot_eager", "decode_layout": "heads"}
        model.forward = torch.compile(model.forward, backend="tsp", options=opts)
        tspc.enable_generate(model)
    res = {"tokens": [], "logits": [], "calls": [], "cache": []}
    for width, seed in ((13, 1), (21, 2)):
        COUNTER.reset()
        out = _generate(model, width, seed)
        calls: dict[str, int] = {}
        reduced = 0
        for tag, kinds in COUNTER.snapshot()["by_tag"].items():
            if tag.startswith("decode:"):  # the decode steps' collectives, not the prompt's
                for kind, c in kinds.items():
                    calls[kind] = calls.get(kind, 0) + c["calls"]
                reduced += kinds.get("all_reduce", {}).get("recv_bytes", 0)
        res["calls"].append(calls)
        res.setdefault("all_reduce_bytes", []).append(reduced)
        res["tokens"].append(out.sequences[:, width:].tolist())
        res["logits"].append(torch.stack(out.logits))
        cache = out.cache if hasattr(out, "cache") else out.past_key_values
        res["cache"].append(sum(layer.keys.numel() for layer in cache.layers))
        res["by_heads"] = [getattr(layer, "by_heads", None) for layer in cache.layers]
    return res


@pytest.mark.parametrize(
    ("world", "family"), [(2, "llama"), pytest.param(4, "qwen2", marks=pytest.mark.extended)]
)
def test_decode_by_heads_equals_one_process(world, family):
    one = spawn(_run, 1, family, False)[0]
    for rank, res in enumerate(spawn(_run, world, family, True, timeout=600)):
        assert res["tokens"] == one["tokens"], f"rank {rank}"
        for got, want in zip(res["logits"], one["logits"]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        kv_heads = SMALL["num_key_value_heads"]
        assert res["by_heads"] == [kv_heads % world == 0] * SMALL["num_hidden_layers"]
        layers = SMALL["num_hidden_layers"]
        if kv_heads % world == 0:  # each rank holds its head group's share of every token
            assert [c * world for c in res["cache"]] == one["cache"]
            for calls in res["calls"]:
                # per layer: once, 2 all-to-alls (K, V) and 2 all-gathers (lengths, positions);
                # per token (the first from the prompt's logits, NEW - 1 decoded) the
                # attention output's and the MLP's all-reduces
                assert calls == {
                    "all_to_all": 2 * layers,
                    "all_gather": 2 * layers,
                    "all_reduce": 2 * layers * (NEW - 1),
                }, f"rank {rank}: {calls}"
            per_token = decode_bytes_per_token(
                world=world, batch=2, heads=SMALL["num_attention_heads"], kv_heads=kv_heads,
                head_dim=SMALL["hidden_size"] // SMALL["num_attention_heads"],
                hidden=SMALL["hidden_size"], layers=layers, itemsize=4, layout="heads",
            )  # fmt: skip
            assert res["all_reduce_bytes"] == [(NEW - 1) * per_token] * 2
