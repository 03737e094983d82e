"""What tspc compiled, why, and what it cost: one record per compile of a rewritten graph.

tspc compiles a graph when Dynamo hands it one (Dynamo's first trace of a frame, or a Dynamo
recompile: a guard failed) and, for a graph Dynamo traced with symbolic sizes, once per new
concrete shape at its first call (the passes bake the local sequence length into shapes; see
``tspc/backend.py``). Dynamo's own counters and ``TORCH_LOGS=recompiles`` see only the first
kind, so tspc counts and logs both:

* ``EVENTS`` / ``events()``: the records of this process (bounded, oldest first);
* ``torch._dynamo.utils.counters["tspc"]``: ``compiles`` and one ``reason:<kind>`` count per
  kind of reason (and, with ``dynamic_seq``, ``runs_without_compile``: new shapes that a program
  compiled for every length ran), next to Dynamo's own ``counters["stats"]`` (cleared with them by
  ``torch.compiler.reset()`` callers that clear counters; ``events()`` is tspc's own);
* the logger ``tspc.compiles`` (this module's name) logs one line per compile at INFO:
  ``TORCH_LOGS="tspc.compiles"`` (or ``TORCH_LOGS="tspc"`` for all of tspc's INFO lines) turns
  it on with torch's format and rank prefix. torch 2.13 parses ``TORCH_LOGS`` when torch is
  imported and accepts only its own registered names or importable module names there, so a
  ``TORCH_LOGS`` *artifact* name of tspc's own would make ``import torch`` fail; a module name
  is the convention that works. ``torch._logging.set_logs(modules={"tspc.compiles":
  logging.INFO})`` does the same from code.
"""

from __future__ import annotations

import functools
import gc
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch.fx.node import map_arg

from tspc.runtime.compat import (
    current_dynamo_compile_id,
    dynamo_counters,
    global_state_snapshot,
)

log = logging.getLogger(__name__)

# The kinds of reason (the ``reason:<kind>`` counters): a graph Dynamo traced with static
# shapes, the first shape of a graph Dynamo traced with symbolic shapes, a new shape of such a
# graph, a new value of a 0-d input whose value the graph bakes in (a norm's eps read with
# ``.item()`` under dynamic shapes).
NEW_GRAPH = "new_dynamo_graph"
NEW_SYMBOLIC_GRAPH = "new_dynamo_graph_symbolic"
NEW_SHAPE = "new_shape"
NEW_BAKED_VALUE = "new_baked_value"


@dataclass
class CompileEvent:
    """One compile of one rewritten graph on this rank."""

    graph_id: int  # the report's graph id (``CompileReport.graph_id``)
    kind: str  # one of the kinds above
    reason: str  # in words, with the sizes that changed
    dynamo_compile_id: str | None  # Dynamo's "frame/attempt" id ("0/1" is frame 0's recompile)
    seconds: dict[str, float] = field(default_factory=dict)  # passes, inner (forward)

    def line(self) -> str:
        cost = ", ".join(f"{k} {v:.2f} s" for k, v in self.seconds.items())
        return (
            f"tspc: compile of graph {self.graph_id} (Dynamo {self.dynamo_compile_id or '-'}): "
            f"{self.reason}" + (f"; {cost}" if cost else "")
        )


EVENTS: list[CompileEvent] = []
KEEP_EVENTS = 256


def dynamo_compile_id() -> str | None:
    cid = current_dynamo_compile_id()
    return None if cid is None else str(cid)


def record(event: CompileEvent) -> None:
    EVENTS.append(event)
    del EVENTS[:-KEEP_EVENTS]
    c = dynamo_counters()["tspc"]
    c["compiles"] += 1
    c[f"reason:{event.kind}"] += 1
    log.info("%s", event.line())


def count_family_run() -> None:
    """A new shape that a program compiled for every length of its family ran, with no
    compile (``tspc/length_family.py``): ``counters["tspc"]["runs_without_compile"]``."""
    dynamo_counters()["tspc"]["runs_without_compile"] += 1


def events(after_graph: int = -1) -> list[CompileEvent]:
    """This process's compile records of graphs with an id above ``after_graph``."""
    return [e for e in EVENTS if e.graph_id > after_graph]


def describe(value: Any) -> str:
    if isinstance(value, tuple):
        return "[" + ", ".join(str(v) for v in value) + "]"
    return str(value)


def shape_change(
    key: tuple, compiled: list[tuple], names: list[str], baked: set[int]
) -> tuple[str, str]:
    """The kind and the words of why a symbolic graph compiles again for the shape ``key``:
    which inputs differ from the shape compiled most recently (``compiled``, oldest first)."""
    if not compiled:
        return NEW_SYMBOLIC_GRAPH, "first call of a graph Dynamo traced with symbolic shapes"
    last = compiled[-1]
    changed = [(i, old, new) for i, (old, new) in enumerate(zip(last, key)) if old != new]
    kind = NEW_BAKED_VALUE if changed and all(i in baked for i, _, _ in changed) else NEW_SHAPE
    tensors = [c for c in changed if isinstance(c[2], tuple) or c[0] in baked]
    changed = tensors or changed  # a size also passed as an int input says nothing more
    parts = [f"{names[i]} {describe(new)} (was {describe(old)})" for i, old, new in changed[:4]]
    more = f" and {len(changed) - 4} more inputs" if len(changed) > 4 else ""
    return kind, (
        f"new {'value' if kind == NEW_BAKED_VALUE else 'shape'}: {', '.join(parts)}{more}; "
        f"{len(compiled)} shape{'s' * (len(compiled) != 1)} of this graph compiled before"
    )


def shape_key(args: tuple, baked: set[int]) -> tuple:
    """What a compiled rewritten graph is specific to: every tensor input's shape, the value of
    the 0-d inputs whose value the graph bakes in, and every int input."""
    return tuple(
        (a.item() if i in baked and a.dim() == 0 else tuple(a.shape))
        if isinstance(a, torch.Tensor)
        else (a if isinstance(a, int) else None)
        for i, a in enumerate(args)
    )


# --------------------------------------------------------------------------- reuse across traces


def graph_signature(gm: fx.GraphModule, example_inputs: list[Any]) -> tuple | None:
    """What a Dynamo graph computes for these inputs, independent of node names: every node's
    op, target and arguments (inputs named by Dynamo's source names, other nodes by position),
    and each used input's shape, stride, dtype, device and ``requires_grad``. None for a graph
    that holds tensor constants of its own (their values are not part of the signature).

    The graph Dynamo traced with static shapes at the first length and its symbolic graph
    specialised to that same length (``passes/specialize.py``) have the same signature, so the
    second reuses the first's compile instead of compiling that length again."""
    names: dict[fx.Node, Any] = {}
    nodes = []
    inputs = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n, ex in zip(placeholders, example_inputs):
        if not n.users:
            continue
        names[n] = ("input", n.name)
        if isinstance(ex, torch.Tensor):
            meta = (tuple(ex.shape), ex.stride(), ex.dtype, ex.device, ex.requires_grad)
        else:
            meta = (type(ex).__name__, ex if isinstance(ex, (int, float, bool)) else None)
        inputs.append((n.name, meta))
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            continue
        if n.op == "get_attr" and isinstance(getattr(gm, str(n.target), None), torch.Tensor):
            return None
        names[n] = ("node", len(nodes))
        args = map_arg((n.args, n.kwargs), lambda a: names.get(a, a.name))
        nodes.append((n.op, str(n.target), repr(args)))
    return tuple(inputs), tuple(nodes)


# (signature, group and options) -> (a weak reference to the compiled static graph, its
# placeholders' names, its graph id, the global state it was compiled in). Weak: a graph Dynamo
# drops (``torch.compiler.reset()``, a model that goes away) is not kept alive here and is not
# reused.
STATIC: dict[tuple, tuple[weakref.ref, tuple[str, ...], int, Any]] = {}


def reuse_for(
    signature: tuple | None, names: list[str], key_extra: tuple
) -> tuple[Callable, int] | None:
    """The compiled static graph with this signature, as a function of ``names``'s inputs (a
    symbolic graph's placeholders: its size inputs are dropped), and its graph id."""
    if signature is None:
        return None
    try:
        found = STATIC.get((signature, key_extra))
    except TypeError:  # an unhashable option value
        return None
    fn = found[0]() if found is not None else None
    if fn is None or not found[3].check():  # gone, or grad mode / autocast / ... differ
        return None
    positions = {n: i for i, n in enumerate(names)}
    if not all(n in positions for n in found[1]):
        return None
    order = [positions[n] for n in found[1]]
    return (lambda *args: fn(*(args[i] for i in order))), found[2]


def remember_static(
    signature: tuple | None, key_extra: tuple, fn: Callable, names: list[str], graph_id: int
) -> None:
    """Offer a graph compiled for static shapes to later symbolic graphs (``reuse_for``)."""
    if signature is None:
        return
    for k in [k for k, v in STATIC.items() if v[0]() is None]:
        del STATIC[k]
    try:
        STATIC[(signature, key_extra)] = (
            weakref.ref(fn),
            tuple(names),
            graph_id,
            global_state_snapshot(),
        )
    except TypeError:  # an unhashable option value, or a callable without weak references
        return


def gc_paused(fn: Callable) -> Callable:
    """Run ``fn`` with Python's cyclic garbage collector paused.

    Compiling builds hundreds of thousands of short-lived objects (FX nodes, fake tensors,
    the min-cut partitioner's networkx graph), and each automatic collection also walks the
    large heap that Dynamo and aot_autograd hold at that moment: for a 32-layer model about a
    third of the passes' time and half of the partitioner's went to the collector. The cycles
    made while paused are freed by the next collection after it (torch's distributed
    checkpointing pauses the collector around its state-dict walk for the same reason)."""

    @functools.wraps(fn)
    def paused(*args: Any, **kwargs: Any) -> Any:
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if was_enabled:
                gc.enable()

    return paused
