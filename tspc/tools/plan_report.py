"""The text, JSON and plot output of `tspc plan`'s analytic model
(:mod:`tspc.tools.plan_memory`)."""

from __future__ import annotations

import math
import textwrap
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tspc.tools.plan_memory import Plan, _factor_pairs, assumptions, make_plan, reported_comparison
from tspc.tools.shapes import GB, MB, ModelShape, PlanInputs


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
        f"{'tied' if model.tied_embeddings else 'untied'} embeddings"
        + (
            f", MoE: {model.experts} experts top-{model.experts_per_token} "
            f"F_e={model.expert_intermediate}"
            if model.is_moe
            else ""
        ),
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
    streamed, routed = ("P_attn", " - 2kh/D") if model.is_moe else ("P_layer", "")
    if math.isinf(cross.tokens):
        lines.append("  4h - 2h_kv <= 0: TSP never moves fewer forward bytes than TP")
    else:
        lines.append(
            f"  TSP forward <= TP forward iff B*S >= {streamed} / (4h - {kv_term}{routed}) = "
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
