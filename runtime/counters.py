"""Communication accounting: calls and bytes per kind and per tag (layer), on this rank.

Every collective the runtime issues is recorded here when it starts, so a test can compare what
really moved against the schedule's prediction (``PAPER_NOTES.md``'s formulas).

Bytes are *logical payload* bytes, the same convention as the formulas, independent of how the
backend implements a collective:

* broadcast — a receiver receives the buffer once; the source receives nothing.
* all_gather — every rank receives the D-1 other parts.
* reduce_scatter — every rank receives the D-1 contributions to its own part.
* reduce — the destination receives D-1 contributions; the others receive nothing.
* ring (point-to-point hop) — the receiver receives the buffer once.
* all_reduce — 2(D-1)/D of the buffer (a bandwidth-optimal reduce-scatter + all-gather).
* all_to_all (decoding's eager merge, ``runtime/decode.py``; no graph has one) — every rank
  receives the D-1 parts the others send it.

``sent`` mirrors ``recv`` from the sender's side. Sums (reduce, reduce_scatter, all_reduce
with op "sum") of fp16/bf16 values move fp32: the runtime reduces 16-bit gradients in fp32
(``runtime/comm.py``'s accumulation copy), so their bytes are twice the values' dtype.

This is the one table of those rules (``message_bytes``, ``received_and_sent``): the runtime's
counters apply it to the buffers it really sends, the graph analysis of ``tspc dump`` to the
fake arguments of a rewritten graph. The planner's per-layer figures are the paper's formulas
(``PAPER_NOTES.md``), the independent reference the tests hold both against.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field

import torch

KINDS = ("broadcast", "all_gather", "ring", "reduce", "reduce_scatter", "all_reduce")
_SUMS = ("reduce", "reduce_scatter", "all_reduce")


def wire_dtype(kind: str, dtype: torch.dtype, op: str = "sum") -> torch.dtype:
    """The dtype a collective moves values of ``dtype`` in (16-bit sums travel as fp32)."""
    if kind in _SUMS and op == "sum" and dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return dtype


def message_bytes(kind: str, numel: int, dtype: torch.dtype, world: int, op: str = "sum") -> int:
    """Bytes of one rank's message: the buffer (broadcast, reduce, ring, all_reduce), one
    rank's input (all_gather), or one rank's part of the input (reduce_scatter)."""
    size = torch.empty((), dtype=wire_dtype(kind, dtype, op)).element_size()
    return (numel // world if kind == "reduce_scatter" else numel) * size


def received_and_sent(kind: str, message: int, world: int, is_root: bool = False) -> tuple:
    """(received, sent) bytes of one rank for one collective of ``message`` bytes; ``is_root``:
    this rank is the broadcast's source or the reduce's destination."""
    if kind == "broadcast":
        return (0, message) if is_root else (message, 0)
    if kind == "reduce":
        return ((world - 1) * message, 0) if is_root else (0, message)
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (world - 1) * message, (world - 1) * message
    if kind == "ring":
        return message, message
    if kind == "all_reduce":
        both = message * 2 * (world - 1) // world
        return both, both
    raise ValueError(f"unknown collective kind {kind!r}")


@dataclass
class KindCount:
    calls: int = 0
    recv_bytes: int = 0
    sent_bytes: int = 0

    def add(self, recv: int, sent: int) -> None:
        self.calls += 1
        self.recv_bytes += recv
        self.sent_bytes += sent


@dataclass
class CommCounter:
    """Totals per kind, and per (tag, kind) where the tag names the layer that communicated."""

    by_kind: dict[str, KindCount] = field(default_factory=lambda: defaultdict(KindCount))
    by_tag: dict[str, dict[str, KindCount]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(KindCount))
    )
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, kind: str, tag: str, recv: int, sent: int) -> None:
        with self._lock:
            self.by_kind[kind].add(recv, sent)
            self.by_tag[tag][kind].add(recv, sent)

    def reset(self) -> None:
        with self._lock:
            self.by_kind.clear()
            self.by_tag.clear()

    def total_recv(self, tag: str | None = None) -> int:
        src = self.by_kind if tag is None else self.by_tag.get(tag, {})
        return sum(c.recv_bytes for c in src.values())

    def snapshot(self) -> dict:
        """A plain-dict copy, picklable, for reports and for returning from worker processes."""
        with self._lock:
            return {
                "by_kind": {k: vars(v).copy() for k, v in self.by_kind.items()},
                "by_tag": {
                    t: {k: vars(v).copy() for k, v in kinds.items()}
                    for t, kinds in self.by_tag.items()
                },
            }


COUNTER = CommCounter()
"""The process-wide counter that every runtime collective records into."""


def count_collective(
    kind: str, tag: str, sent_buffer: torch.Tensor, world: int, is_root: bool = False
) -> None:
    """Count the collective in ``COUNTER`` by the buffer that really travels (one rank's message:
    its dtype is the wire's, an fp32 accumulation copy for 16-bit sums), with this module's one
    table of the rules."""
    message = sent_buffer.numel() * sent_buffer.element_size()
    recv, sent = received_and_sent(kind, message, world, is_root)
    COUNTER.record(kind, tag, recv=recv, sent=sent)
