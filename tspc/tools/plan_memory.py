"""The analytic memory and communication model of `tspc plan` for DP, TP, SP, TP+SP and TSP.

Everything here is arithmetic on a model shape and a cluster shape: no torch, no process group.
The memory model and the per-layer communication formulas are the ones in
``shared/PAPER_NOTES.md``; the default assumptions are the set that reproduces the paper's
7B figures (TSP 38.8 GB vs TP 70.0 GB per GPU at 128K tokens on 8 GPUs, ~31.0 vs ~31.5 at 16K).
Every assumption is a field of :class:`~tspc.tools.shapes.PlanInputs` and is printed with the
numbers (:func:`assumptions`), because a memory estimate without its assumptions cannot be
checked.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from tspc.tools import plan_moe
from tspc.tools.shapes import (
    DEFAULT_A_REP_PER_H,
    DEFAULT_OVERHEAD_GB,
    FITTED_TO,
    GB,
    PRESETS,
    ModelShape,
    PlanInputs,
)

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
    kind: str  # "DP", "TP", "SP", "TP+SP", "TSP", and for a MoE model "TP+EP"
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


def _divisibility_notes(
    model: ModelShape, ways: int, what: str, kind: str = "TP"
) -> tuple[str, ...]:
    notes = []
    width = (
        (model.expert_intermediate, "expert intermediate size")
        if model.is_moe
        else (model.intermediate, "intermediate size")
    )
    counts = [(model.heads, "attention heads"), (model.kv_heads, "KV heads")]
    if not (model.is_moe and kind in ("TSP", "TP+EP")):  # those split experts, not F
        counts.append(width)
    for count, label in counts:
        if count % ways:
            notes.append(f"{label} ({count}) not divisible by {what} = {ways}")
    if model.is_moe:
        notes += plan_moe.divisibility_notes(model, ways, kind)
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
    if model.is_moe:
        model_state = inputs.kappa * plan_moe.model_state_params(model, inputs, kind, tp)
    elif kind == "TSP":
        embed_ways = tp if inputs.tsp_embeddings == "sharded" else 1
        model_state = inputs.kappa * (
            layer_weights / tp + model.embedding_params / embed_ways + model.norm_params
        )
    else:
        # TP shards everything, embeddings vocab-parallel; norm weights stay replicated.
        model_state = inputs.kappa * (
            (layer_weights + model.embedding_params) / tp + model.norm_params
        )

    routed = plan_moe.routed_per_token(model, kind, tp) if model.is_moe else 0.0
    per_token_layer = inputs.a_rep(model) + inputs.a_sh(model) / act_split + routed
    if inputs.recompute == "full":
        # Only each layer's input survives the forward; plain TP keeps it whole on every rank.
        stored = model.layers * tokens * model.hidden * beta
        working = per_token_layer * tokens * beta  # one layer recomputed at a time
    elif inputs.recompute == "selective":
        # The attention's Q, K, V and output are recomputed; norms, residual and MLP kept.
        attention = 2 * model.q_width + 2 * model.kv_width
        kept = inputs.a_rep(model) + max(inputs.a_sh(model) - attention, 0.0) / act_split
        kept += routed
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
        streamed = model.attn_params if model.is_moe else model.layer_params  # experts stay
        in_flight = inputs.tsp_inflight_shards * streamed / tp * beta

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
        streamed = model.attn_params if model.is_moe else p_layer  # MoE: the experts stay put
        forward = ring * beta * (streamed + 2 * batch_tokens * h_kv)
        backward = ring * ((beta + grad_bytes) * streamed + 2 * batch_tokens * h_kv * beta)
        if model.is_moe:
            forward += plan_moe.tsp_all_to_all_bytes(model, inputs, backward=False)
            backward += plan_moe.tsp_all_to_all_bytes(model, inputs, backward=True)
        return LayerComm(forward, backward)

    # TP part: two all-reduces of the (local-token) activations, in each direction.
    tp_volume = 4 * (tp - 1) / tp * (batch_tokens / sp) * h * beta
    # SP part: K/V all-gather of the local heads (forward), its reduce-scatter (backward).
    sp_volume = 2 * (sp - 1) / sp * batch_tokens * (h_kv / tp) * beta
    # Weights replicated over the sp (or DP) ways: gradient all-reduce of the local shard.
    # (TP+EP: sp = 1, nothing replicated but the router; its combine is the TP all-reduce.)
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
    if model.is_moe and d > 1:
        layouts.append(
            (f"TP+EP(T={d})", "TP+EP", d, 1, _divisibility_notes(model, d, "T", "TP+EP"))
        )
    layouts.append((f"TSP(D={d})", "TSP", d, d, _divisibility_notes(model, d, "D", "TSP")))

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
    """TSP forward <= TP forward  <=>  B*S >= P_layer / (4h - 2h_kv)  (= 8h for MHA, F = 4).
    MoE: the ring streams P_attn only and the all-to-alls add 2 k h / D per token, so
    B*S >= P_attn / (4h - 2h_kv - 2 k h / D) (the count exchange left out)."""
    d = inputs.devices
    denominator = 4 * model.hidden - 2 * model.kv_width
    streamed = model.layer_params
    if model.is_moe:
        streamed = model.attn_params
        denominator -= 2 * model.experts_per_token * model.hidden / d
    tokens = streamed / denominator if denominator > 0 else math.inf
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
    moe = []
    if model.is_moe:
        c = plan_moe.experts_per_rank(model, inputs.devices)
        moe = [
            f"MoE: every layer routes each token to k = {model.experts_per_token} of "
            f"E = {model.experts} gated experts of width F_e = {model.expert_intermediate}; "
            f"TSP and TP+EP own c = {c} experts per rank (Shard(0) by expert), the router and "
            "(TSP) the embeddings whole; TP and TP+SP shard every expert by F",
            "MoE activations: the experts' 4 k F_e per token (split by T under TP, TP+SP, "
            "TP+EP) plus the routed tokens' buffers a_route = 5 k h per local token (TSP: "
            "sent, received, computed, returned, re-ordered rows), 3 k h (TP, TP+SP), "
            "2 k h / D (TP+EP: only its own experts' pairs); balanced routing (each rank's "
            "k B S / D pairs spread evenly over the owners)",
            "MoE communication: TSP streams the attention weights only; its all-to-alls move "
            "2 (D-1)/D k (B S / D) h b bytes forward and 3x that backward (runtime.moe."
            "moe_bytes at balanced routing); TP+EP communicates as TP",
        ]
    return [
        "GB = 1e9 bytes, MB = 1e6 bytes (the reported figures reproduce in 1e9, not GiB)",
        *moe,
        f"training with Adam: kappa = {inputs.kappa:g} bytes/param of model state "
        "(bf16 weights + bf16 grads + fp32 master, m, v)",
        "model state: DP and SP replicate it; TP and TP+SP shard all weights by T "
        f"(embeddings vocab-parallel); TSP shards layer weights by D, embeddings {tsp_embed}; "
        "norm weights replicated everywhere",
        ("MoE" if model.is_moe else "dense")
        + f" decoder, {'gated' if model.gated_mlp else 'plain'} MLP "
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
