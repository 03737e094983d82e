"""``generate()``'s prompt padded to a bucket (``tspc/prefill_buckets.py``).

* the inputs: what is padded and how, and which calls are left alone (no process group);
* the claim the padding rests on, in one process without tspc: a transformers Llama's prefill on
  the bucketed inputs, trimmed, gives the unpadded call's logits and K/V (a left-padded batch,
  every logit and one logit kept);
* a serving loop at D = 1 (decode's attention: one fused SDPA, no partials to merge) and D = 2
  (requests of batch 1-4 and lengths 5-40, left-padded, routed by
  ``tspc.enable_generate`` before the first): tokens equal one process, and tspc compiles once
  per batch bucket (counted by ``counters["tspc"]["compiles"]``), not once per request.
"""

from __future__ import annotations

import pytest
import torch

from tspc.launch import spawn
from tspc.prefill_buckets import bucket_prompt, trim_prefill_output

SMALL = dict(
    vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0,
    use_cache=True, attn_implementation="sdpa",
)  # fmt: skip


def _llama():
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **SMALL)).eval()


def _left_padded(batch: int, width: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 128, (batch, width), generator=g)
    mask = torch.ones_like(ids)
    for row in range(1, batch):
        ids[row, : row * 2], mask[row, : row * 2] = 0, 0
    return ids, mask


def test_inputs_padded_to_the_bucket():
    ids, mask = _left_padded(3, 7)
    pos = mask.cumsum(-1) - 1
    args, kw, b = bucket_prompt(
        (), {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "logits_to_keep": 1}, 2
    )
    assert args == () and (b.batch, b.length, b.padded_batch, b.padded_length) == (3, 7, 4, 8)
    assert kw["input_ids"].shape == kw["attention_mask"].shape == (4, 8)
    assert torch.equal(kw["input_ids"][:3, :7], ids) and torch.equal(
        kw["input_ids"][3], kw["input_ids"][0]
    )
    assert kw["attention_mask"][:, 7].eq(1).all()  # a mask of ones after the prompt
    assert torch.equal(kw["position_ids"][:3, 7], pos[:, 6] + 1)  # positions go on counting
    assert kw["logits_to_keep"] == 4  # keep + 2D - 1
    # a prompt already in its bucket is passed as it is (shapes unchanged)
    _, kw, b = bucket_prompt((), {"input_ids": ids[:2, :4]}, 1)
    assert not b.padded and kw["input_ids"].shape == (2, 4)


@pytest.mark.parametrize(
    "extra",
    [
        {"output_hidden_states": True},
        {"pixel_values": torch.zeros(3, 3)},
        {"logits_to_keep": 9},
        {"logits_to_keep": 5},
    ],
    ids=["hidden-states-asked", "unknown-tensor", "many-logits-short-prompt", "keep-spans-bucket"],
)
def test_calls_it_cannot_pad_run_unpadded(extra):
    ids, _ = _left_padded(3, 7)
    args, kw, b = bucket_prompt((), {"input_ids": ids, **extra}, 2)
    assert b is None and kw["input_ids"] is ids


@pytest.mark.parametrize("keep", [None, 1, 3])
def test_trimmed_prefill_equals_the_unpadded_one(keep):
    """One process, no tspc: what the bucketing's correctness rests on (a causal model's real
    tokens do not see the pad after them; the copied rows are dropped)."""
    from transformers import DynamicCache

    model = _llama()
    ids, mask = _left_padded(3, 13)
    base = {"input_ids": ids, "attention_mask": mask, "use_cache": True}
    if keep is not None:
        base["logits_to_keep"] = keep
    with torch.no_grad():
        ref = model(**base, cache=DynamicCache())
        _, kw, bucket = bucket_prompt((), base, 2)
        assert bucket.padded
        out = model(**kw, cache=DynamicCache())
    name = "cache"
    out = trim_prefill_output(out, bucket, name, sharded=False)
    torch.testing.assert_close(out["logits"], ref["logits"], atol=1e-5, rtol=1e-5)
    for got, want in zip(out[name].layers, ref[name].layers):
        torch.testing.assert_close(got.keys, want.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.values, want.values, atol=1e-5, rtol=1e-5)


REQUESTS = [(1, 17), (4, 23), (3, 9), (2, 40), (1, 5), (4, 31), (2, 12), (3, 38)]
SHORT = [(1, 3), (2, 4)]  # (batch, length): at most 2D tokens at D = 2


def _serve(rank: int, world: int, tsp: bool = True) -> dict:
    import tspc
    from tspc.runtime.compat import dynamo_counters

    model = _llama()
    if tsp:
        model.forward = torch.compile(model.forward, backend="tsp", options={"inner": "aot_eager"})
        tspc.enable_generate(model)
    counters = dynamo_counters()
    before = counters["tspc"]["compiles"]
    tokens = []
    for i, (batch, width) in enumerate(REQUESTS):
        ids, mask = _left_padded(batch, width, seed=i)
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False
            )
        tokens.append(out[:, width:].tolist())
    compiles = counters["tspc"]["compiles"] - before
    # prompts of 2D tokens or fewer, whose kept logits (k + 2D - 1) would span the whole bucket:
    # they run unpadded (the bucketed program gave rank 1 another position's logits there)
    logits = []
    for i, (batch, width) in enumerate(SHORT):
        ids, mask = _left_padded(batch, width, seed=50 + i)
        with torch.no_grad():
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False,
                return_dict_in_generate=True, output_logits=True,
            )  # fmt: skip
        tokens.append(out.sequences[:, width:].tolist())
        logits.append(torch.stack(out.logits))
    return {"tokens": tokens, "compiles": compiles, "logits": logits}


@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.extended), 2])
def test_serving_loop_compiles_once_per_batch_bucket(world):
    one = spawn(_serve, 1, False)[0]
    for rank, res in enumerate(spawn(_serve, world, True, timeout=600)):
        assert res["tokens"] == one["tokens"], f"rank {rank}"
        for got, want in zip(res["logits"], one["logits"]):
            assert (got - want).abs().max() < 1e-4, f"rank {rank}"
        # batch buckets 1, 2 and 4 (3 pads to 4): one program each serves every length
        assert res["compiles"] == 3, f"rank {rank}: {res['compiles']} compiles"
