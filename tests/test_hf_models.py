"""Unmodified Hugging Face models (random weights, small configs) on gloo, against one process.

For each family: the logits at every real (non-padding) position and the loss with labels equal
the single-process model's; the report lists every decoder layer's attention and MLP as matched
(gated or not: GPT-NeoX's GELU MLP and GPT-2's Conv1D MLP run the ring too); explicit masks are
recognised; and the bytes the runtime counted equal the schedule's prediction.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import D4_EXTENDED, HF_SMALL, train_step_against_one_process
from tspc.launch import spawn

SMALL = HF_SMALL

FAMILIES = {
    # family: (config overrides, attention matched?)
    "llama": ({}, True),
    "mistral": ({}, True),
    "qwen2": ({}, True),  # q/k/v biases
    "phi3": ({}, True),  # fused qkv_proj and gate_up_proj
    "gemma": ({"head_dim": 16}, True),  # scaled embeddings, GELU-tanh, tied embeddings
    "qwen3": ({"head_dim": 16}, True),  # q/k RMSNorm inside attention
    "gpt_neox": ({"rotary_pct": 0.5}, True),  # interleaved fused qkv, partial rotary, GELU MLP
    # Conv1D (addmm) projections: fused c_attn [h, 3h] split along its last dim, biases,
    # hand-written tanh GELU
    "gpt2": ({"n_inner": 128, "bos_token_id": 1, "eos_token_id": 2}, True),
    # RoPE by rotate-every-two (stack + flatten), partial rotary, parallel attention + MLP
    "gptj": ({"rotary_dim": 8, "n_inner": 128, "bos_token_id": 1, "eos_token_id": 2}, True),
    # the same, with q/v/k fused in mp_num = 4 blocks of the qkv projection
    "codegen": ({"rotary_dim": 8, "n_inner": 128, "bos_token_id": 1, "eos_token_id": 2}, True),
    # rotate-every-two RoPE, parallel attention + MLP, LayerNorm without bias
    "cohere": ({"bos_token_id": 1, "eos_token_id": 2}, True),
    # x @ W.T projections, fused qkv grouped per KV head (q heads, k, v), K/V expanded with
    # broadcast_to before RoPE, parallel attention + MLP
    "falcon": (
        {
            "new_decoder_architecture": True,
            "num_attention_heads": 8,
            "num_kv_heads": 4,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
        True,
    ),
    # separate q/k/v with biases, partial rotary, parallel attention + MLP
    "phi": ({"bos_token_id": 1, "eos_token_id": 2}, True),
    # q/k RMSNorm over all heads' features: two sweeps over the head groups
    "olmo2": ({"bos_token_id": 1, "eos_token_id": 2}, True),
    # Falcon's older multi-query layout: q heads, one k and one v head in one x @ W.T weight,
    # the single K/V head broadcast by SDPA itself (held whole on every rank)
    "falcon:mq": (
        {
            "new_decoder_architecture": False,
            "multi_query": True,
            "parallel_attn": True,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
        True,
    ),
    # mixture of experts: attention matched, the MoE MLPs skipped with the reason
    "mixtral": ({"num_local_experts": 4, "num_experts_per_tok": 2}, True),
}
MOE = {"mixtral"}


def hf_worker(rank: int, world: int, cases: list[tuple]) -> list[dict]:
    from transformers import AutoConfig, AutoModelForCausalLM

    import tspc
    from tspc.runtime.counters import COUNTER

    out = []
    for family, attn, padding in cases:
        torch.compiler.reset()
        overrides, _ = FAMILIES[family]
        cfg = AutoConfig.for_model(family.split(":")[0], **{**SMALL, **overrides})
        cfg._attn_implementation = attn
        torch.manual_seed(0)
        ref = AutoModelForCausalLM.from_config(cfg).eval()
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).eval()
        if getattr(model, "loss_type", None) is None:  # GPT2LMHeadModel: the loss would warn,
            model.loss_type = "ForCausalLM"  # which breaks fullgraph
        b, s = 2, 16
        torch.manual_seed(3)
        ids = torch.randint(1, 128, (b, s))
        mask = torch.ones(b, s, dtype=torch.long)
        if padding == "left":
            mask[0, :5] = 0
        elif padding == "right":
            mask[1, -4:] = 0
        labels = ids.masked_fill(mask == 0, -100)
        kwargs = {"input_ids": ids, "labels": labels}
        if padding != "none":
            kwargs["attention_mask"] = mask
        with torch.no_grad():
            expected = ref(**kwargs)
            compiled = torch.compile(model, backend="tsp", fullgraph=True)
            COUNTER.reset()
            got = compiled(**kwargs)
        valid = mask.bool()
        scale = expected.logits[valid].abs().max()
        rep = tspc.last_report()
        measured = {
            t: sum(k["recv_bytes"] for k in v.values())
            for t, v in COUNTER.snapshot()["by_tag"].items()
        }
        out.append(
            {
                "case": (family, attn, padding),
                "logits_err": (
                    (got.logits[valid] - expected.logits[valid]).abs().max() / scale
                ).item(),
                "loss_err": abs(got.loss.item() - expected.loss.item()),
                "entries": [(e.kind, e.module, e.status, e.reason) for e in rep.entries],
                "masks": [(m["recognised"], m["detail"]) for m in rep.masks],
                "level": rep.level,
                "fallbacks": rep.fallbacks,
                "measured": {k: v for k, v in measured.items() if k in rep.predicted_recv_bytes},
                "predicted": dict(rep.predicted_recv_bytes),
            }
        )
    return out


def _check(results, world):
    for per_rank in results:
        for r in per_rank:
            family = r["case"][0]
            attention_matched = FAMILIES[family][1]
            assert r["level"] == "tsp" and not r["fallbacks"], r
            assert r["logits_err"] < 1e-5, r
            assert r["loss_err"] < 1e-5, r
            attn = [e for e in r["entries"] if e[0] == "attention"]
            mlp = [e for e in r["entries"] if e[0] == "mlp"]
            assert len(attn) == 2, r["entries"]
            assert all((e[2] == "matched") == attention_matched for e in attn), r["entries"]
            if family in MOE:
                assert len(mlp) == 2, r["entries"]
                assert all(e[2] == "skipped" and "mixture of experts" in e[3] for e in mlp), mlp
            else:
                assert len(mlp) == 2 and all(e[2] == "matched" for e in mlp), r["entries"]
            # the in-graph mask was understood: no S x S mask on the TSP path (eager attention's
            # additive mask with left padding too: its rows that see no key are computed on
            # their own, tests/test_trust_masks.py)
            assert r["masks"], r
            for recognised, detail in r["masks"]:
                assert recognised, detail
            if world > 1:
                assert r["measured"] == r["predicted"], r


CASES_LLAMA = [
    ("llama", "sdpa", "none"),
    ("llama", "sdpa", "left"),
    ("llama", "eager", "right"),
    ("mistral", "sdpa", "left"),
    ("mistral", "eager", "none"),
]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, D4_EXTENDED])
def test_llama_and_mistral_match_one_process(world):
    _check(spawn(hf_worker, world, CASES_LLAMA, timeout=900), world)


# Qwen2, Phi-3, Gemma, Qwen3, GPT-NeoX, GPT-2, Cohere, Phi, OLMo-2, Mixtral and Falcon's
# multi-query default run in the zoo (tests/test_zoo.py); here the forms the zoo's configs do not
# reach: rotate-every-two with rotary_dim, CodeGen's mp_num blocks, Falcon's grouped layout.
CASES_PROJECTIONS = [
    ("gptj", "sdpa", "none"),
    ("codegen", "eager", "right"),
    ("falcon", "sdpa", "left"),
    ("gpt_neox", "eager", "none"),  # parallel residual (the default)
]
# D = 4: the layouts whose cut depends on D (mp_num blocks, KV groups)
CASES_PROJECTIONS_D4 = [
    ("codegen", "sdpa", "left"),
    ("falcon", "eager", "none"),
]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, D4_EXTENDED])
def test_attention_projection_forms_match_one_process(world):
    """Conv1D, fused, grouped and interleaved QKV layouts, rotate-every-two RoPE, cross-head
    q/k norms and parallel attention + MLP blocks: every attention and MLP matched (MoE MLPs
    skipped with the reason), outputs equal one process and bytes as predicted."""
    cases = CASES_PROJECTIONS if world == 2 else CASES_PROJECTIONS_D4
    _check(spawn(hf_worker, world, cases, timeout=900), world)


def hf_train_worker(rank: int, world: int, attn: str, family: str = "llama") -> dict:
    """A family with labels and left padding: gradients of every parameter against one
    process; then the state dict (full values of every DTensor) and one optimizer step."""
    from torch.distributed.tensor import DTensor
    from transformers import AutoConfig, AutoModelForCausalLM

    import tspc

    overrides = FAMILIES[family][0] if family != "llama" else {}
    no_dropout = {k: 0.0 for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
    cfg = AutoConfig.for_model(family, **{**SMALL, **overrides, **no_dropout})
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    ref = AutoModelForCausalLM.from_config(cfg).train()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).train()
    for m in (ref, model):
        if getattr(m, "loss_type", None) is None:  # GPT2LMHeadModel: see hf_worker
            m.loss_type = "ForCausalLM"
    b, s = 2, 16
    ids = torch.randint(1, 128, (b, s), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(b, s, dtype=torch.long)
    mask[0, :5] = 0
    # the first real token is predicted from a padding position: a query row that sees no key
    labels = ids.masked_fill(mask == 0, -100)
    kwargs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    loss_ref, loss, err, _ = train_step_against_one_process(ref, model, kwargs)
    placements = {
        n: (
            type(p.placements[0]).__name__,
            getattr(p.placements[0], "dim", None),
            getattr(p.placements[0], "split_factor", None),
        )
        for n, p in model.named_parameters()
        if isinstance(p, DTensor)
    }
    sd, sd_ref = model.state_dict(), ref.state_dict()
    state_err = max(
        (v.full_tensor() if isinstance(v, DTensor) else v).sub(sd_ref[k]).abs().max().item()
        for k, v in sd.items()
    )
    step_err = 0.0
    if family != "llama":
        # SGD: the step is linear in the gradient, so it shows the gradient's error only
        opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, model)]
        for o in opts:
            o.step()
        for p_ref, p in zip(ref.parameters(), model.parameters()):
            full = p.full_tensor() if isinstance(p, DTensor) else p
            step_err = max(step_err, (full - p_ref).abs().max().item())
    return {
        "loss_err": abs(loss.item() - loss_ref.item()),
        "grad_err": err,
        "matched": len(tspc.last_report().matched),
        "placements": placements,
        "state_err": state_err,
        "step_err": step_err,
    }


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, D4_EXTENDED])
def test_llama_gradients_with_labels_and_padding_match_one_process(world):
    # eager attention (canonicalised to SDPA) at D = 2; the zoo runs eager forwards at D = 2, 4
    for attn in ("sdpa", "eager") if world == 2 else ("sdpa",):
        for r in spawn(hf_train_worker, world, attn, timeout=900):
            assert r["matched"] == 4, r
            assert r["loss_err"] < 1e-5 and r["grad_err"] < 1e-5, r


def hf_train_families(rank: int, world: int, families: list[str]) -> list[dict]:
    out = []
    for family in families:
        torch.compiler.reset()
        out.append(hf_train_worker(rank, world, "sdpa", family))
    return out


@pytest.mark.slow
def test_gpt2_conv1d_and_olmo2_training_step_matches_one_process():
    """GPT-2's fused Conv1D c_attn ([h, 3h], q/k/v side by side in its columns) is held as
    ``_StridedShard(1, 3)``: this rank's columns of each of q, k and v; c_proj ([h, h], heads'
    features in its rows) as ``Shard(0)``. OLMo-2 (q/k norms over all heads) runs its two
    sweeps backward too. Gradients, the state dict and an SGD step equal one process."""
    per_rank = spawn(hf_train_families, 2, ["gpt2", "olmo2"], timeout=600)
    for gpt2, olmo2 in per_rank:
        assert olmo2["matched"] == 4, olmo2
        assert olmo2["loss_err"] < 1e-5 and olmo2["grad_err"] < 1e-5, olmo2
        assert olmo2["state_err"] == 0.0 and olmo2["step_err"] < 1e-6, olmo2
        r = gpt2
        assert r["matched"] == 4, r
        assert r["loss_err"] < 1e-5 and r["grad_err"] < 1e-5, r
        assert r["state_err"] == 0.0 and r["step_err"] < 1e-6, r
        pl = r["placements"]
        for layer in (0, 1):
            h = f"transformer.h.{layer}"
            assert pl[f"{h}.attn.c_attn.weight"] == ("_StridedShard", 1, 3), pl
            assert pl[f"{h}.attn.c_attn.bias"] == ("_StridedShard", 0, 3), pl
            assert pl[f"{h}.attn.c_proj.weight"] == ("Shard", 0, None), pl
            assert pl[f"{h}.attn.c_proj.bias"] == ("Replicate", None, None), pl


def test_strict_turns_a_skip_into_an_error_naming_the_module(fake_group):
    from tests.mlp_forms import model_with

    fake_group(0, 2)
    model = model_with("cumsum")  # an MLP with a cumsum between its projections
    compiled = torch.compile(model, backend="tsp", options={"strict": True})
    with pytest.raises(Exception, match=r"layers\.0\.mlp: cumsum between up and down"):
        compiled(torch.randint(1, 128, (1, 16)))


def break_worker(rank: int, world: int) -> dict:
    """A graph break inside the layer loop: Dynamo then compiles the block's forward as a frame
    of its own and reuses that one compiled graph for every layer. Each layer must still run
    with its own shards (the graph reads them from inputs, not constants)."""
    import tspc
    from samples.reference_model import RefModel, build_reference_model

    class Broken(RefModel):
        def forward(self, input_ids, position_ids=None):
            b, s = input_ids.shape
            x = self.embed(input_ids)
            pos = torch.arange(s).unsqueeze(0)
            freqs = pos[..., None].float() * self.inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
            for i, layer in enumerate(self.layers):
                x = layer(x, cos, sin, None)
                if i == 0:
                    torch._dynamo.graph_break()
            return self.lm_head(self.norm(x))

    ref = build_reference_model(seed=0, num_layers=2)
    model = Broken(ref.cfg)
    model.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    n0 = len(tspc.report.REPORTS)
    with torch.no_grad():
        # kept: the weights' TSPParams live as long as the module that runs them (here the
        # compiled module, ``runtime/tsp_params.py``); a temporary one takes them with it
        compiled = torch.compile(model, backend="tsp")
        got = compiled(ids)
        want = ref(ids)
    from tspc.runtime.tsp_params import tsp_param_of

    reports = tspc.report.REPORTS[n0:]
    return {
        "err": ((got - want).abs().max() / want.abs().max()).item(),
        "graphs": [sorted(e.module for e in r.matched) for r in reports],
        "sharded": sorted(
            n for n, p in model.named_parameters() if (tp := tsp_param_of(p)) and tp.sharded
        ),
    }


@pytest.mark.slow
def test_graph_breaks_are_compiled_and_reported_per_graph():
    for r in spawn(break_worker, 2, timeout=600):
        assert r["err"] < 1e-5, r
        assert ["attn", "mlp"] in r["graphs"], r  # the block's own graph, matched
        for layer in (0, 1):  # ... run by both layers, each with its own shards
            for w in ("attn.q_proj", "attn.o_proj", "mlp.gate_proj", "mlp.down_proj"):
                assert f"layers.{layer}.{w}.weight" in r["sharded"], (layer, w, r["sharded"])
