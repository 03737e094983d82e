"""Tests for `tspc plan`: the analytic planner reproduces the paper's 7B figures."""

from __future__ import annotations

import json
import re

import pytest

from tspc.tools.plan import (
    GB,
    PRESETS,
    ModelShape,
    PlanInputs,
    crossover,
    layer_comm,
    main,
    make_plan,
    parse_tokens,
)

SEVEN_B = PRESETS["7b"]


def total_gb(model: ModelShape, devices: int, seq_len: int, scheme: str) -> float:
    plan = make_plan(model, PlanInputs(devices=devices, seq_len=seq_len))
    return plan.scheme(scheme).memory.total / GB


@pytest.mark.parametrize(
    ("seq_len", "tsp_gb", "tp_gb"),
    [(128 * 1024, 38.8, 70.0), (16 * 1024, 31.0, 31.5)],
)
def test_7b_reported_memory_on_8_devices(seq_len: int, tsp_gb: float, tp_gb: float) -> None:
    assert total_gb(SEVEN_B, 8, seq_len, "TSP(D=8)") == pytest.approx(tsp_gb, abs=1.0)
    assert total_gb(SEVEN_B, 8, seq_len, "TP(T=8)") == pytest.approx(tp_gb, abs=1.0)


def test_7b_breakdown_at_128k_matches_paper_notes() -> None:
    # PAPER_NOTES.md's breakdown of 38.9 GB (the overhead c0 = 8.54 GB is a constant fitted to
    # the paper's points, so it is not checked here: test_7b_reported_memory_on_8_devices
    # checks what the fit must reproduce)
    memory = make_plan(SEVEN_B, PlanInputs(devices=8, seq_len=131072)).scheme("TSP(D=8)").memory
    assert memory.model_state / GB == pytest.approx(21.37, abs=0.01)
    assert memory.stored_activations / GB == pytest.approx(4.29, abs=0.01)
    assert memory.working_set / GB == pytest.approx(3.36, abs=0.01)
    assert memory.kv_gathered / GB == pytest.approx(0.27, abs=0.01)
    assert memory.logits / GB == pytest.approx(1.05, abs=0.01)


@pytest.mark.parametrize(
    ("devices", "reported_gb"), [(1, 219.8), (2, 117.3), (4, 65.0), (8, 38.9), (16, 25.8)]
)
def test_7b_tsp_memory_across_devices_at_128k(devices: int, reported_gb: float) -> None:
    assert total_gb(SEVEN_B, devices, 131072, f"TSP(D={devices})") == pytest.approx(
        reported_gb, abs=1.0
    )


def test_cli_preset_output_reports_the_figures(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--preset", "7b", "--devices", "8", "--seq", "128K"]) == 0
    out = capsys.readouterr().out
    for scheme, reported in (("TSP(D=8)", 38.8), ("TP(T=8)", 70.0)):
        found = re.search(
            rf"{re.escape(scheme)}: reported {reported} GB, modelled ([0-9.]+) GB", out
        )
        assert found and abs(float(found.group(1)) - reported) <= 1.0, (scheme, out)
    assert "Assumptions" in out and "c0 = 8.54 GB" in out and "kappa = 16" in out
    assert "32,768 tokens = 8.00h" in out


def test_crossover_is_8h_for_the_7b() -> None:
    cross = crossover(SEVEN_B, PlanInputs(devices=8, seq_len=131072))
    assert cross.tokens == 8 * 4096 == 32768
    assert cross.tsp_moves_fewer_bytes
    # TSP/TP forward = 1/2 + 4h/(B*S) for MHA with F = 4.
    assert cross.tsp_over_tp_forward == pytest.approx(0.5 + 4 * 4096 / 131072)
    assert not crossover(SEVEN_B, PlanInputs(devices=8, seq_len=16384)).tsp_moves_fewer_bytes


def test_tsp_comm_formula_for_gqa() -> None:
    gqa = ModelShape(
        hidden=2048, layers=4, heads=16, kv_heads=4, intermediate=5632, vocab=1000, name="gqa"
    )
    inputs = PlanInputs(devices=4, seq_len=8192, micro_batch=2)
    h, h_kv, beta, d, bs = 2048, 2048 * 4 // 16, 2, 4, 2 * 8192
    p_attn = 2 * h * h + 2 * h * h_kv
    p_mlp = 3 * h * 5632
    expected = (d - 1) / d * beta * (p_attn + p_mlp + 2 * bs * h_kv)
    assert layer_comm(gqa, inputs, "TSP", d, d).forward == pytest.approx(expected)
    tp = layer_comm(gqa, inputs, "TP", d, 1).forward
    assert tp == pytest.approx(4 * (d - 1) / d * bs * h * beta)
    assert crossover(gqa, inputs).tokens == pytest.approx((p_attn + p_mlp) / (4 * h - 2 * h_kv))


def test_a_plain_mlp_counts_two_matrices() -> None:
    """GPT-NeoX / GPT-2 MLPs are down(act(up(x))): P_mlp = 2*h*I, and the ring moves that."""
    cfg = {
        "model_type": "gpt_neox", "hidden_size": 64, "num_attention_heads": 4,
        "num_hidden_layers": 2, "intermediate_size": 256, "vocab_size": 128,
    }  # fmt: skip
    neox = ModelShape.from_hf_config(cfg)
    assert not neox.gated_mlp and neox.mlp_params == 2 * 64 * 256
    llama = ModelShape.from_hf_config({**cfg, "model_type": "llama"})
    assert llama.gated_mlp and llama.mlp_params == 3 * 64 * 256
    gpt2 = ModelShape.from_hf_config(
        {"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": 128}
    )
    assert not gpt2.gated_mlp and gpt2.mlp_params == 2 * 64 * 4 * 64


# What transformers 5.24 `LlamaConfig(...).to_json_file` writes (pure JSON keeps this test fast).
LLAMA_CONFIG_JSON = """{
  "attention_bias": false, "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
  "head_dim": 64, "hidden_act": "silu", "hidden_size": 1024, "initializer_range": 0.02,
  "intermediate_size": 2816, "max_position_embeddings": 2048, "mlp_bias": false,
  "model_type": "llama", "num_attention_heads": 16, "num_hidden_layers": 6,
  "num_key_value_heads": 4, "pad_token_id": null, "pretraining_tp": 1, "rms_norm_eps": 1e-06,
  "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
  "tie_word_embeddings": true, "transformers_version": "5.24.0", "use_cache": true,
  "vocab_size": 5000
}"""
# The keys it was written from (the rest are transformers' defaults).
LLAMA_SIZE_KEYS = (
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
    "tie_word_embeddings",
)


def _check_llama_shape(model: ModelShape) -> None:
    assert (model.hidden, model.layers, model.heads, model.kv_heads) == (1024, 6, 16, 4)
    assert (model.intermediate, model.vocab, model.tied_embeddings) == (2816, 5000, True)
    assert model.kv_width == 256
    assert model.embedding_params == 5000 * 1024
    assert model.attn_params == 2 * 1024 * 1024 + 2 * 1024 * 256


def test_reads_a_llama_config_json(tmp_path) -> None:
    path = tmp_path / "config.json"
    path.write_text(LLAMA_CONFIG_JSON)
    for source in (path, tmp_path, json.loads(LLAMA_CONFIG_JSON)):  # file, directory, dict
        _check_llama_shape(ModelShape.from_hf_config(source))


@pytest.mark.slow  # importing transformers takes seconds
def test_reads_a_transformers_llama_config(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    # the sizes of LLAMA_CONFIG_JSON; the installed transformers writes the rest
    written = json.loads(LLAMA_CONFIG_JSON)
    sizes = {k: written[k] for k in LLAMA_SIZE_KEYS}
    transformers.LlamaConfig(**sizes).to_json_file(str(path))
    _check_llama_shape(ModelShape.from_hf_config(path))


def test_config_defaults_for_missing_optional_keys() -> None:
    model = ModelShape.from_hf_config(
        {"hidden_size": 512, "num_hidden_layers": 2, "num_attention_heads": 8, "vocab_size": 100}
    )
    assert model.kv_heads == 8 and model.intermediate == 4 * 512 and not model.tied_embeddings
    with pytest.raises(ValueError, match="hidden_size"):
        ModelShape.from_hf_config({"num_hidden_layers": 2})


def test_json_output_has_every_scheme(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--preset", "7b", "-D", "8", "--seq", "131072", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["schemes"]) == {
        "DP",
        "TP(T=8)",
        "SP(Σ=8)",
        "TP+SP(T=2,Σ=4)",
        "TP+SP(T=4,Σ=2)",
        "TSP(D=8)",
    }
    tsp = data["schemes"]["TSP(D=8)"]
    assert tsp["memory_gb"]["total"] == pytest.approx(38.8, abs=1.0)
    assert tsp["comm_bytes_per_layer"]["forward"] > 0
    assert data["crossover"]["tokens"] == 32768
    assert data["assumptions"]


def test_json_with_a_config_file(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "hidden_size": 256,
                "num_hidden_layers": 2,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "intermediate_size": 688,
                "vocab_size": 1000,
            }
        )
    )
    assert main(["--config", str(path), "-D", "4", "--seq", "4K", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data["schemes"]) == {"DP", "TP(T=4)", "SP(Σ=4)", "TP+SP(T=2,Σ=2)", "TSP(D=4)"}
    assert data["reported"] == []  # not the paper's setting


@pytest.mark.parametrize(("text", "tokens"), [("16K", 16384), ("128k", 131072), ("4096", 4096)])
def test_parse_tokens(text: str, tokens: int) -> None:
    assert parse_tokens(text) == tokens


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--preset", "7b", "--devices", "0", "--seq", "128K"], "must be a positive integer"),
        (["--preset", "13b", "--devices", "8", "--seq", "128K"], "invalid choice: '13b'"),
        (["--preset", "7b", "--devices", "8", "--seq", "1000"], "not divisible by 2*D = 16"),
        (["--preset", "7b", "--devices", "8", "--seq", "12Q"], "is not a token count"),
        (["--preset", "7b", "--devices", "8", "--seq", "128K", "--dtype", "fp8"], "fp8"),
        (["--devices", "8", "--seq", "128K"], "one of the arguments --preset --config"),
        (["--config", "/nonexistent/config.json", "-D", "8", "--seq", "1K"], "not found"),
    ],
)
def test_bad_input_is_a_clear_error(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_bad_plan_inputs_raise_value_error() -> None:
    with pytest.raises(ValueError, match="devices"):
        PlanInputs(devices=0, seq_len=1024)
    with pytest.raises(ValueError, match="recompute"):
        PlanInputs(devices=2, seq_len=1024, recompute="partial")
    with pytest.raises(ValueError, match="KV heads"):
        ModelShape(hidden=64, layers=1, heads=4, kv_heads=3, intermediate=128, vocab=10)


def test_recompute_none_stores_every_layer() -> None:
    full = make_plan(SEVEN_B, PlanInputs(devices=8, seq_len=16384)).scheme("TSP(D=8)").memory
    none = (
        make_plan(SEVEN_B, PlanInputs(devices=8, seq_len=16384, recompute="none"))
        .scheme("TSP(D=8)")
        .memory
    )
    assert none.working_set == 0
    assert none.stored_activations == pytest.approx(32 * full.working_set)
    assert none.total > full.total


def test_prime_device_count_has_no_tp_sp_factorization(capsys) -> None:
    assert main(["--preset", "7b", "-D", "7", "--seq", "14K"]) == 0
    out = capsys.readouterr().out
    assert "No TP+SP factorization T x Σ = 7" in out
    assert "not divisible by D = 7" in out  # 32 heads over 7 ranks


# --------------------------------------------------------------------------------------------
# MoE presets (issue 27): checked against transformers' own models, built on the meta device
# --------------------------------------------------------------------------------------------


def _meta_model(family: str, **overrides):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(family, **overrides)
    with torch.device("meta"):
        return cfg, AutoModelForCausalLM.from_config(cfg)


# the published configs: Mixtral-8x7B = MixtralConfig()'s defaults; Qwen3-30B-A3B = the
# Qwen3MoeConfig defaults but 48 layers and head_dim 128 (its config.json)
MOE_PRESETS = {
    "mixtral-8x7b": ("mixtral", {}),
    "qwen3-30b-a3b": (
        "qwen3_moe",
        {"num_hidden_layers": 48, "head_dim": 128, "norm_topk_prob": True},
    ),
}


@pytest.mark.parametrize("preset", sorted(MOE_PRESETS))
def test_moe_preset_parameters_equal_transformers(preset: str) -> None:
    family, overrides = MOE_PRESETS[preset]
    cfg, model = _meta_model(family, **overrides)
    shape = PRESETS[preset]
    params = dict(model.named_parameters())
    assert shape.total_params == sum(p.numel() for p in params.values())
    experts = sum(p.numel() for n, p in params.items() if ".experts." in n)
    assert shape.layers * shape.expert_params == experts
    # the config.json route reads the same shape
    read = ModelShape.from_hf_config(cfg.to_dict(), name=preset)
    assert read == shape


@pytest.mark.parametrize(("preset", "devices"), [("mixtral-8x7b", 8), ("qwen3-30b-a3b", 8)])
def test_moe_tsp_model_state_is_the_per_rank_share_of_each_parameter(preset, devices) -> None:
    """Per rank under TSP: the stacked experts' torch.chunk share, the attention projections
    1/D, everything else (router, norms, embeddings) whole — counted from the meta model's
    parameters by name, against the planner's model-state term."""
    import torch

    family, overrides = MOE_PRESETS[preset]
    _, model = _meta_model(family, **overrides)
    per_rank = 0.0
    for name, p in model.named_parameters():
        if ".experts." in name:
            per_rank += torch.chunk(p, devices, dim=0)[0].numel()
        elif re.search(r"self_attn\.[qkvo]_proj\.weight$", name):
            per_rank += p.numel() / devices
        else:
            per_rank += p.numel()
    inputs = PlanInputs(devices=devices, seq_len=32 * 1024)
    tsp = make_plan(PRESETS[preset], inputs).scheme(f"TSP(D={devices})")
    assert tsp.memory.model_state == pytest.approx(inputs.kappa * per_rank, rel=1e-12)


def test_moe_tsp_all_to_all_bytes_equal_the_runtime_formula_at_balanced_routing() -> None:
    from tspc.runtime.moe import moe_bytes
    from tspc.tools.plan_moe import tsp_all_to_all_bytes

    shape = PRESETS["mixtral-8x7b"]
    d, seq = 8, 32 * 1024
    inputs = PlanInputs(devices=d, seq_len=seq)
    pairs = shape.experts_per_token * seq // d  # each rank's (token, choice) pairs
    balanced = [[pairs // d] * d for _ in range(d)]
    kwargs = dict(elem=2, hidden=shape.hidden, experts=shape.experts)
    fwd = moe_bytes(balanced, 0, backward=False, **kwargs)
    both = moe_bytes(balanced, 0, backward=True, **kwargs)
    assert tsp_all_to_all_bytes(shape, inputs, backward=False) == fwd
    assert tsp_all_to_all_bytes(shape, inputs, backward=True) == both - fwd


def test_moe_plan_has_tp_ep_and_tsp_experts_split_by_expert(capsys) -> None:
    assert main(["--preset", "mixtral-8x7b", "-D", "8", "--seq", "32K"]) == 0
    out = capsys.readouterr().out
    assert "TP+EP(T=8)" in out and "MoE: 8 experts top-2" in out
    plan = make_plan(PRESETS["mixtral-8x7b"], PlanInputs(devices=8, seq_len=32 * 1024))
    tsp, tp_ep = plan.scheme("TSP(D=8)"), plan.scheme("TP+EP(T=8)")
    tp_sp = plan.scheme("TP+SP(T=4,Σ=2)")
    # TSP holds 1/8 of the experts; TP+SP(T=4) holds 1/4 of each: about twice TSP's state
    assert tp_sp.memory.model_state / tsp.memory.model_state == pytest.approx(1.92, abs=0.05)
    # TSP and TP+EP hold the same experts; TP+EP splits the embeddings, TSP does not
    assert tsp.memory.model_state > tp_ep.memory.model_state
    # TSP's ring streams the attention only: the experts never move
    assert tsp.comm.forward < plan.scheme("TP(T=8)").comm.forward


def test_moe_uneven_and_empty_expert_ranks_are_noted(capsys) -> None:
    shape = ModelShape(
        hidden=64, layers=2, heads=4, kv_heads=4, intermediate=64, vocab=128,
        experts=6, experts_per_token=2, expert_intermediate=32, family="mixtral",
    )  # fmt: skip
    notes = make_plan(shape, PlanInputs(devices=4, seq_len=64)).scheme("TSP(D=4)").notes
    assert any("a rank would own none" in n for n in notes)
    notes = make_plan(shape, PlanInputs(devices=4, seq_len=64)).scheme("TP+EP(T=4)").notes
    assert any("own none" in n for n in notes)
    five = ModelShape(**{**shape.__dict__, "experts": 5})
    notes = make_plan(five, PlanInputs(devices=2, seq_len=64)).scheme("TSP(D=2)").notes
    assert any("not divisible by 2: 3 on the first ranks" in n for n in notes)


def test_moe_config_with_dense_layers_is_refused_with_the_reason() -> None:
    config = {
        "model_type": "qwen2_moe", "hidden_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "vocab_size": 128, "num_experts": 4,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "mlp_only_layers": [0],
    }  # fmt: skip
    with pytest.raises(ValueError, match="mixes dense and MoE layers"):
        ModelShape.from_hf_config(config)
    config["mlp_only_layers"] = []
    config["shared_expert_intermediate_size"] = 64
    with pytest.raises(ValueError, match="shared experts"):
        ModelShape.from_hf_config(config)
