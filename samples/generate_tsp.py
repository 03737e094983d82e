"""``model.generate`` on a TSP-compiled transformers model, on D gloo processes, against one process.

    python samples/generate_tsp.py --world-size 2 --prompt 64 --new 16

Every rank builds the same small Llama (random weights), generates greedily from a batch of two
prompts (the second left-padded) once without tspc and once after transformers' idiom
``model.forward = torch.compile(model.forward, backend="tsp")``, and reports: the tokens (equal
to one process), the largest logit difference, this rank's KV cache (its own prompt tokens and
its share of the decoded ones) and the bytes it received per decoded token, measured by the
runtime's counters next to ``decode_bytes_per_token`` and the bytes of the matched weights that
TSP keeps where they lie.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from samples.cli import parser_with  # noqa: E402
from tspc.launch import spawn  # noqa: E402


def build(args: dict):
    """A small Llama (random weights, seed 0, eval mode) of ``args``' sizes; ``vocab`` and
    ``intermediate`` default to 256 and twice ``hidden`` (``bench/inference.py`` sets them)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(
        "llama",
        vocab_size=args.get("vocab", 256),
        hidden_size=args["hidden"],
        intermediate_size=args.get("intermediate", 2 * args["hidden"]),
        num_hidden_layers=args["layers"],
        num_attention_heads=args["heads"],
        num_key_value_heads=args["kv_heads"],
        max_position_embeddings=args["prompt"] + args["new"] + 8,
        pad_token_id=0,
        use_cache=True,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval()


def formula_bytes_per_token(config, world: int, batch: int, itemsize: int = 4) -> int:
    """``decode_bytes_per_token`` (``runtime/decode.py``) for a transformers config's sizes."""
    from tspc.runtime.decode import decode_bytes_per_token

    return decode_bytes_per_token(
        world=world,
        batch=batch,
        heads=config.num_attention_heads,
        kv_heads=config.num_key_value_heads,
        head_dim=config.hidden_size // config.num_attention_heads,
        hidden=config.hidden_size,
        layers=config.num_hidden_layers,
        itemsize=itemsize,
        kv_sharded=config.num_key_value_heads % world == 0,
    )


def run_rank(rank: int, world: int, args: dict) -> dict:
    from tspc.runtime.counters import COUNTER
    from tspc.runtime.tsp_params import tsp_param_of

    reference, model = build(args), build(args)
    ids = torch.randint(1, 256, (2, args["prompt"]), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0  # the second prompt is 5 tokens shorter: left padding
    kw = dict(
        attention_mask=mask,
        max_new_tokens=args["new"],
        min_new_tokens=args["new"],  # random weights: do not stop at the end-of-sequence token
        do_sample=False,
        return_dict_in_generate=True,
        output_logits=True,
    )
    with torch.no_grad():
        want = reference.generate(ids, **kw)
        model.forward = torch.compile(model.forward, backend="tsp")
        model.generate(ids, **kw)  # compiles the prompt (its K/V come back gathered, then cut)
        COUNTER.reset()
        got = model.generate(ids, **kw)  # the prompt's K/V stay sharded
    decoded = args["new"] - 1
    measured = sum(
        c["recv_bytes"]
        for tag, kinds in COUNTER.snapshot()["by_tag"].items()
        if tag.startswith("decode")
        for c in kinds.values()
    )
    formula = formula_bytes_per_token(model.config, world, batch=2)
    matched = sum(
        p.numel() * p.element_size()
        for p in model.parameters()
        if (tp := tsp_param_of(p)) is not None and tp.entry is not None
    )
    cache = got.cache
    return {
        "tokens_equal": torch.equal(got.sequences, want.sequences),
        "logit_err": max((a - b).abs().max().item() for a, b in zip(got.logits, want.logits)),
        "cache_tokens": cache.local_tokens(),
        "cache_counts": cache.layers[0].counts,
        "bytes_per_token": measured // max(decoded, 1),
        "formula": formula,
        "matched_weight_bytes": matched,
        "new_tokens": got.sequences[0, args["prompt"] :].tolist(),
    }


def main() -> int:
    ap = parser_with(
        __doc__.split("\n\n")[0], world_size=2, prompt=64, new=16, hidden=128, heads=8,
        kv_heads=4, layers=2,
    )  # fmt: skip
    args = vars(ap.parse_args())
    results = spawn(run_rank, args["world_size"], args)
    ok = True
    for rank, r in enumerate(results):
        print(
            f"rank {rank}: tokens equal one process: {r['tokens_equal']}, max |logit diff| "
            f"{r['logit_err']:.2e}; caches {r['cache_tokens']} of {sum(r['cache_counts'])} "
            f"tokens (every rank: {r['cache_counts']}); received {r['bytes_per_token']} B per "
            f"decoded token (formula {r['formula']}; matched weights {r['matched_weight_bytes']} B)"
        )
        ok &= r["tokens_equal"] and r["logit_err"] < 1e-5 and r["bytes_per_token"] == r["formula"]
    print("new tokens (sequence 0):", results[0]["new_tokens"])
    print("OK: generate() equals one process" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
