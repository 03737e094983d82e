"""What tspc raises and warns when its own compile goes wrong (``docs/guarantees.md``).

Errors a user must act on for their model or options are ``TSPConfigError``
(``runtime/errors.py``); the ones here are tspc's own failures: raised under ``strict``, or when
no plain compile can stand in (weights already released), and warned about when one does.
"""

from __future__ import annotations

from tspc.runtime.errors import TSPConfigError, describe_error

__all__ = [
    "FallbackWarning",
    "GatheredWeightsWarning",
    "ModuleRewriteFailed",
    "PartitionerTagError",
    "ReleasedWeightsNeededError",
    "TSPCompileError",
    "TSPConfigError",
    "describe_error",
]

REPORT_HINT = (
    "please report it at the tspc issue tracker with the dump of options={'dump_dir': ...}"
)


class TSPCompileError(RuntimeError):
    """The passes could not handle the model and ``strict`` was requested, or no fallback could
    run the graph."""


class ReleasedWeightsNeededError(TSPCompileError):
    """A graph compiled after tspc released the full weights of sharded parameters would read
    one of them whole and no gather can stand in (``tspc/later_graphs.py``). Kept for callers
    that catch it: such graphs now gather the weights they read whole, per call."""


class PartitionerTagError(TSPCompileError):
    """aot_autograd's partitioner could not honour a tag tspc put on the joint graph (a value
    marked to be recomputed in the backward, or pinned to the backward). The tag is tspc's, so
    the bug is too, whatever torch's own message says."""


class FallbackWarning(UserWarning):
    """tspc could not run part of a graph (one module, or the whole graph) with the TSP
    schedules and ran it another way that gives the same numbers: the warning names the cause
    and what memory it costs."""


class InductorFallbackWarning(FallbackWarning):
    """Inductor failed to generate code for one of tspc's rewritten aot graphs (a bug in
    torch's lowering or codegen): that graph runs the TSP schedules with its local compute
    unfused, as ``inner="aot_eager"`` would (``tspc/inner.py``)."""


class GatheredWeightsWarning(FallbackWarning):
    """A graph compiled after an earlier one sharded and released some weights reads them
    whole: it runs, gathering each from its owners at every call (``tspc/later_graphs.py``).
    The warning names the modules and the bytes each call receives."""


class ModuleRewriteFailed(Exception):
    """Internal: matching or rewriting one module raised. The pipeline runs again from Dynamo's
    graph with that module left out (``tspc/module_isolation.py``); never reaches a user except
    under ``strict``, as the cause of a ``TSPCompileError``."""

    def __init__(self, kind: str, module: str, stage: str, error: BaseException):
        self.kind = kind
        self.module = module
        self.stage = stage  # "match" or "rewrite"
        self.error = error
        super().__init__(f"{stage} of {kind} {module} failed: {describe_error(error)}")

    @property
    def reason(self) -> str:
        """The report entry's reason: what raised, in the user's words."""
        return f"{self.stage} failed: {describe_error(self.error)}"
