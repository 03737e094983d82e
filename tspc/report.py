"""The match report: what every compile matched, skipped (and why) and will communicate.

Silent non-application is the failure this guards against: every attention (SDPA call) and every
gated-MLP candidate appears here by module name, matched or skipped with the reason.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass, field
from typing import Any

log = logging.getLogger("tspc")


@dataclass
class ModuleEntry:
    kind: str  # "attention" | "mlp"
    module: str
    status: str  # "matched" | "skipped"
    reason: str = ""
    details: dict[str, Any] = field(default_factory=dict)


@dataclass
class CompileReport:
    rank: int
    world: int
    # the sequence length this graph was compiled at
    seq_len: int | None = None
    # the program compiled for every length (``dynamic_seq``): which lengths it serves, e.g.
    # "every multiple of 4 up to 4096"; later lengths it runs make no report of their own
    serves_lengths: str = ""
    # the length the ranks ran: seq_len padded to a multiple of 2D when it does not split
    # into 2D zigzag chunks (None when the sequence was not sharded)
    padded_seq_len: int | None = None
    # what actually ran: "tsp", "sp", "replicated", or "fallback" (tspc's compile raised and a
    # plain compile of the graph runs: ``fallbacks`` says why, ``tspc/fallback.py``)
    level: str = "tsp"
    entries: list[ModuleEntry] = field(default_factory=list)
    # every attention- and MLP-like computation the census found (``passes/census.py``), each
    # as {kind, module, form, node}; every one has an entry (matched or skipped) of its module
    census: list[dict] = field(default_factory=list)
    sharded_inputs: list[tuple[str, int]] = field(default_factory=list)
    gathers: list[dict] = field(default_factory=list)
    # what each explicit attention mask meant (classify_mask.MaskReport): recognised, kind
    # ("causal", "sliding_window", "documents", "sliding_window+documents", or "dense_rows"),
    # window, documents (where the ids came from), detail
    masks: list[dict] = field(default_factory=list)
    predicted_recv_bytes: dict[str, int] = field(default_factory=dict)  # per module
    # weights an earlier graph sharded and released that this graph reads whole: gathered from
    # their owners at every call (``tspc/later_graphs.py``): weight, module, recv_bytes per call
    gathered_weights: list[dict] = field(default_factory=list)
    fallbacks: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    graph_id: int = 0
    # why this graph was compiled (``tspc/compiles.py``) and what it cost so far, in seconds:
    # passes, aot+forward, and backward once the first backward compiled it
    compile_reason: str = ""
    compile_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def matched(self) -> list[ModuleEntry]:
        return [e for e in self.entries if e.status == "matched"]

    @property
    def skipped(self) -> list[ModuleEntry]:
        return [e for e in self.entries if e.status == "skipped"]

    def unlisted(self) -> list[dict]:
        """Census items without an entry of their kind and module (none, by construction:
        a test holds the pipeline to it)."""
        listed = {(e.kind, e.module) for e in self.entries}
        return [c for c in self.census if (c["kind"], c["module"]) not in listed]

    def held_whole(self) -> list[str]:
        """One message per module whose weights are held whole on every rank for a reason the
        user can change (another D): the module, the reason and the fix."""
        out = []
        for e in self.entries:
            fix = e.details.get("fix")
            if not fix:
                continue
            full = f"take their full size on each of the {self.world} ranks"
            if e.details.get("held_whole"):  # matched, some of its weights whole
                out.append(
                    f"tspc: {e.kind} {e.module}: {e.details['held_whole']}: they, their "
                    f"gradients and optimizer state {full}. {fix[0].upper()}{fix[1:]}."
                )
            else:
                out.append(
                    f"tspc: {e.kind} {e.module} is not sharded ({e.reason}): its weights, their "
                    f"gradients and optimizer state {full}. To shard it, {fix}."
                )
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d["matched"] = [{"kind": e.kind, "module": e.module} for e in self.matched]
        d["skipped"] = [
            {"kind": e.kind, "module": e.module, "reason": e.reason} for e in self.skipped
        ]
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, default=str)

    def summary(self) -> str:
        lines = [
            f"tspc: graph {self.graph_id} on rank {self.rank}/{self.world}: ran '{self.level}'"
            + (f", sequence length {self.seq_len}" if self.seq_len else "")
            + (
                f" (padded to {self.padded_seq_len})"
                if self.padded_seq_len and self.padded_seq_len != self.seq_len
                else ""
            )
            + (f"; one program for {self.serves_lengths}" if self.serves_lengths else "")
        ]
        if self.compile_reason:
            lines.append(f"  compiled because: {self.compile_reason}")
        for e in self.entries:
            extra = f" ({e.reason})" if e.reason else ""
            lines.append(f"  {e.kind:9s} {e.status:8s} {e.module}{extra}")
            if load := e.details.get("load"):  # runtime.moe.moe_load(), after a forward
                lines.append(
                    f"    expert load: pairs per rank {load['pairs_per_rank']} (max "
                    f"{load['max']}, mean {load['mean']:g}, imbalance {load['imbalance']:.2f})"
                )
        if self.census:
            n_att = sum(c["kind"] == "attention" for c in self.census)
            lines.append(
                f"  census: {n_att} attention-like, {len(self.census) - n_att} MLP-like "
                "computations, each listed above"
            )
        for m in self.masks:
            # what ran: causal / sliding_window / documents (the zigzag kernel), or each rank's
            # rows of the mask ("not recognised")
            state = (
                f"recognised as {m.get('kind', 'causal')}" if m["recognised"] else "not recognised"
            )
            lines.append(f"  mask ({m['module'] or m['sdpa']}): {state}: {m['detail']}")
        for f in self.fallbacks:
            lines.append(f"  fallback: {f}")
        for note in self.notes:
            lines.append(f"  note: {note}")
        for w in self.gathered_weights:
            lines.append(f"  gathered per call: {w['weight']} ({w['recv_bytes']} bytes received)")
        if self.gathers:
            lines.append(f"  sequence gathers: {len(self.gathers)}")
            for gth in self.gathers:
                lines.append(f"    {gth['value']} for {gth['op']}: {gth['reason']}")
        return "\n".join(lines)


REPORTS: list[CompileReport] = []
"""Reports of the latest compiles in this process (at most ``KEEP_REPORTS``), oldest first."""

KEEP_REPORTS = 256


def remember(report: CompileReport) -> None:
    """Add ``report`` to ``REPORTS``, dropping the oldest beyond ``KEEP_REPORTS``: a process
    that recompiles for hours must not grow without bound."""
    REPORTS.append(report)
    del REPORTS[:-KEEP_REPORTS]


def forget_report(graph_id: int) -> None:
    """Drop the report of graph ``graph_id`` (a compile that failed after writing it: the
    fallback's report takes its place)."""
    REPORTS[:] = [r for r in REPORTS if r.graph_id != graph_id]


def reports_after(graph_id: int) -> list[CompileReport]:
    """The reports of the graphs compiled after graph ``graph_id`` (ids only grow)."""
    return [r for r in REPORTS if r.graph_id > graph_id]


def last_graph_id() -> int:
    return REPORTS[-1].graph_id if REPORTS else -1


def last_report() -> CompileReport | None:
    return REPORTS[-1] if REPORTS else None
