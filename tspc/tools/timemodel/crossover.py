"""Where TSP wins: the TSP / TP+SP throughput ratio over sequence length x hidden size x D.

Each point traces both schemes at one and two decoder layers (fake tensors, rank 0) and
compares the per-layer step increment, the part of the step the paper's rule is about (the
embedding and LM head are outside it). The model at hidden size h is the 7B's shape scaled:
h/128 heads of 128, MHA, intermediate 4h, 32K vocabulary; one sequence per step (B = 1). The
paper's rule "B·S > 8h" (TSP moves fewer bytes per layer than TP when B·S > 8h, PAPER_NOTES.md)
is checked against the sign of each point: does TSP win exactly where B·S > 8h?
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tspc.tools.shapes import ModelShape
from tspc.tools.timemodel.hardware import Hardware
from tspc.tools.timemodel.predict import predict

SEQS = (4 * 1024, 16 * 1024, 64 * 1024)
HIDDEN = (2048, 4096)
DEVICES = (4, 8)
QUICK = ((2048, 4096, 16384, 65536), (1024,), (4,))


@dataclass
class Point:
    seq: int
    hidden: int
    devices: int
    tsp_layer_s: float
    tp_sp_layer_s: float

    @property
    def ratio(self) -> float:
        """TSP throughput over TP+SP's, per layer (> 1: TSP is faster)."""
        return self.tp_sp_layer_s / self.tsp_layer_s

    @property
    def rule_says_tsp(self) -> bool:
        return self.seq > 8 * self.hidden


def shape_for(hidden: int) -> ModelShape:
    heads = hidden // 128
    return ModelShape(
        hidden=hidden, layers=32, heads=heads, kv_heads=heads, intermediate=4 * hidden,
        vocab=32000, name=f"h={hidden}",
    )  # fmt: skip


def crossover_table(hw: Hardware, quick: bool = False, dtype: str = "bf16") -> list[Point]:
    seqs, hiddens, devices = QUICK if quick else (SEQS, HIDDEN, DEVICES)
    rows = []
    for d in devices:
        for h in hiddens:
            for s in seqs:
                res = predict(
                    shape_for(h), hw, devices=d, seq_len=s, dtype=dtype,
                    schemes=("tsp", "tp_sp"), recompute=("none",),
                )  # fmt: skip
                by = {r.scheme: r for r in res}
                rows.append(Point(s, h, d, by["tsp"].per_layer.step, by["tp_sp"].per_layer.step))
    return rows


def format_crossover(rows: list[Point], hw: Hardware) -> str:
    lines = [
        f"TSP / TP+SP throughput per layer on {hw.name} (B = 1, bf16, no recompute)",
        f"  {'D':>2} {'h':>5} {'S':>7} {'8h':>6} {'ratio':>6}  {'TSP wins':>8}  rule B·S>8h",
    ]
    agree = 0
    for p in rows:
        wins = p.ratio > 1
        agree += wins == p.rule_says_tsp
        lines.append(
            f"  {p.devices:>2} {p.hidden:>5} {p.seq:>7} {8 * p.hidden:>6} {p.ratio:6.2f}  "
            f"{'yes' if wins else 'no':>8}  {'yes' if p.rule_says_tsp else 'no'}"
            f"{'' if wins == p.rule_says_tsp else '  (disagrees)'}"
        )
    lines.append(f"  the rule agrees with the model at {agree} of {len(rows)} points")
    return "\n".join(lines)


def plot_crossover(rows: list[Point], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ImportError("--png needs matplotlib: pip install 'matplotlib>=3.8'") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for d in sorted({p.devices for p in rows}):
        for h in sorted({p.hidden for p in rows}):
            pts = [p for p in rows if p.devices == d and p.hidden == h]
            ax.plot([p.seq / (8 * h) for p in pts], [p.ratio for p in pts], marker="o",
                    label=f"D={d}, h={h}")  # fmt: skip
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.axvline(1.0, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("B·S / 8h")
    ax.set_ylabel("TSP / TP+SP throughput (per layer)")
    ax.legend(fontsize=8)
    ax.grid(True, which="both", linewidth=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
