"""The ``--measure`` section of ``tspc plan``: measured per-rank peaks next to the analytic
figures of :mod:`tspc.tools.plan_memory`, and where they differ."""

from __future__ import annotations

import dataclasses
import textwrap
from typing import Any

from tspc.tools.fake_memory import CATEGORIES, CATEGORY_LABELS
from tspc.tools.plan_memory import memory_breakdown
from tspc.tools.shapes import GB, MB


def analytic_as_measured(shape: Any, inputs: Any, mode: str, recompute: str = "none") -> Any:
    """The planner's TSP breakdown under the assumptions of what ``measure`` runs.

    Training: weights, gradients and both AdamW moments in the model dtype (kappa = 4 bytes x
    the dtype's width; no fp32 master copy), the recomputation the measured step ran
    (``recompute``), two weight shards in flight, no fixed overhead c0 (fake tensors have none).
    Forward: weights only (kappa = the dtype's width) and no stored activations (``no_grad``).
    """

    beta = inputs.act_bytes
    matched = dataclasses.replace(
        inputs,
        kappa=float(4 * beta if mode == "train" else beta),
        recompute=recompute if mode == "train" else "full",
        overhead_gb=0.0,
        tsp_inflight_shards=2,
    )
    d = inputs.devices
    m = memory_breakdown(shape, matched, "TSP", d, d)
    if mode == "forward":
        # One layer's working set and nothing stored: the recompute="full" working set term.
        m = dataclasses.replace(m, stored_activations=0.0)
    return m


def format_measurement(meas: Any, shape: Any, inputs: Any, seconds: float) -> str:
    """The ``--measure`` section of ``tspc plan``: per-rank peaks and the analytic figures."""

    d = inputs.devices
    unit, scale = ("GB", GB) if meas.max_peak >= 0.5 * GB else ("MB", MB)
    what = (
        "training step (forward + loss + backward + AdamW)"
        if meas.mode == "train"
        else "forward (loss under no_grad)"
    )
    first = next(iter(meas.runs.values()))[0]
    where = f"TSP(D={d})"
    if meas.data_parallel != "replicate":
        where += f" in {meas.data_parallel} over dp = {meas.dp} ({meas.dp * d} fake ranks)"
    lines = ["", f"Measured: {where} on fake tensors, {what}, recompute={meas.recompute}"]
    text = (
        f"the real rewritten graph ran at level '{first.level}': {first.matched_attention} "
        f"attention and {first.matched_mlp} MLP layers matched in the {first.layers}-layer trace"
    )
    if getattr(shape, "is_moe", False):
        text += f", of which {first.matched_moe} MoE blocks expert-parallel"
    if first.skipped:
        text += f"; skipped: {'; '.join(first.skipped)}"
    if first.gathers:
        text += f"; sequence gathers: {', '.join(first.gathers)}"
    lines += _wrap(text)
    if getattr(shape, "is_moe", False):
        from tspc.tools.fake_moe import ROUTING_ASSUMPTION

        lines += _wrap(
            f"the transformers '{shape.family}' model of this shape; assumed: "
            f"{ROUTING_ASSUMPTION} (counted as 'comm' for the op's duration)"
        )
    if meas.extrapolated:
        a, b = meas.measured_layers
        lines += _wrap(
            f"traced {a} and {b} layers per rank; each component extrapolated linearly to "
            f"{meas.layers} layers: x(L) = x({a}) + (L - {a}) * (x({b}) - x({a}))"
        )
    ranks = [r.rank for r in meas.runs[meas.measured_layers[0]]]
    headers = ["rank", *(CATEGORY_LABELS[c] for c in CATEGORIES), "peak"]
    rows = []
    for i, rank in enumerate(ranks):
        full = meas.full[i]
        rows.append(
            [str(rank)]
            + [f"{full[c] / scale:.2f}" for c in CATEGORIES]
            + [f"{meas.peak(i) / scale:.2f}"]
        )
    lines.append(f"  per-rank peak ({unit}) and what is live at that moment:")
    lines += _table(headers, rows)
    if meas.extrapolated:
        lines.append(f"  the traced depths, rank {ranks[0]} ({unit}):")
        depth_rows = []
        for depth in meas.measured_layers:
            r = meas.runs[depth][0]
            depth_rows.append(
                [f"{depth} layer(s)"]
                + [f"{r.at_peak[c] / scale:.3f}" for c in CATEGORIES]
                + [f"{r.peak / scale:.3f}"]
            )
        lines += _table(["traced", *headers[1:]], depth_rows)

    matched = analytic_as_measured(shape, inputs, meas.mode, meas.recompute)
    traces = sum(len(v) for v in meas.runs.values())
    timing = f"  time: {seconds:.0f} s for {traces} trace(s) (one per rank and depth)"
    if meas.data_parallel != "replicate":
        return "\n".join(
            [*lines, *_dp_comparison(meas, shape, inputs, matched, unit, scale), timing]
        )
    plan_tsp = memory_breakdown(shape, inputs, "TSP", d, d)
    kappa = 4 * inputs.act_bytes if meas.mode == "train" else inputs.act_bytes
    assumed = (
        f"kappa={kappa} B/param, recompute={meas.recompute}"
        if meas.mode == "train"
        else "weights only, nothing stored"
    )
    lines += [
        f"  measured vs analytic, TSP(D={d}), per rank ({unit}):",
        f"    measured, max over ranks                  {meas.max_peak / scale:10.2f}",
        f"    analytic, this plan's assumptions         {plan_tsp.total / scale:10.2f}",
        f"    analytic, the measured step's assumptions {matched.total / scale:10.2f}"
        f"   ({assumed}, 2 shards in flight, c0=0)",
    ]
    lines += _explain(meas, shape, inputs, plan_tsp, matched, unit, scale)
    lines.append(timing)
    return "\n".join(lines)


def _dp_comparison(
    meas: Any, shape: Any, inputs: Any, matched: Any, unit: str, scale: float
) -> list[str]:
    """The measured split of the largest rank's peak on a data-parallel mesh beside
    ``tspc plan --dp``'s row for that mode, under the measured step's assumptions."""
    from tspc.tools.plan_dp import TSPAxis, dp_memory

    full = meas.full[max(range(len(meas.full)), key=meas.peak)]
    state = sum(full[c] for c in ("full_weights", "shards", "other_params", "gradients"))
    state += full["optimizer"]
    kappa = 4 * inputs.act_bytes if meas.mode == "train" else inputs.act_bytes  # as measured
    axis = TSPAxis(
        matched.model_state, matched.total, kappa * shape.total_params, kappa,
        inputs.act_bytes, inputs.devices,
    )  # fmt: skip
    row = dp_memory(axis, meas.dp, meas.data_parallel, meas.dp_shard)
    rows = [
        ("model state (weights, grads, optimizer)", state, row.model_state),
        ("weights gathered for a call", full["dp_gathered"], row.gathered),
        ("activations, K/V, logits, buffers", full["activations"] + full["communication"],
         row.rest),
        ("total", sum(full.values()), row.total),
    ]  # fmt: skip
    lines = [f"  measured vs analytic ({unit}, the largest rank; analytic: `--dp` row, c0=0):"]
    lines += [f"    {label:42}{m / scale:10.2f}{a / scale:10.2f}" for label, m, a in rows]
    lines += _wrap(
        "the analytic row counts the gathered weights' unreduced gradients with the gathered "
        "weights (an upper bound: all of them at once); measured, those gradients are made by "
        "the backward graph and counted with the activations, and the weights gathered for a "
        "call are those live at the peak (a parameter the backward no longer needs is gone)",
        first="  - ",
    )
    return lines


def _wrap(text: str, first: str = "  ", rest: str = "    ") -> list[str]:

    return textwrap.wrap(
        text, width=98, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False
    )


def _explain(
    meas: Any,
    shape: Any,
    inputs: Any,
    plan_tsp: Any,
    matched: Any,
    unit: str,
    scale: float,
) -> list[str]:
    """Where the measured figure and the analytic ones differ, component by component."""
    i = max(range(len(meas.full)), key=meas.peak)
    full = meas.full[i]
    state_keys = ("full_weights", "shards", "other_params", "gradients", "optimizer")
    state = sum(full[c] for c in state_keys)
    acts = full["activations"] + full["communication"]
    plan_acts = plan_tsp.total - plan_tsp.model_state - plan_tsp.overhead
    h = shape.hidden
    tokens = inputs.micro_batch * inputs.seq_len / inputs.devices

    def f(x: float) -> str:
        return f"{x / scale:.2f}"

    lines = ["  where they differ (measured vs this plan):"]
    held = ", ".join(
        f"{label} {f(full[c])}"
        for c, label in (
            ("shards", "weight shards"),
            ("other_params", "unmatched parameters"),
            ("full_weights", "unreleased full weights"),
            ("gradients", "gradients"),
            ("optimizer", "optimizer state"),
        )
    )
    lines += _wrap(
        f"model state {f(state)} vs {f(plan_tsp.model_state)}: the plan counts kappa = "
        f"{inputs.kappa:g} B/param (bf16 weights and gradients, fp32 master weights and Adam "
        f"moments) with every gradient present; at its peak the measured step holds {held} "
        + ("(AdamW moments in the parameter dtype)" if meas.mode == "train" else ""),
        first="  - ",
    )
    lines += _wrap(
        f"activations and collective buffers {f(acts)} vs {f(plan_acts)} (stored "
        f"{f(plan_tsp.stored_activations)}, working set {f(plan_tsp.working_set)}, gathered "
        f"K/V {f(plan_tsp.kv_gathered)}, logits {f(plan_tsp.logits)}, shards in flight "
        f"{f(plan_tsp.weights_in_flight)})",
        first="  - ",
    )
    if meas.extrapolated:
        a, b = (meas.runs[depth][i] for depth in meas.measured_layers)
        act_inc = sum(b.at_peak[c] - a.at_peak[c] for c in ("activations", "communication"))
        state_inc = sum(b.at_peak[c] - a.at_peak[c] for c in state_keys)
        per_token = act_inc / (tokens * inputs.act_bytes) / h
        no_recompute = (inputs.a_rep(shape) + inputs.a_sh(shape)) / h
        if meas.mode == "train":
            planned = {
                "full": "1h (only the layer input: full recomputation)",
                "none": f"{no_recompute:g}h",
            }.get(inputs.recompute, f"{matched_per_token(shape, inputs):g}h")
            saved_by = {
                "none": "tspc ran no recomputation, aot_autograd's min-cut partitioner decided "
                "what is saved",
                "full": "tspc recomputed every block (only its input is saved)",
                "selective": "tspc recomputed each attention, the partitioner chose the rest",
            }[meas.recompute]
            n0 = meas.measured_layers[0]
            fixed = sum(a.at_peak[c] for c in ("activations", "communication")) - n0 * act_inc
            text = (
                f"per layer (the measured increment): {f(act_inc)} {unit} of activations and "
                f"collective buffers, {per_token:.1f}h elements per local token, where the plan "
                f"stores {planned} and its no-recompute model (a_rep + a_sh) says "
                f"{no_recompute:g}h ({saved_by}); model state {f(state_inc)} {unit} per layer"
            )
            lines += _wrap(text, first="  - ")
            text = (
                f"derived from the measured graph (replacing the plan's fitted a_rep and c0): "
                f"stored activations {per_token:.2f}h per token per layer; layer-independent "
                f"activations and buffers (the depth-0 intercept: logits and loss, embedding "
                f"output, one layer's recomputed working set, K/V and weight shards in flight) "
                f"{f(fixed)} {unit}, where the plan has working set + K/V + logits "
                f"{f(plan_tsp.working_set + plan_tsp.kv_gathered + plan_tsp.logits)} plus the "
                f"fitted c0 {f(plan_tsp.overhead)}"
            )
        else:
            text = (
                f"per layer (the measured increment): {f(act_inc)} {unit} of activations (nothing "
                f"is stored under no_grad), model state {f(state_inc)} {unit}"
            )
        lines += _wrap(text, first="  - ")
    lines += _wrap(
        f"c0 {f(plan_tsp.overhead)} vs none: the plan's fitted constant for the runtime, "
        "allocator and communication buffers; fake tensors have no such overhead, and "
        "op-internal temporaries are not counted",
        first="  - ",
    )
    return lines


def matched_per_token(shape: Any, inputs: Any) -> float:
    """Stored activation elements per token per layer of the plan's selective policy, / h."""

    m = memory_breakdown(shape, inputs, "TSP", inputs.devices, inputs.devices)
    tokens = inputs.micro_batch * inputs.seq_len / inputs.devices
    return m.stored_activations / (shape.layers * tokens * inputs.act_bytes * shape.hidden)


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        return "    " + "  ".join(
            [cells[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(cells[1:], widths[1:])]
        )

    return [line(headers)] + [line(r) for r in rows]
