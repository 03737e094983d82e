"""Step time, tokens/s, MFU and exposed communication of each scheme, from its recorded graphs.

Each scheme is traced at two depths (``layers`` and ``layers + 1`` decoder layers), both traces
are replayed on the hardware, and every figure is extrapolated linearly to the model's depth
(the step is the same program with one more layer; see ``tspc/tools/measure.py``). The exposed
communication per layer is the increment between the two depths.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tspc.tools.timemodel.hardware import Hardware
from tspc.tools.timemodel.replay import Replay, replay
from tspc.tools.timemodel.schemes import LABELS, trace_step

# The paper's throughput at 1,024 GPUs, 7B, 128K tokens, D = 8 (shared/PAPER_NOTES.md) [reported]
PAPER_7B_128K = {"TSP": 173e6, "TP+SP (post)": 86e6, "TP+SP (quoted)": 66.3e6}
PAPER_GPUS = 1024


@dataclass
class SchemeTime:
    scheme: str
    recompute: str
    step: Replay  # at the model's full depth (extrapolated)
    per_layer: Replay  # the increment of one decoder layer
    tokens: int  # B*S processed by the D ranks of one group per step
    devices: int
    model_flops: float  # of the step, all D ranks together (6N T + attention), for the MFU
    peak: float  # FLOP/s of one device

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second of one group of D devices."""
        return self.tokens / self.step.step

    @property
    def tokens_per_s_per_device(self) -> float:
        return self.tokens_per_s / self.devices

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.devices * self.step.step * self.peak)


def model_flops(shape: Any, batch: int, seq: int) -> float:
    """Training FLOPs of one step: 6 per parameter per token for the layers and the LM head, and
    3 x the causal attention's forward 2·B·S²·h per layer (half of 4·B·S²·h)."""
    params = shape.layers * shape.layer_params + shape.vocab * shape.hidden
    tokens = batch * seq
    attention = 3 * 2.0 * batch * seq * seq * shape.q_width * shape.layers
    return 6.0 * params * tokens + attention


def predict(
    shape: Any,
    hw: Hardware,
    *,
    devices: int,
    seq_len: int,
    micro_batch: int = 1,
    dtype: str = "bf16",
    schemes: Sequence[str] = ("tsp", "tp_sp"),
    recompute: Sequence[str] = ("none",),
    layers: int = 1,
    progress: Callable[[str], None] | None = None,
) -> list[SchemeTime]:
    """Every scheme under every recompute policy (module doc)."""
    depths = (layers, layers + 1) if layers + 1 < shape.layers else (shape.layers,)
    out = []
    for policy in recompute:
        for scheme in schemes:
            replays = []
            for depth in depths:
                t0 = time.perf_counter()
                ops = trace_step(
                    shape, scheme, devices=devices, seq_len=seq_len, micro_batch=micro_batch,
                    dtype=dtype, layers=depth, recompute=policy,
                )  # fmt: skip
                replays.append(replay(ops, hw))
                if progress:
                    progress(
                        f"{LABELS[scheme]}, recompute={policy}, {depth} layer(s): {len(ops)} ops "
                        f"traced in {time.perf_counter() - t0:.0f} s"
                    )
            if len(replays) == 1:
                full = per_layer = replays[0]
            else:
                full = replays[0].scaled(replays[1], shape.layers - depths[0])
                per_layer = _difference(replays[1], replays[0])
            out.append(
                SchemeTime(
                    scheme=scheme,
                    recompute=policy,
                    step=full,
                    per_layer=per_layer,
                    tokens=micro_batch * seq_len,
                    devices=devices,
                    model_flops=model_flops(shape, micro_batch, seq_len),
                    peak=hw.flops(dtype),
                )
            )
    return out


def _difference(b: Replay, a: Replay) -> Replay:
    return Replay(
        step=b.step - a.step,
        compute=b.compute - a.compute,
        communication=b.communication - a.communication,
        exposed=b.exposed - a.exposed,
        flops=b.flops - a.flops,
        collectives=b.collectives - a.collectives,
    )


def format_times(
    results: Sequence[SchemeTime], hw: Hardware, shape: Any, seq_len: int, seconds: float
) -> str:
    """The ``--time`` section: one row per scheme and recompute policy, ratios to TP+SP."""
    lines = ["", f"Time model on {hw.name} ({hw.source or 'hardware file'})"]
    header = (
        f"  {'scheme':<10} {'recompute':<9} {'step s':>9} {'tok/s/GPU':>10} "
        f"{'MFU':>6} {'exposed/layer ms':>17} {'comm/layer ms':>14} {'vs TP+SP':>9}"
    )
    lines.append(header)
    base = {r.recompute: r for r in results if r.scheme == "tp_sp"}
    for r in results:
        ref = base.get(r.recompute)
        ratio = f"{ref.step.step / r.step.step:.2f}x" if ref else "-"
        lines.append(
            f"  {LABELS[r.scheme]:<10} {r.recompute:<9} {r.step.step:9.3f} "
            f"{r.tokens_per_s_per_device:10.0f} {r.mfu:6.1%} "
            f"{1e3 * r.per_layer.exposed:17.2f} {1e3 * r.per_layer.communication:14.2f} "
            f"{ratio:>9}"
        )
    same = shape.hidden == 4096 and shape.layers == 32 and seq_len == 128 * 1024
    if same:
        lines.append(
            f"  at {PAPER_GPUS} GPUs (x {PAPER_GPUS} / D groups, data parallel, its gradient "
            "reduction not modelled):"
        )
        for r in results:
            if r.scheme in ("tsp", "tp_sp"):
                lines.append(
                    f"    {LABELS[r.scheme]:<6} recompute={r.recompute:<5} "
                    f"{r.tokens_per_s_per_device * PAPER_GPUS / 1e6:8.1f} M tokens/s"
                )
        paper = ", ".join(f"{k} {v / 1e6:.1f} M" for k, v in PAPER_7B_128K.items())
        lines.append(f"    paper (reported): {paper} tokens/s (TSP / TP+SP = 2.0x-2.6x)")
    lines.append(
        f"  ({seconds:.0f} s; per-rank traces of rank 0 on fake tensors, two depths each, "
        "extrapolated; optimizer step not included)"
    )
    return "\n".join(lines)


def to_json(results: Sequence[SchemeTime]) -> list[dict[str, Any]]:
    return [
        {
            "scheme": r.scheme,
            "recompute": r.recompute,
            "step_s": r.step.step,
            "compute_s": r.step.compute,
            "communication_s": r.step.communication,
            "exposed_s": r.step.exposed,
            "exposed_per_layer_s": r.per_layer.exposed,
            "tokens_per_s_per_device": r.tokens_per_s_per_device,
            "mfu": r.mfu,
        }
        for r in results
    ]
