"""What the attention rewrite emits for one matched attention, decided without the graph.

``plan_attention`` is a pure function of numbers (``AttentionSpec``: head counts, the
projections' rows, the weights' shapes, D and the rank) to an ``AttentionPlan``: which weight
slices each step's broadcast packs, which K/V projection weights stay whole, whether K/V are
shared between head groups, the sweeps over the head groups, and the communication the
schedule will do (the bytes each rank receives). ``rewrite_attention.py`` reads the plan and
does the graph surgery; the plan is tested on its own (``tests/test_attention_plan.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from tspc.runtime.shard_store import ShardSpec

from .head_plan import head_rows, local_heads
from .held_whole import kv_heads_fix


@dataclass(frozen=True)
class ProjectionSlots:
    """One of the attention's Q/K/V projections as the plan sees it: the rows (output
    features) of its weight it uses, and how they split into heads."""

    n_heads: int
    row_start: int
    row_stop: int
    weight_shape: tuple[int, ...]
    feature_dim: int  # the weight dim holding the output features (1: Conv1D's [in, out])
    has_bias: bool
    kv_only: bool  # a projection of keys/values only (not the queries' projection)
    fqn: str = ""  # the weight's parameter name, for the report

    @property
    def unit(self) -> int:  # rows per head, as head_rows reads it
        return (self.row_stop - self.row_start) // self.n_heads

    def rows_numel(self) -> int:
        """Elements of the weight rows this projection uses."""
        per_row = math.prod(self.weight_shape) // self.weight_shape[self.feature_dim]
        return (self.row_stop - self.row_start) * per_row


@dataclass(frozen=True)
class AttentionSpec:
    """The numbers of one matched attention the plan is made from."""

    module: str
    world: int
    rank: int
    q_heads: int
    kv_heads: int
    head_dim: int
    projections: tuple[ProjectionSlots, ...]
    o_shape: tuple[int, ...]
    o_transposed: bool
    elem_size: int  # bytes per weight element
    k_numel: int  # elements of this rank's keys (its tokens, all KV heads)
    k_elem_size: int
    kernel: str  # zigzag_causal | sdpa_masked_rows | sdpa
    cross: tuple[tuple[str, str], ...] = ()  # statistics over all heads: (node name, sum|mean)
    fused_q_heads: int = 0  # the K/V heads a model projects when it expands them before its
    # head-local ops (Falcon's grouped fused QKV, torchtune's / torchtitan's GQA before RoPE or
    # the transpose): fewer than kv_heads, the heads the call sees; 0 otherwise
    v_head_dim: int = 0  # the values' head size when it differs from q/k's (0: the same)
    v_numel: int = 0  # elements of this rank's values (0: as many as its keys)


@dataclass(frozen=True)
class Component:
    """One tensor in a step's pack: ``p{i}_w`` / ``p{i}_b`` (projection i's weight / bias) or
    ``o_w`` (the output projection's weight), the slice of it, and the slice's shape."""

    name: str
    spec: ShardSpec
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class AttentionRewrite:
    module: str
    steps: int
    broadcasts: int
    kv_gathers: int
    local_heads: int
    local_kv_heads: int
    kernel: str
    shard_numel: int
    predicted_recv_bytes: int = 0
    notes: list[str] = field(default_factory=list)
    # the model's own KV head count where the schedule moves more (K/V expanded before the
    # head-local ops): what the paper's formula counts
    model_kv_heads: int = 0
    # (reason, fix) when some of its weights are held whole for a reason the user can change
    held_whole: tuple[str, str] | None = None


@dataclass
class AttentionPlan:
    spec: AttentionSpec
    # Fewer KV heads than ranks: ``span`` consecutive head groups share one KV head (see
    # ``plan_attention``); 1 otherwise.
    shared_kv: bool
    span: int
    replicated_kv: tuple[int, ...]  # projections whose weights every rank holds whole
    steps: list[list[Component]]  # what rank r's broadcast packs, for step r
    cross: bool  # two sweeps over the head groups: Q/K/V slices, then O
    report: AttentionRewrite

    @property
    def sweeps(self) -> int:
        return 2 if self.cross else 1

    def primary(self, r: int) -> bool:
        """Whether head group r computes (and gathers) its K/V itself rather than reusing the
        previous group's shared KV head."""
        return r % self.span == 0

    def reuses_kv(self, r: int) -> bool:
        return self.shared_kv and not self.primary(r)

    def sweep_part(self, r: int, k: int) -> list[Component]:
        """The components of step r broadcast in sweep k (all of them with one sweep)."""
        if not self.cross:
            return list(self.steps[r])
        keep_o = k == 1
        return [c for c in self.steps[r] if (c.name == "o_w") == keep_o]


def plan_attention(s: AttentionSpec) -> AttentionPlan:
    D, rank = s.world, s.rank
    # Fewer KV heads than ranks: D / Hkv consecutive head groups share one KV head; its K/V
    # are computed and gathered once, in the step of the first of those groups (the
    # "primary"), and reused by the following groups, so the K/V bytes stay 2*B*S*h_kv.
    # Separate K/V projection weights stay whole on every rank (a replicated parameter, its
    # gradient summed in-graph): one owner per head would be no DTensor placement, and every
    # rank already holding them saves their broadcast. A fused projection keeps its K/V rows
    # in the primary's pack.
    shared_kv = s.kv_heads % D != 0
    span = D // s.kv_heads if shared_kv else 1
    replicated = tuple(i for i, p in enumerate(s.projections) if shared_kv and p.kv_only)

    def components(r: int) -> list[Component]:
        out = []
        for i, p in enumerate(s.projections):
            if i in replicated or (shared_kv and p.kv_only and r % span != 0):
                continue
            a, b = head_rows(p, r, D)
            out.append(_component(f"p{i}_w", p.weight_shape, ShardSpec(p.feature_dim, a, b)))
            if p.has_bias:
                out.append(
                    _component(f"p{i}_b", (p.weight_shape[p.feature_dim],), ShardSpec(0, a, b))
                )
        hq_l = s.q_heads // D
        o_in_dim = 0 if s.o_transposed else 1  # the weight dim of the heads' features
        dv = s.v_head_dim or s.head_dim
        o_slice = ShardSpec(o_in_dim, r * hq_l * dv, (r + 1) * hq_l * dv)
        out.append(_component("o_w", s.o_shape, o_slice))
        return out

    steps = [components(r) for r in range(D)]
    cross = bool(s.cross)
    sweeps = 2 if cross else 1
    n_kv_groups = s.kv_heads if shared_kv else D
    kv_local = local_heads(s.kv_heads, D)
    # one head group's K and V bytes, averaged (values may have a head size of their own)
    kv_numel = s.k_numel + (s.v_numel or s.k_numel)
    kv_group_bytes = kv_numel // s.kv_heads * kv_local * s.k_elem_size // 2
    step_numel = [sum(c.numel for c in comps) for comps in steps]
    report = AttentionRewrite(
        module=s.module,
        steps=D * sweeps,
        broadcasts=D * sweeps if D > 1 else 0,
        kv_gathers=2 * n_kv_groups if D > 1 else 0,
        local_heads=s.q_heads // D,
        local_kv_heads=kv_local,
        kernel=s.kernel,
        shard_numel=step_numel[rank] if D > 1 else 0,
        predicted_recv_bytes=(
            sum(n for r, n in enumerate(step_numel) if r != rank) * s.elem_size
            + 2 * n_kv_groups * (D - 1) * kv_group_bytes
        )
        if D > 1
        else 0,
    )
    if s.fused_q_heads and s.fused_q_heads < s.kv_heads and D > 1:
        # the KV heads are expanded before RoPE (Falcon's broadcast_to, torchtune's view +
        # expand + reshape), so the keys the schedule gathers have the query heads' count
        kv_bytes = 2 * n_kv_groups * (D - 1) * kv_group_bytes
        extra = kv_bytes - kv_bytes * s.fused_q_heads // s.kv_heads
        report.model_kv_heads = s.fused_q_heads
        report.notes.append(
            f"the model expands its {s.fused_q_heads} K/V heads to {s.kv_heads} before the "
            "head-local ops (RoPE) run on them, so each head group's K/V is gathered at that "
            f"width: {extra} bytes more than the formula's 2*B*S*h_kv*d"
        )
    if cross:
        report.notes.append(
            "statistics over all heads ("
            + ", ".join(f"'{name}' ({kind})" for name, kind in s.cross)
            + f") before the attention: two sweeps over the {D} head groups, Q/K/V slices "
            "broadcast in the first, O in the second (every weight moves once); each rank "
            "keeps its tokens' projections of all head groups between them"
        )
    if replicated and D > 1:
        held = [s.projections[i] for i in replicated]
        names = ", ".join(sorted({p.fqn for p in held}))
        report.held_whole = (
            f"its {s.kv_heads} key/value heads are fewer than D={D}, so its K/V projection "
            f"weights ({names}) are held whole on every rank",
            kv_heads_fix(s.kv_heads),
        )
        report.notes.append(
            f"{s.kv_heads} KV heads on {D} ranks: the K/V projection weights stay whole on every "
            "rank (replicated, not broadcast), so the layer receives "
            f"{sum(p.rows_numel() for p in held) * (D - 1) // D * s.elem_size} "
            "weight bytes fewer than the formula counts"
        )
    return AttentionPlan(s, shared_kv, span, replicated, steps, cross, report)


def _component(name: str, full_shape: tuple[int, ...], spec: ShardSpec) -> Component:
    shape = list(full_shape)
    shape[spec.dim] = spec.stop - spec.start
    return Component(name, spec, tuple(shape))
