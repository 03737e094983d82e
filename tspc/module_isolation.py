"""Failures stay local: a module whose match or rewrite raises is skipped alone.

A rewrite changes the graph in many places (new nodes for every head group or ring step, the
users of the module's output rewired, the old region erased) and declares the weights' slices
in the shard store; one that raises half-way leaves both in a state no later pass can trust.
Undoing that piecewise would need every rewrite to journal its edits. Instead the pipeline is
*transactional by reconstruction*: each attempt runs on a fresh copy of Dynamo's graph and on a
scratch copy of the shard store (``tspc/pipeline.py``'s ``run_pipeline``); when a module's
rewrite raises, the attempt is dropped whole and the pipeline runs again from Dynamo's graph with
that module left out, so the module stays exactly as the sequence pass leaves any module the
schedules do not rewrite (its weights whole on every rank), and every other module is rewritten
as it would have been. Only a successful attempt's declarations reach the store.

The price is one more run of the passes per failing module, on the failure path only; after
``MAX_FAILURES_PER_KIND`` failures of one kind (every layer failing the same way, most likely)
the remaining modules of that kind are left out without being tried, so a compile runs the
passes at most ``2 * MAX_FAILURES_PER_KIND + 1`` times. A failure while *matching* needs no
second run: matching changes nothing in the graph, so the matcher reports that candidate as
skipped and goes on (``passes/match_attention.py``'s ``failed``).

Every rank runs the same passes on the same graph, so every rank leaves out the same modules
(a rewrite never reads rank-local state to decide what to do; the rank only picks a shard).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from tspc.runtime.errors import TSPConfigError, describe_error

from .errors import REPORT_HINT, FallbackWarning, ModuleRewriteFailed

log = logging.getLogger("tspc")

MAX_FAILURES_PER_KIND = 3

T = TypeVar("T")


@dataclass
class ModuleFailures:
    """The modules one compile leaves out of the TSP rewrites because theirs raised."""

    graph_id: int = 0
    failed: dict[tuple[str, str], str] = field(default_factory=dict)  # (kind, module) -> reason
    given_up: dict[str, str] = field(default_factory=dict)  # kind -> why the rest is not tried

    def excluded(self, kind: str, module: str) -> str | None:
        """Why ``module`` is not rewritten this attempt, or None (it is tried)."""
        return self.failed.get((kind, module)) or self.given_up.get(kind)

    def add(self, failure: ModuleRewriteFailed) -> None:
        self.failed[(failure.kind, failure.module)] = failure.reason
        warn_module_skipped(self.graph_id, failure.kind, failure.module, failure.error)
        same_kind = [k for k in self.failed if k[0] == failure.kind]
        if len(same_kind) >= MAX_FAILURES_PER_KIND:
            first = self.failed[same_kind[0]]
            self.given_up[failure.kind] = (
                f"not attempted: {len(same_kind)} {failure.kind} rewrites of this graph "
                f"failed (the first: {first})"
            )


def warn_module_skipped(graph_id: int, kind: str, module: str, error: BaseException) -> None:
    """The warning every rank gives when one module is left out because tspc raised on it."""
    warnings.warn(
        f"tspc: graph {graph_id}: the TSP schedule for {kind} '{module}' failed "
        f"({describe_error(error)}); that {kind} runs as the sequence pass leaves it (its "
        "weights whole on every rank, so not 1/D of its memory) and the rest of the graph "
        f"still runs TSP. The numbers are unchanged. This is a tspc bug: {REPORT_HINT}; "
        "options={'strict': True} makes it an error.",
        FallbackWarning,
        stacklevel=2,
    )


def rewrite_guarded(kind: str, module: str, rewrite: Callable[[], T]) -> T:
    """``rewrite()``, with any exception but a configuration error raised as the failure of
    this one module (the pipeline then runs again without it)."""
    try:
        return rewrite()
    except TSPConfigError:
        raise
    except Exception as e:
        raise ModuleRewriteFailed(kind, module, "rewrite", e) from e


def run_isolated(attempt: Callable[[ModuleFailures], T], strict: bool, graph_id: int) -> T:
    """``attempt(failures)`` until one runs through, each time with the modules that raised so
    far left out. Under ``strict`` the first failure is raised (the backend makes it a
    ``TSPCompileError`` naming the module)."""
    failures = ModuleFailures(graph_id)
    while True:
        try:
            return attempt(failures)
        except ModuleRewriteFailed as f:
            if strict:
                raise
            log.warning("tspc: graph %d: %s; running the passes again without it", graph_id, f)
            failures.add(f)
