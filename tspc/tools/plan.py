"""`tspc plan`: an analytic memory and communication planner for DP, TP, SP, TP+SP and TSP.

Everything here is arithmetic on a model shape and a cluster shape: no torch, no process group.
The memory model and the per-layer communication formulas are the ones in
``shared/PAPER_NOTES.md``; the default assumptions are the set that reproduces the paper's
7B figures (TSP 38.8 GB vs TP 70.0 GB per GPU at 128K tokens on 8 GPUs, ~31.0 vs ~31.5 at 16K).
Every assumption is a field of :class:`PlanInputs` and is printed with the numbers, because a
memory estimate without its assumptions cannot be checked.

Units: GB = 1e9 bytes and MB = 1e6 bytes (the paper's figures reproduce in 1e9; in GiB the
model-state term alone would be 19.9 instead of 21.37).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import textwrap
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tspc.tools import plan_dp

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
    """The shape of a dense decoder-only transformer: gated (3-matrix) MLPs, or plain
    (2-matrix: up, down) ones with ``gated_mlp=False`` (GPT-2, GPT-NeoX)."""

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

    def __post_init__(self) -> None:
        for key in ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model {key} must be a positive integer, got {value!r}")
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
        )

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
    def mlp_params(self) -> int:
        """P_mlp = 3*h*I (W_gate, W_up, W_down), or 2*h*I for a plain MLP (W_up, W_down)."""
        return self.mlp_matrices * self.hidden * self.intermediate

    @property
    def layer_params(self) -> int:
        """P_layer: the weights TSP streams per layer (norm weights excluded, they are tiny)."""
        return self.attn_params + self.mlp_params

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    @property
    def norm_params(self) -> int:
        return (2 * self.layers + 1) * self.hidden

    @property
    def total_params(self) -> int:
        return self.layers * self.layer_params + self.embedding_params + self.norm_params


PRESETS: dict[str, ModelShape] = {
    # The paper's reference "7B": h = 4096, 32 layers, 32 query and 32 KV heads, F = 4.
    "7b": ModelShape(
        hidden=4096,
        layers=32,
        heads=32,
        kv_heads=32,
        intermediate=16384,
        vocab=32000,
        tied_embeddings=False,
        name="7b (paper reference)",
    ),
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
        # gated: gate, up, act(gate), act*up; plain: up, act(up)
        mlp = 4 if model.gated_mlp else 2
        return 2 * model.q_width + 2 * model.kv_width + mlp * model.intermediate


# --------------------------------------------------------------------------------------------
# Per-scheme results
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryBreakdown:
    """Peak bytes per device, by component."""

    model_state: float
    stored_activations: float
    working_set: float
    kv_gathered: float
    logits: float
    weights_in_flight: float
    overhead: float

    @property
    def total(self) -> float:
        return (
            self.model_state
            + self.stored_activations
            + self.working_set
            + self.kv_gathered
            + self.logits
            + self.weights_in_flight
            + self.overhead
        )


@dataclass(frozen=True)
class LayerComm:
    """Bytes sent per device per transformer layer (ring-collective volumes)."""

    forward: float
    backward: float


@dataclass(frozen=True)
class SchemePlan:
    """One parallel layout of D devices: tp = weight-sharding ways, sp = token-sharding ways."""

    name: str
    kind: str  # "DP", "TP", "SP", "TP+SP", "TSP"
    tp: int
    sp: int
    memory: MemoryBreakdown
    comm: LayerComm
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Crossover:
    """Where TSP's forward bytes drop to TP's: B*S >= P_layer / (4h - 2h_kv)."""

    tokens: float  # B*S at the crossover (math.inf when TSP never wins)
    tokens_over_h: float
    batch_tokens: int  # this plan's B*S
    tsp_over_tp_forward: float  # ratio for this shape (nan at D = 1: neither communicates)

    @property
    def tsp_moves_fewer_bytes(self) -> bool:
        return self.batch_tokens > self.tokens


@dataclass(frozen=True)
class Plan:
    model: ModelShape
    inputs: PlanInputs
    schemes: tuple[SchemePlan, ...]
    crossover: Crossover

    def scheme(self, name: str) -> SchemePlan:
        for scheme in self.schemes:
            if scheme.name == name:
                return scheme
        raise KeyError(f"no scheme {name!r}; have {[s.name for s in self.schemes]}")


def _divisibility_notes(model: ModelShape, ways: int, what: str) -> tuple[str, ...]:
    notes = []
    for count, label in (
        (model.heads, "attention heads"),
        (model.kv_heads, "KV heads"),
        (model.intermediate, "intermediate size"),
    ):
        if count % ways:
            notes.append(f"{label} ({count}) not divisible by {what} = {ways}")
    return tuple(notes)


def memory_breakdown(
    model: ModelShape, inputs: PlanInputs, kind: str, tp: int, sp: int
) -> MemoryBreakdown:
    """Per-device peak memory of one layout (see the Assumptions block for each term).

    ``tp`` splits weights and the head/column-split activations; ``sp`` splits tokens. TSP is
    ``tp = sp = D`` on one axis, except that its activations are *not* head-split (every rank
    runs all heads on its own tokens), so the activation split t is 1 for TSP.
    """
    beta = inputs.act_bytes
    tokens = inputs.micro_batch * inputs.seq_len / sp  # tokens held per device
    act_split = 1 if kind == "TSP" else tp

    layer_weights = model.layers * model.layer_params
    if kind == "TSP":
        embed_ways = tp if inputs.tsp_embeddings == "sharded" else 1
        model_state = inputs.kappa * (
            layer_weights / tp + model.embedding_params / embed_ways + model.norm_params
        )
    else:
        # TP shards everything, embeddings vocab-parallel; norm weights stay replicated.
        model_state = inputs.kappa * (
            (layer_weights + model.embedding_params) / tp + model.norm_params
        )

    per_token_layer = inputs.a_rep(model) + inputs.a_sh(model) / act_split
    if inputs.recompute == "full":
        # Only each layer's input survives the forward; plain TP keeps it whole on every rank.
        stored = model.layers * tokens * model.hidden * beta
        working = per_token_layer * tokens * beta  # one layer recomputed at a time
    elif inputs.recompute == "selective":
        # The attention's Q, K, V and output are recomputed; norms, residual and MLP kept.
        attention = 2 * model.q_width + 2 * model.kv_width
        kept = inputs.a_rep(model) + max(inputs.a_sh(model) - attention, 0.0) / act_split
        stored = model.layers * kept * tokens * beta
        working = attention / act_split * tokens * beta  # one layer's attention at a time
    else:
        stored = model.layers * per_token_layer * tokens * beta
        working = 0.0  # the layer being processed is already among the stored ones

    if sp > 1:
        # Full-sequence K/V for the heads a device works on at once: one head group (TSP),
        # the local heads (TP+SP), all heads (SP).
        kv_heads_at_once = model.kv_width / tp
        kv_gathered = 2 * inputs.micro_batch * inputs.seq_len * kv_heads_at_once * beta
    else:
        kv_gathered = 0.0  # the local K/V already cover the whole sequence

    vocab_split = 1 if kind == "TSP" else tp  # TP: vocab-parallel LM head
    logits = tokens * model.vocab / vocab_split * inputs.logits_bytes

    in_flight = 0.0
    if kind == "TSP" and tp > 1:
        in_flight = inputs.tsp_inflight_shards * model.layer_params / tp * beta

    return MemoryBreakdown(
        model_state=model_state,
        stored_activations=stored,
        working_set=working,
        kv_gathered=kv_gathered,
        logits=logits,
        weights_in_flight=in_flight,
        overhead=float(round(inputs.overhead_gb * GB)),
    )


def layer_comm(model: ModelShape, inputs: PlanInputs, kind: str, tp: int, sp: int) -> LayerComm:
    """Per-layer bytes per device, forward and backward (PAPER_NOTES formulas).

    Backward counts the collectives of the backward pass proper, not the forward that
    activation recomputation replays. Gradients are in the activation dtype.
    """
    beta = grad_bytes = inputs.act_bytes
    batch_tokens = inputs.micro_batch * inputs.seq_len
    p_layer = model.layer_params
    h, h_kv = model.hidden, model.kv_width

    if kind == "TSP":
        d = tp
        ring = (d - 1) / d
        forward = ring * beta * (p_layer + 2 * batch_tokens * h_kv)
        backward = ring * ((beta + grad_bytes) * p_layer + 2 * batch_tokens * h_kv * beta)
        return LayerComm(forward, backward)

    # TP part: two all-reduces of the (local-token) activations, in each direction.
    tp_volume = 4 * (tp - 1) / tp * (batch_tokens / sp) * h * beta
    # SP part: K/V all-gather of the local heads (forward), its reduce-scatter (backward).
    sp_volume = 2 * (sp - 1) / sp * batch_tokens * (h_kv / tp) * beta
    # Weights replicated over the sp (or DP) ways: gradient all-reduce of the local shard.
    replicas = sp if kind != "DP" else inputs.devices
    grad_allreduce = 2 * (replicas - 1) / replicas * (p_layer / tp) * grad_bytes
    return LayerComm(forward=tp_volume + sp_volume, backward=tp_volume + sp_volume + grad_allreduce)


def _factor_pairs(devices: int) -> list[tuple[int, int]]:
    return [(t, devices // t) for t in range(2, devices // 2 + 1) if devices % t == 0]


def make_plan(model: ModelShape, inputs: PlanInputs) -> Plan:
    """Every scheme on D devices: DP, TP(T=D), SP(Σ=D), each TP+SP with T*Σ = D, TSP(D)."""
    d = inputs.devices
    layouts: list[tuple[str, str, int, int, tuple[str, ...]]] = [
        ("DP", "DP", 1, 1, ("each device trains its own micro-batch",)),
        (f"TP(T={d})", "TP", d, 1, _divisibility_notes(model, d, "T")),
        (f"SP(Σ={d})", "SP", 1, d, ()),
    ]
    for t, s in _factor_pairs(d):
        layouts.append((f"TP+SP(T={t},Σ={s})", "TP+SP", t, s, _divisibility_notes(model, t, "T")))
    layouts.append((f"TSP(D={d})", "TSP", d, d, _divisibility_notes(model, d, "D")))

    schemes = tuple(
        SchemePlan(
            name=name,
            kind=kind,
            tp=tp,
            sp=sp,
            memory=memory_breakdown(model, inputs, kind, tp, sp),
            comm=layer_comm(model, inputs, kind, tp, sp),
            notes=notes,
        )
        for name, kind, tp, sp, notes in layouts
    )
    return Plan(model=model, inputs=inputs, schemes=schemes, crossover=crossover(model, inputs))


def crossover(model: ModelShape, inputs: PlanInputs) -> Crossover:
    """TSP forward <= TP forward  <=>  B*S >= P_layer / (4h - 2h_kv)  (= 8h for MHA, F = 4)."""
    denominator = 4 * model.hidden - 2 * model.kv_width
    tokens = model.layer_params / denominator if denominator > 0 else math.inf
    d = inputs.devices
    tsp = layer_comm(model, inputs, "TSP", d, d).forward
    tp = layer_comm(model, inputs, "TP", d, 1).forward
    return Crossover(
        tokens=tokens,
        tokens_over_h=tokens / model.hidden,
        batch_tokens=inputs.micro_batch * inputs.seq_len,
        tsp_over_tp_forward=tsp / tp if tp > 0 else math.nan,
    )


# --------------------------------------------------------------------------------------------
# The paper's reported figures, for comparison when the plan is the paper's setting
# --------------------------------------------------------------------------------------------

# 7B, one 8-GPU node, micro-batch 1 [reported]; TP+SP gives two factorizations, unnamed.
REPORTED_7B_D8_GB: dict[int, dict[str, tuple[float, ...]]] = {
    16 * 1024: {"TSP": (31.0,), "TP": (31.5,)},
    128 * 1024: {"TSP": (38.8,), "TP": (70.0,), "TP+SP": (85.0, 140.0)},
}


def reported_comparison(plan: Plan) -> list[dict[str, Any]]:
    """Reported vs modelled GB when the plan is the paper's setting (7B, D = 8, B = 1)."""
    inputs = plan.inputs
    reported = REPORTED_7B_D8_GB.get(inputs.seq_len)
    same_model = asdict(plan.model) | {"name": ""} == asdict(PRESETS["7b"]) | {"name": ""}
    if not (same_model and inputs.devices == 8 and inputs.micro_batch == 1 and reported):
        return []
    rows = []
    for kind, figures in reported.items():
        modelled = {s.name: s.memory.total / GB for s in plan.schemes if s.kind == kind}
        if len(figures) == 1:
            ((name, value),) = modelled.items()
            rows.append(
                {
                    "scheme": name,
                    "reported_gb": figures[0],
                    "modelled_gb": round(value, 2),
                    "within_1gb": abs(value - figures[0]) <= 1.0,
                }
            )
        else:
            near = all(any(abs(v - f) <= 1.0 for v in modelled.values()) for f in figures)
            rows.append(
                {
                    "scheme": kind,
                    "reported_gb": list(figures),
                    "modelled_gb": {k: round(v, 2) for k, v in modelled.items()},
                    "within_1gb": near,
                }
            )
    return rows


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def assumptions(plan: Plan) -> list[str]:
    """Every assumption behind the numbers, in words, with this plan's values."""
    model, inputs = plan.model, plan.inputs
    h = model.hidden
    beta = inputs.act_bytes
    a_sh_source = (
        "given"
        if inputs.a_sh_per_h is not None
        else "Q + attention output + K + V + gate, up, act(gate), act*up = 2q + 2h_kv + 4I"
    )
    inflight_one = model.layer_params / inputs.devices * beta / GB
    if inputs.recompute == "full":
        recompute = (
            "recompute=full: only each layer's input is stored (L * tokens * h); the working "
            "set is one layer's activations, recomputed in backward"
        )
    else:
        recompute = "recompute=none: all L layers' activations are stored; no separate working set"
    if inputs.recompute == "selective":
        recompute = (
            "recompute=selective: the attention's Q, K, V and output (2q + 2h_kv per token) "
            "are recomputed one layer at a time; a_rep and the MLP's activations are stored"
        )
    tsp_embed = (
        "replicated on every rank"
        if inputs.tsp_embeddings == "replicated"
        else f"sharded 1/{inputs.devices}"
    )
    return [
        "GB = 1e9 bytes, MB = 1e6 bytes (the reported figures reproduce in 1e9, not GiB)",
        f"training with Adam: kappa = {inputs.kappa:g} bytes/param of model state "
        "(bf16 weights + bf16 grads + fp32 master, m, v)",
        "model state: DP and SP replicate it; TP and TP+SP shard all weights by T "
        f"(embeddings vocab-parallel); TSP shards layer weights by D, embeddings {tsp_embed}; "
        "norm weights replicated everywhere",
        f"dense decoder, {'gated' if model.gated_mlp else 'plain'} MLP "
        f"({model.mlp_matrices} matrices), flash-style attention (no S x S scores or mask)",
        recompute,
        f"activations in {inputs.dtype} ({beta} B/element); per token per layer "
        f"a_rep = {inputs.a_rep_per_h:g}h = {inputs.a_rep(model):g} elements (norm inputs and "
        "outputs, residual: whole on every TP rank) and "
        f"a_sh = {inputs.a_sh(model) / h:g}h = {inputs.a_sh(model):g} elements ({a_sh_source}: "
        "split by heads/columns under TP, not under TSP, whose ranks run all heads on 1/D of "
        "the tokens)",
        "K/V gathered: full-sequence K and V of one head group at a time (TSP, 1/D of all "
        "heads), of the local heads (TP+SP), of all heads (SP); none when tokens are not split",
        f"logits in {inputs.logits_dtype or inputs.dtype} for the local tokens over the whole "
        "vocabulary (TP, TP+SP: 1/T of it, vocab-parallel)",
        f"TSP weight shards in flight counted: {inputs.tsp_inflight_shards} "
        f"(each P_layer/D = {inflight_one:.2f} GB; the paper-matching set leaves them in c0)",
        f"c0 = {inputs.overhead_gb:g} GB fixed per-device overhead (runtime, allocator, buffers) "
        f"and a_rep = {inputs.a_rep_per_h:g}h: "
        + (
            f"FITTED constants ({FITTED_TO}), not derived; `--measure` prints the figures the "
            "measured graph gives for both"
            if (inputs.overhead_gb, inputs.a_rep_per_h)
            == (DEFAULT_OVERHEAD_GB, DEFAULT_A_REP_PER_H)
            else "as given"
        ),
        "communication: ring collectives, (n-1)/n factors, gradients in the activation dtype; "
        "TP: two activation all-reduces per layer each way; SP: K/V all-gather forward, "
        "reduce-scatter backward; DP, SP, TP+SP backward add the gradient all-reduce over the "
        "replicas; TSP backward re-streams weights, reduces weight grads, reduce-scatters dK/dV "
        "(K/V stashed); backward excludes the forward replayed by recomputation",
        "TP+SP: T x Σ = D on orthogonal axes (T, Σ >= 2); DP: D replicas, each with its own "
        "micro-batch of full-length sequences",
    ]


def _fmt_tokens(tokens: int) -> str:
    if tokens % (1024 * 1024) == 0:
        return f"{tokens // (1024 * 1024)}M"
    if tokens % 1024 == 0:
        return f"{tokens // 1024}K"
    return str(tokens)


def format_table(plan: Plan) -> str:
    """The human-readable report: memory, communication, crossover, reported figures, assumptions."""
    model, inputs, cross = plan.model, plan.inputs, plan.crossover
    lines = [
        f"tspc plan: {model.name}",
        f"  model: h={model.hidden} L={model.layers} heads={model.heads} "
        f"kv_heads={model.kv_heads} intermediate={model.intermediate} vocab={model.vocab} "
        f"{'tied' if model.tied_embeddings else 'untied'} embeddings",
        f"  params: {model.layers * model.layer_params / 1e9:.2f} B in layers + "
        f"{model.embedding_params / 1e9:.2f} B embeddings = {model.total_params / 1e9:.2f} B",
        f"  cluster: D={inputs.devices}, seq={inputs.seq_len} ({_fmt_tokens(inputs.seq_len)}), "
        f"micro-batch={inputs.micro_batch}, dtype={inputs.dtype}, recompute={inputs.recompute}",
        "",
        "Per-device memory (GB = 1e9 bytes)",
    ]
    headers = ["scheme", "model", "stored", "working", "K/V", "logits", "shards", "c0", "total"]
    rows = []
    for s in plan.schemes:
        m = s.memory
        values = [
            m.model_state,
            m.stored_activations,
            m.working_set,
            m.kv_gathered,
            m.logits,
            m.weights_in_flight,
            m.overhead,
            m.total,
        ]
        rows.append([s.name] + [f"{v / GB:.2f}" for v in values])
    lines += _table(headers, rows)

    lines += ["", "Per-layer communication per device (MB = 1e6 bytes)"]
    tp_forward = plan.scheme(f"TP(T={inputs.devices})").comm.forward
    rows = []
    for s in plan.schemes:
        ratio = f"{s.comm.forward / tp_forward:.3f}" if tp_forward > 0 else "-"
        rows.append([s.name, f"{s.comm.forward / MB:.1f}", f"{s.comm.backward / MB:.1f}", ratio])
    lines += _table(["scheme", "forward", "backward", "fwd / TP fwd"], rows)

    lines += ["", "Crossover"]
    kv_term = "2h_kv" if model.kv_width != model.hidden else "2h"
    if math.isinf(cross.tokens):
        lines.append("  4h - 2h_kv <= 0: TSP never moves fewer forward bytes than TP")
    else:
        lines.append(
            f"  TSP forward <= TP forward iff B*S >= P_layer / (4h - {kv_term}) = "
            f"{cross.tokens:,.0f} tokens = {cross.tokens_over_h:.2f}h"
        )
    if inputs.devices == 1:
        lines.append("  D = 1: neither TP nor TSP communicates")
    else:
        verdict = "fewer" if cross.tsp_moves_fewer_bytes else "more"
        if cross.batch_tokens == cross.tokens:
            verdict = "the same"
        lines.append(
            f"  here B*S = {cross.batch_tokens:,}: TSP moves {verdict} forward bytes than TP "
            f"({cross.tsp_over_tp_forward:.3f}x)"
        )

    notes = [f"  {s.name}: {note}" for s in plan.schemes for note in s.notes if s.kind != "DP"]
    if notes:
        lines += ["", "Feasibility notes (numbers above assume even splits)"] + notes
    if not _factor_pairs(inputs.devices):
        lines += ["", f"No TP+SP factorization T x Σ = {inputs.devices} with T, Σ >= 2"]

    comparison = reported_comparison(plan)
    if comparison:
        lines += ["", "Reported (paper, 7B, D=8, B=1) vs this model"]
        for row in comparison:
            if isinstance(row["reported_gb"], list):
                modelled = ", ".join(f"{k} {v:.1f}" for k, v in row["modelled_gb"].items())
                reported = " and ".join(f"{v:.1f}" for v in row["reported_gb"])
                status = (
                    "reproduced"
                    if row["within_1gb"]
                    else "NOT reproduced: this model does not derive the reported TP+SP points"
                )
                text = f"TP+SP: reported {reported} GB; modelled {modelled} GB ({status})"
                lines += _wrap(text, first="  ")
            else:
                status = "within 1 GB" if row["within_1gb"] else "NOT within 1 GB"
                lines.append(
                    f"  {row['scheme']}: reported {row['reported_gb']:.1f} GB, "
                    f"modelled {row['modelled_gb']:.2f} GB ({status})"
                )

    lines += ["", "Assumptions"]
    for text in assumptions(plan):
        lines += _wrap(text, first="  - ")
    return "\n".join(lines)


def _wrap(text: str, first: str) -> list[str]:
    return textwrap.wrap(
        text, width=98, initial_indent=first, subsequent_indent="    ", break_on_hyphens=False
    )


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        first = cells[0].ljust(widths[0])
        rest = [c.rjust(w) for c, w in zip(cells[1:], widths[1:])]
        return "  " + "  ".join([first, *rest])

    return [line(headers)] + [line(r) for r in rows]


def to_json(plan: Plan) -> dict[str, Any]:
    """The same numbers as :func:`format_table`, bytes exact and GB rounded, as a plain dict."""
    model, inputs, cross = plan.model, plan.inputs, plan.crossover
    schemes = {}
    for s in plan.schemes:
        memory = asdict(s.memory) | {"total": s.memory.total}
        schemes[s.name] = {
            "kind": s.kind,
            "tp": s.tp,
            "sp": s.sp,
            "memory_bytes": memory,
            "memory_gb": {k: round(v / GB, 3) for k, v in memory.items()},
            "comm_bytes_per_layer": asdict(s.comm),
            "notes": list(s.notes),
        }
    return {
        "model": asdict(model)
        | {
            "params_total": model.total_params,
            "params_per_layer": model.layer_params,
            "kv_width": model.kv_width,
        },
        "inputs": asdict(inputs)
        | {
            "a_rep_elements": inputs.a_rep(model),
            "a_sh_elements": inputs.a_sh(model),
            "units": {"GB": GB, "MB": MB},
        },
        "schemes": schemes,
        "crossover": {
            "tokens": None if math.isinf(cross.tokens) else cross.tokens,
            "tokens_over_h": None if math.isinf(cross.tokens) else cross.tokens_over_h,
            "batch_tokens": cross.batch_tokens,
            "tsp_over_tp_forward": None
            if math.isnan(cross.tsp_over_tp_forward)
            else cross.tsp_over_tp_forward,
            "tsp_moves_fewer_bytes": cross.tsp_moves_fewer_bytes,
        },
        "reported": reported_comparison(plan),
        "assumptions": assumptions(plan),
    }


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------

_TOKENS = re.compile(r"^\s*(\d+)\s*([kKmM]?)\s*$")


def parse_tokens(text: str) -> int:
    """'16K' -> 16384, '128k' -> 131072, '1M' -> 1048576, '4096' -> 4096 (K = 1024)."""
    match = _TOKENS.match(text)
    if not match:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a token count (write e.g. 4096, 16K or 128K; K = 1024)"
        )
    value = int(match.group(1)) * {"": 1, "k": 1024, "m": 1024 * 1024}[match.group(2).lower()]
    if value < 1:
        raise argparse.ArgumentTypeError(f"sequence length must be positive, got {text!r}")
    return value


def _checked(cast: type, what: str, ok: Callable[[Any], bool], requirement: str):
    """An argparse type: ``text`` as ``cast``, refused with a one-line reason unless ``ok``."""

    def parse(text: str):
        try:
            value = cast(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
        if not ok(value):  # a comparison with nan is False: nan is refused too
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {text}")
        return value

    return parse


_positive_int = _checked(int, "an integer", lambda v: v >= 1, "a positive integer")
_non_negative_int = _checked(int, "an integer", lambda v: v >= 0, ">= 0")
_non_negative_float = _checked(float, "a number", lambda v: v >= 0, ">= 0")


def build_parser() -> argparse.ArgumentParser:
    """The `tspc plan` parser. Later flags (`--measure`, `--plot`) are added to this parser."""
    parser = argparse.ArgumentParser(
        prog="tspc plan",
        description="Per-device memory and per-layer communication of DP, TP, SP, TP+SP and "
        "TSP for a model and a cluster shape (analytic; every assumption is printed).",
    )
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--preset", choices=sorted(PRESETS), help="a built-in model shape")
    model.add_argument(
        "--config", type=Path, help="a transformers config.json (or a directory holding one)"
    )
    parser.add_argument(
        "--devices", "-D", type=_positive_int, required=True, help="D: devices on the axis"
    )
    parser.add_argument(
        "--seq", type=parse_tokens, required=True, help="sequence length S: 4096, 16K, 128K"
    )
    parser.add_argument("--micro-batch", "-B", type=_positive_int, default=1, help="B (1)")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16")
    parser.add_argument("--recompute", choices=RECOMPUTE_POLICIES, default="full")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")

    assume = parser.add_argument_group("memory-model assumptions (defaults reproduce the paper)")
    assume.add_argument(
        "--kappa", type=_non_negative_float, default=DEFAULT_KAPPA, help="bytes/param (16)"
    )
    assume.add_argument(
        "--a-rep", type=_non_negative_float, default=DEFAULT_A_REP_PER_H,
        help="replicated activations per token per layer, in units of h (5)",
    )  # fmt: skip
    assume.add_argument(
        "--a-sh", type=_non_negative_float, default=None,
        help="head/column-split activations per token per layer, in units of h "
        "(default: derived, 2q + 2h_kv + 4I)",
    )  # fmt: skip
    assume.add_argument(
        "--overhead-gb", type=_non_negative_float, default=DEFAULT_OVERHEAD_GB,
        help="c0, fixed per-device overhead in GB (8.54)",
    )  # fmt: skip
    assume.add_argument(
        "--logits-dtype", choices=sorted(DTYPE_BYTES), default=None, help="(default: --dtype)"
    )
    assume.add_argument(
        "--tsp-embeddings", choices=EMBEDDING_PLACEMENTS, default="replicated",
        help="embeddings under TSP (replicated)",
    )  # fmt: skip
    assume.add_argument(
        "--inflight-shards", type=_non_negative_int, default=0, metavar="N",
        help="TSP weight shards in flight to count explicitly (0: inside c0)",
    )  # fmt: skip

    measure = parser.add_argument_group(
        "measurement: run the real TSP graph on fake tensors (no real memory, fake collectives)"
    )
    measure.add_argument(
        "--measure", action="store_true",
        help="compile the Llama-style reference model of this shape with backend='tsp' as each "
        "rank of D on the 'fake' process group, run one step on fake tensors and report each "
        "rank's peak live bytes next to the analytic TSP figure",
    )  # fmt: skip
    measure.add_argument(
        "--measure-mode", choices=("train", "forward"), default="train",
        help="train: forward + loss + backward + AdamW (default); forward: loss under no_grad",
    )  # fmt: skip
    measure.add_argument(
        "--measure-layers", type=_layers_arg, default=2, metavar="N|all",
        help="trace N and N+1 layers and extrapolate linearly to the model's depth (default 2: "
        "the smallest depth whose step has the full model's structure; tracing costs ~5-8 s "
        "per layer and rank at D=8 on 2 cores); 'all' traces the full depth",
    )  # fmt: skip
    measure.add_argument(
        "--measure-ranks", type=_ranks_arg, default=None, metavar="all|R[,R...]",
        help="which ranks to measure (default: all)",
    )  # fmt: skip
    parser.add_argument(
        "--plot", type=Path, default=None, metavar="FILE.png",
        help="also plot per-device memory vs sequence length for every scheme (analytic; "
        "needs matplotlib)",
    )  # fmt: skip
    plan_dp.add_arguments(parser)
    return parser


def _layers_arg(text: str) -> int | None:
    if text.strip().lower() in ("all", "full"):
        return None
    return _positive_int(text)


def _ranks_arg(text: str) -> list[int] | None:
    if text.strip().lower() == "all":
        return None
    try:
        ranks = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not 'all' or a list like 0,3") from None
    if not ranks or any(r < 0 for r in ranks):
        raise argparse.ArgumentTypeError(f"{text!r} is not 'all' or a list like 0,3")
    return ranks


def inputs_from_args(args: argparse.Namespace) -> tuple[ModelShape, PlanInputs]:
    """Turn parsed arguments into the model and the plan inputs (ValueError on bad values)."""
    model = PRESETS[args.preset] if args.preset else ModelShape.from_hf_config(args.config)
    inputs = PlanInputs(
        devices=args.devices,
        seq_len=args.seq,
        micro_batch=args.micro_batch,
        dtype=args.dtype,
        recompute=args.recompute,
        kappa=args.kappa,
        a_rep_per_h=args.a_rep,
        a_sh_per_h=args.a_sh,
        overhead_gb=args.overhead_gb,
        logits_dtype=args.logits_dtype,
        tsp_embeddings=args.tsp_embeddings,
        tsp_inflight_shards=args.inflight_shards,
    )
    return model, inputs


def main(argv: list[str] | None = None) -> int:
    """`tspc plan ...`: print the table (or `--json`). Bad input exits 2 with the reason."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        model, inputs = inputs_from_args(args)
    except ValueError as err:
        parser.error(str(err))
    plan = make_plan(model, inputs)
    if args.plot is not None:
        try:
            plot_memory_vs_seq(model, inputs, args.plot)
        except ImportError as err:
            parser.error(str(err))
    measured = None
    if args.measure:
        if args.measure_ranks is not None and max(args.measure_ranks) >= inputs.devices:
            parser.error(f"--measure-ranks: ranks must be below D = {inputs.devices}")
        measured = _run_measure(args, model, inputs, quiet=args.json)
    tsp = plan.scheme(f"TSP(D={inputs.devices})").memory
    full_state = inputs.kappa * model.total_params
    axis = plan_dp.TSPAxis(
        tsp.model_state, tsp.total, full_state, inputs.kappa, inputs.act_bytes, inputs.devices
    )
    dp_rows = plan_dp.dp_rows(axis, args.dp)
    if args.json:
        out = to_json(plan)
        out["data_parallel"] = plan_dp.dp_json(dp_rows, args.dp, args.data_parallel)
        if measured is not None:
            out["measured"] = measured[1]
        json.dump(out, sys.stdout, indent=2, ensure_ascii=False)
        sys.stdout.write("\n")
    else:
        print(format_table(plan))
        if args.dp > 1:
            print(plan_dp.format_dp(dp_rows, inputs.devices, args.dp, args.data_parallel))
        if measured is not None:
            print(measured[0])
        if args.plot is not None:
            print(f"\nplot written to {args.plot}")
    return 0


def _run_measure(
    args: argparse.Namespace, model: ModelShape, inputs: PlanInputs, quiet: bool
) -> tuple[str, dict[str, Any]]:
    """Run ``tspc.tools.measure`` for the plan's TSP layout; (text section, JSON section)."""
    import time

    from tspc.tools.measure import CATEGORIES, analytic_as_measured, format_measurement, measure

    def progress(r: Any) -> None:
        if not quiet:
            print(
                f"tspc plan --measure: rank {r.rank}/{r.world}, {r.layers} layer(s): "
                f"peak {r.peak / GB:.3f} GB (traced in {r.compile_seconds:.0f} s)",
                file=sys.stderr,
                flush=True,
            )

    start = time.perf_counter()
    meas = measure(
        model,
        devices=inputs.devices,
        seq_len=inputs.seq_len,
        micro_batch=inputs.micro_batch,
        dtype=inputs.dtype,
        mode=args.measure_mode,
        layers=args.measure_layers,
        ranks=args.measure_ranks,
        recompute=args.recompute,
        progress=progress,
    )
    seconds = time.perf_counter() - start
    ranks = [r.rank for r in meas.runs[meas.measured_layers[0]]]
    as_measured = analytic_as_measured(model, inputs, meas.mode, meas.recompute)
    data = {
        "mode": meas.mode,
        "recompute": meas.recompute,
        "layers_traced": list(meas.measured_layers),
        "extrapolated": meas.extrapolated,
        "per_rank_bytes": {
            str(rank): {c: meas.full[i][c] for c in CATEGORIES} | {"peak": meas.peak(i)}
            for i, rank in enumerate(ranks)
        },
        "max_peak_bytes": meas.max_peak,
        "analytic_tsp_bytes": make_plan(model, inputs)
        .scheme(f"TSP(D={inputs.devices})")
        .memory.total,
        "analytic_as_measured_bytes": as_measured.total,
        "seconds": seconds,
        "traces": [
            {
                "layers": r.layers,
                "rank": r.rank,
                "peak": r.peak,
                "level": r.level,
                "matched_attention": r.matched_attention,
                "matched_mlp": r.matched_mlp,
                "trace_seconds": r.compile_seconds,
            }
            for runs in meas.runs.values()
            for r in runs
        ],
    }
    return format_measurement(meas, model, inputs, seconds), data


def plot_memory_vs_seq(
    model: ModelShape, inputs: PlanInputs, path: Path, points: int = 9
) -> list[int]:
    """Plot every scheme's analytic per-device total against the sequence length (log-log).

    The sequence lengths are powers of two around the plan's own (from 1/16 to 4x of it),
    rounded to multiples of 2D. Raises ImportError with the install command without matplotlib.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError(
            "--plot needs matplotlib, which is not installed: pip install 'matplotlib>=3.8'"
        ) from None
    import dataclasses

    step = 2 * inputs.devices
    seqs = sorted(
        {max(step, round(inputs.seq_len * 2.0**k / step) * step) for k in range(-(points - 3), 3)}
    )
    series: dict[str, list[float]] = {}
    for seq in seqs:
        plan = make_plan(model, dataclasses.replace(inputs, seq_len=seq))
        for s in plan.schemes:
            series.setdefault(s.name, []).append(s.memory.total / GB)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, values in series.items():
        ax.plot(seqs, values, marker="o", markersize=3, label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length (tokens)")
    ax.set_ylabel("per-device memory (GB, analytic)")
    ax.set_title(f"{model.name}: D={inputs.devices}, B={inputs.micro_batch}, {inputs.dtype}")
    ax.axvline(inputs.seq_len, color="grey", linewidth=0.8, linestyle=":")
    ax.grid(True, which="both", linewidth=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return seqs


if __name__ == "__main__":
    raise SystemExit(main())
