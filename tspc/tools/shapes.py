"""Model and cluster shapes for `tspc plan`: :class:`ModelShape` (read from a transformers
config or a preset), :class:`PlanInputs` (the cluster shape and the memory model's assumptions)
and the units. Plain arithmetic, no torch: every tool below the CLI (the memory model, the
fake-tensor measurement, the time model) starts from these.

Units: GB = 1e9 bytes and MB = 1e6 bytes (the paper's figures reproduce in 1e9; in GiB the
model-state term alone would be 19.9 instead of 21.37).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GB = 1e9
MB = 1e6
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
RECOMPUTE_POLICIES = ("full", "selective", "none")
EMBEDDING_PLACEMENTS = ("replicated", "sharded")

# The paper-matching assumption set (PAPER_NOTES.md, "Memory model"). kappa is derived (the
# bytes of bf16 weights and grads plus fp32 master weights and Adam moments); c0 and a_rep are
# FITTED: chosen so that the model lands within 0.2 GB of the paper's four reported 7B, D = 8
# points (TSP 31.0 / 38.8 GB and TP 31.5 / 70.0 GB at 16K / 128K tokens). They are not derived
# from tspc's graph; ``tspc plan --measure`` prints what the measured graph says instead.
DEFAULT_KAPPA = 16.0  # bytes/param: bf16 weights + bf16 grads + fp32 master, Adam m and v
DEFAULT_OVERHEAD_GB = 8.54  # c0 (fitted): runtime, allocator slack, communication buffers
DEFAULT_A_REP_PER_H = 5.0  # a_rep (fitted): replicated activations per token per layer / h
FITTED_TO = "fitted to the paper's 7B D=8 points: TSP 31.0/38.8 GB, TP 31.5/70.0 GB at 16K/128K"


# --------------------------------------------------------------------------------------------
# Model shape
# --------------------------------------------------------------------------------------------


def _first_key(config: Mapping[str, Any], *keys: str) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    return None


# transformers model types whose MLP is plain, down(act(up(x))): a config does not say it
PLAIN_MLP_MODEL_TYPES = frozenset(
    {
        "gpt2",
        "gpt_neox",
        "gpt_neo",
        "gptj",
        "gpt_bigcode",
        "opt",
        "bloom",
        "falcon",
        "phi",
        "codegen",
        "starcoder2",
        "mpt",
    }
)


@dataclass(frozen=True)
class ModelShape:
    """The shape of a decoder-only transformer: gated (3-matrix) MLPs, or plain (2-matrix: up,
    down) ones with ``gated_mlp=False`` (GPT-2, GPT-NeoX). ``experts > 0`` makes every layer's
    MLP a mixture of experts: a router ``[E, h]`` and ``experts`` gated experts of width
    ``expert_intermediate``, ``experts_per_token`` (k) of them run per token; ``intermediate``
    is then unused. ``family`` is the transformers ``model_type`` that ``--measure`` builds for
    a MoE shape (``mixtral``, ``qwen3_moe``)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied_embeddings: bool = False
    head_dim: int | None = None  # None: hidden // heads
    name: str = "model"
    gated_mlp: bool = True
    experts: int = 0  # 0: a dense MLP
    experts_per_token: int = 0
    expert_intermediate: int = 0
    family: str | None = None

    def __post_init__(self) -> None:
        for key in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model {key} must be a positive integer, got {value!r}")
        if self.experts:
            for key in ("experts", "experts_per_token", "expert_intermediate"):
                value = getattr(self, key)
                if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                    raise ValueError(f"MoE model {key} must be a positive integer, got {value!r}")
            if self.experts_per_token > self.experts:
                raise ValueError(
                    f"{self.experts_per_token} experts per token but only {self.experts} experts"
                )
            if not self.gated_mlp:
                raise ValueError("MoE experts are modelled as gated (3-matrix) MLPs")
        if self.head_dim is None and self.hidden % self.heads:
            raise ValueError(
                f"hidden size {self.hidden} is not divisible by {self.heads} heads "
                "(give head_dim explicitly)"
            )
        if self.heads % self.kv_heads:
            raise ValueError(
                f"{self.heads} attention heads are not a multiple of {self.kv_heads} KV heads"
            )

    @classmethod
    def from_hf_config(
        cls, source: Mapping[str, Any] | str | Path, name: str | None = None
    ) -> ModelShape:
        """Read a transformers ``config.json`` (a dict, a file, or a directory holding one).

        Missing optional keys: ``num_key_value_heads`` defaults to the head count (MHA),
        ``intermediate_size`` to 4h, ``tie_word_embeddings`` to False (untied is the larger,
        conservative estimate), ``head_dim`` to hidden // heads. Multimodal configs that nest
        the language model under ``text_config`` are read from there.
        """
        if isinstance(source, Mapping):
            config = dict(source)
            default_name = str(config.get("_name_or_path") or config.get("model_type") or "model")
        else:
            path = Path(source)
            if path.is_dir():
                path = path / "config.json"
            try:
                config = json.loads(path.read_text())
            except FileNotFoundError:
                raise ValueError(f"config file not found: {path}") from None
            except json.JSONDecodeError as err:
                raise ValueError(f"config file {path} is not valid JSON: {err}") from None
            if not isinstance(config, dict):
                raise ValueError(f"config file {path} does not hold a JSON object")
            default_name = path.parent.name if path.name == "config.json" else path.stem
        if _first_key(config, "hidden_size", "n_embd", "d_model") is None and isinstance(
            config.get("text_config"), Mapping
        ):
            config = dict(config["text_config"])

        def required(*keys: str) -> int:
            value = _first_key(config, *keys)
            if value is None:
                raise ValueError(f"config lacks {keys[0]!r} (also tried {', '.join(keys[1:])})")
            return int(value)

        hidden = required("hidden_size", "n_embd", "d_model")
        heads = required("num_attention_heads", "n_head", "num_heads")
        kv_heads = _first_key(config, "num_key_value_heads", "num_kv_heads")
        intermediate = _first_key(config, "intermediate_size", "ffn_dim", "n_inner")
        head_dim = config.get("head_dim")
        if head_dim is not None and int(head_dim) == hidden // heads:
            head_dim = None  # the common case: keep the shape canonical
        moe = _moe_fields(config)
        return cls(
            hidden=hidden,
            layers=required("num_hidden_layers", "n_layer", "num_layers"),
            heads=heads,
            kv_heads=int(kv_heads) if kv_heads is not None else heads,
            intermediate=int(intermediate) if intermediate is not None else 4 * hidden,
            vocab=required("vocab_size"),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            head_dim=int(head_dim) if head_dim is not None else None,
            name=name or default_name,
            gated_mlp=config.get("model_type") not in PLAIN_MLP_MODEL_TYPES,
            **moe,
        )

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden // self.heads

    @property
    def q_width(self) -> int:
        """Width of Q and of the attention output (= h unless head_dim is set otherwise)."""
        return self.heads * self.resolved_head_dim

    @property
    def kv_width(self) -> int:
        """h_kv = h * n_kv / n_heads: the width of K (and of V)."""
        return self.kv_heads * self.resolved_head_dim

    @property
    def attn_params(self) -> int:
        """P_attn = 2h^2 + 2h*h_kv (W_Q, W_O; W_K, W_V)."""
        return 2 * self.hidden * self.q_width + 2 * self.hidden * self.kv_width

    @property
    def mlp_matrices(self) -> int:
        return 3 if self.gated_mlp else 2

    @property
    def expert_params(self) -> int:
        """One layer's stacked experts: E * 3*h*F_e (0 for a dense model)."""
        return self.experts * 3 * self.hidden * self.expert_intermediate

    @property
    def router_params(self) -> int:
        """One layer's router ``[E, h]`` (0 for a dense model)."""
        return self.experts * self.hidden

    @property
    def mlp_params(self) -> int:
        """P_mlp = 3*h*I (W_gate, W_up, W_down), or 2*h*I for a plain MLP (W_up, W_down); a
        MoE layer's is its router and all its experts."""
        if self.is_moe:
            return self.router_params + self.expert_params
        return self.mlp_matrices * self.hidden * self.intermediate

    @property
    def qk_norm_params(self) -> int:
        """Per-head-dim RMSNorm weights on Q and K (Qwen3-MoE), per layer."""
        return 2 * self.resolved_head_dim if self.family == "qwen3_moe" else 0

    @property
    def layer_params(self) -> int:
        """P_layer: the weights TSP streams per layer (norm weights excluded, they are tiny)."""
        return self.attn_params + self.mlp_params

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def norm_params(self) -> int:
        return (2 * self.layers + 1) * self.hidden + self.layers * self.qk_norm_params

    @property
    def total_params(self) -> int:
        return self.layers * self.layer_params + self.embedding_params + self.norm_params


# The built-in shapes (``tspc plan --preset``) live in a JSON file next to this module, shipped as
# package data; each entry's ``source`` says where its numbers come from (JSON has no comments).
PRESETS_FILE = Path(__file__).with_name("model_presets.json")


def _load_presets(path: Path) -> dict[str, ModelShape]:
    entries = json.loads(path.read_text())
    return {
        key: ModelShape(**{k: v for k, v in entry.items() if k != "source"})
        for key, entry in entries.items()
    }


PRESETS: dict[str, ModelShape] = _load_presets(PRESETS_FILE)


def _moe_fields(config: Mapping[str, Any]) -> dict[str, Any]:
    """The MoE fields of a transformers config whose every layer is a top-k MoE block
    (Mixtral's ``num_local_experts``, Qwen-MoE's ``num_experts``); {} for a dense one. A config
    with dense layers among the MoE ones is refused: the planner models one kind of layer."""
    experts = _first_key(config, "num_local_experts", "num_experts")
    if not experts or config.get("num_experts_per_tok") is None:
        return {}
    if config.get("mlp_only_layers") or int(config.get("decoder_sparse_step", 1) or 1) != 1:
        raise ValueError(
            "this MoE config mixes dense and MoE layers (mlp_only_layers / "
            "decoder_sparse_step); the planner models every layer alike: give a config whose "
            "every layer is MoE"
        )
    if config.get("shared_expert_intermediate_size") or config.get("n_shared_experts"):
        raise ValueError("this MoE config has shared experts, which the planner does not model yet")
    width = _first_key(config, "moe_intermediate_size", "intermediate_size")
    return {
        "experts": int(experts),
        "experts_per_token": int(config["num_experts_per_tok"]),
        "expert_intermediate": int(width),
        "family": config.get("model_type"),
    }


# --------------------------------------------------------------------------------------------
# Plan inputs: the cluster shape and the memory-model assumptions
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PlanInputs:
    """Cluster shape plus every assumption of the memory model (defaults: the paper-matching set).

    ``a_rep_per_h`` / ``a_sh_per_h`` are activation elements per token per layer in units of h.
    ``a_sh_per_h=None`` derives it from the model: Q, attention output, K, V and the four
    gated-MLP intermediates (gate, up, act(gate), act*up), i.e. 2q + 2h_kv + 4I = 20h for the
    7B (a plain MLP has two: up, act(up)). ``a_rep`` (two norm inputs, two norm outputs, the residual) stays whole on every TP rank.
    """

    devices: int
    seq_len: int
    micro_batch: int = 1
    dtype: str = "bf16"
    recompute: str = "full"
    kappa: float = DEFAULT_KAPPA
    a_rep_per_h: float = DEFAULT_A_REP_PER_H
    a_sh_per_h: float | None = None
    overhead_gb: float = DEFAULT_OVERHEAD_GB
    logits_dtype: str | None = None  # None: same as dtype
    tsp_embeddings: str = "replicated"
    tsp_inflight_shards: int = 0  # the paper-matching set leaves them inside c0

    def __post_init__(self) -> None:
        for key in ("devices", "seq_len", "micro_batch"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{key} must be a positive integer, got {value!r}")
        if self.seq_len % (2 * self.devices):
            raise ValueError(
                f"sequence length {self.seq_len} is not divisible by 2*D = {2 * self.devices} "
                "(the zigzag partition cuts the sequence into 2D equal chunks)"
            )
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose from {sorted(DTYPE_BYTES)}")
        if self.logits_dtype is not None and self.logits_dtype not in DTYPE_BYTES:
            raise ValueError(
                f"unknown logits dtype {self.logits_dtype!r}; choose from {sorted(DTYPE_BYTES)}"
            )
        if self.recompute not in RECOMPUTE_POLICIES:
            raise ValueError(
                f"unknown recompute policy {self.recompute!r}; choose from {RECOMPUTE_POLICIES}"
            )
        if self.tsp_embeddings not in EMBEDDING_PLACEMENTS:
            raise ValueError(
                f"tsp_embeddings must be one of {EMBEDDING_PLACEMENTS}, got {self.tsp_embeddings!r}"
            )
        for key in ("kappa", "a_rep_per_h", "overhead_gb", "tsp_inflight_shards"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key} must be >= 0, got {getattr(self, key)!r}")
        if self.a_sh_per_h is not None and self.a_sh_per_h < 0:
            raise ValueError(f"a_sh_per_h must be >= 0, got {self.a_sh_per_h!r}")

    @property
    def act_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def logits_bytes(self) -> int:
        return DTYPE_BYTES[self.logits_dtype or self.dtype]

    def a_rep(self, model: ModelShape) -> float:
        """Replicated activation elements per token per layer."""
        return self.a_rep_per_h * model.hidden

    def a_sh(self, model: ModelShape) -> float:
        """Head/column-split activation elements per token per layer."""
        if self.a_sh_per_h is not None:
            return self.a_sh_per_h * model.hidden
        if model.is_moe:  # each token's k pairs: gate, up, act(gate), act*up of width F_e
            experts = 4 * model.experts_per_token * model.expert_intermediate
            return 2 * model.q_width + 2 * model.kv_width + experts
        # gated: gate, up, act(gate), act*up; plain: up, act(up)
        mlp = 4 if model.gated_mlp else 2
        return 2 * model.q_width + 2 * model.kv_width + mlp * model.intermediate
