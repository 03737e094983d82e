"""Mixture of experts on the TSP axis (issue 27): expert parallelism, exact against one process.

Each MoE family of transformers that builds small is built with random weights from a tiny
config (hidden 64, 2 layers, 4-6 experts, top-2) and run compiled with ``backend="tsp"`` on
gloo ranks against the same model in one process without tspc: logits and every parameter's
gradient (the stacked experts' gathered by DTensor, and this rank's shard against the same rows
of the reference) equal, every layer's experts matched. Bytes: the runtime's counted
all-to-all bytes per layer equal ``moe_bytes`` of the routing counts, which the test takes from
the reference model's own router (its top-k on the tokens each rank holds).
"""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from tests.helpers import D4_EXTENDED, HF_SMALL, grad_error
from tspc.launch import spawn

# family -> config overrides (tiny experts: 4 or 6 of them, top-2)
MOE_FAMILIES: dict[str, dict] = {
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32},
    "qwen2_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 64,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "qwen3_moe": {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "head_dim": 16,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    },
    "olmoe": {"num_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32},
    "granitemoe": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32},
    "phimoe": {"num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32},
}


def build(family: str, seed: int = 0, **extra):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(family, **{**HF_SMALL, **MOE_FAMILIES[family], **extra})
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg)


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)


def zigzag_tokens(seq: int, world: int, rank: int) -> list[int]:
    """The positions rank ``rank`` holds: chunks ``rank`` and ``2D-1-rank`` of ``2D``."""
    c = seq // (2 * world)
    return list(range(rank * c, (rank + 1) * c)) + list(
        range((2 * world - 1 - rank) * c, (2 * world - rank) * c)
    )


def routing_counts(ref, ids: torch.Tensor, world: int) -> list[list[list[int]]]:
    """Per MoE layer, ``pairs_to[s][q]``: rank s's (token, choice) pairs whose expert rank q
    owns (``torch.chunk`` order of the experts), from the reference model's own router
    logits (``output_router_logits``) and top-k."""
    with torch.no_grad():
        out = ref(input_ids=ids, output_router_logits=True)
    cfg = ref.config
    k = cfg.num_experts_per_tok
    n_exp = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    c = -(-n_exp // world)
    B, S = ids.shape
    layers = []
    for logits in out.router_logits:
        chosen = logits.view(B, S, -1).topk(k, dim=-1).indices  # [B, S, k]
        pairs = []
        for s in range(world):
            mine = chosen[:, zigzag_tokens(S, world, s)].reshape(-1) // c
            pairs.append([int((mine == q).sum()) for q in range(world)])
        layers.append(pairs)
    return layers


def moe_worker(rank: int, world: int, families: list[str]) -> list[dict]:
    _quiet()
    import tspc
    from tspc.runtime.counters import COUNTER
    from tspc.runtime.moe import moe_bytes

    rows = []
    for family in families:
        torch._dynamo.reset()
        ref, model = build(family), build(family)
        ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(3))
        probe = torch.randn(2, 16, 128, generator=torch.Generator().manual_seed(4))
        expected = ref(input_ids=ids).logits
        (expected * probe).sum().backward()
        compiled = torch.compile(model, backend="tsp", fullgraph=True)
        COUNTER.reset()
        got = compiled(input_ids=ids).logits
        (got * probe).sum().backward()
        rep = tspc.last_report()
        by_tag = COUNTER.snapshot()["by_tag"]
        err, owned = grad_error(ref, model)
        mlp = [(e.module, e.status, e.reason) for e in rep.entries if e.kind == "mlp"]
        moe = [e.module for e in rep.entries if e.details.get("form") == "moe (expert parallel)"]
        counts = routing_counts(ref, ids, world)
        h = ref.config.hidden_size
        n_exp = getattr(ref.config, "num_local_experts", None) or ref.config.num_experts
        measured = [sum(k["recv_bytes"] for k in by_tag.get(m, {}).values()) for m in moe]
        predicted = [moe_bytes(c, rank, 4, h, n_exp, backward=True) for c in counts]
        rows.append(
            {
                "family": family,
                "logits": ((got - expected).abs().max() / expected.abs().max()).item(),
                "grads": err,
                "owned": {k: v for k, v in owned.items() if "experts" in k},
                "mlp": mlp,
                "moe": moe,
                "measured": measured,
                "predicted": predicted,
                "level": rep.level,
            }
        )
    return rows


def _check(rows_by_rank: list[list[dict]], world: int) -> None:
    for rows in rows_by_rank:
        for r in rows:
            f = r["family"]
            assert r["level"] == "tsp", r
            assert r["logits"] < 1e-5, (f, r["logits"])
            assert r["grads"] < 1e-4, (f, r["grads"])
            assert len(r["moe"]) == 2, (f, r["mlp"])  # both layers' experts expert-parallel
            assert all(s == "matched" for _, s, _ in r["mlp"]), (f, r["mlp"])
            assert len(r["owned"]) == 4, (f, r["owned"])  # 2 stacked weights x 2 layers
            assert r["measured"] == r["predicted"], (f, r["measured"], r["predicted"])


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, D4_EXTENDED])
def test_moe_families_equal_one_process(world):
    rows = spawn(moe_worker, world, list(MOE_FAMILIES), timeout=900)
    _check(rows, world)
