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

``sent`` mirrors ``recv`` from the sender's side.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from dataclasses import dataclass, field

KINDS = ("broadcast", "all_gather", "ring", "reduce", "reduce_scatter", "all_reduce")


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
