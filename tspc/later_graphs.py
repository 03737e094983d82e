"""A later graph never ends the run: whole weights it reads are gathered per call.

An earlier graph sharded some weights and released their full tensors; a graph compiled later
(a new length whose mask the model builds differently, eval code after training code, a graph
break, a level below 'tsp', or a plain compile standing in for a failed one) may read one of
them whole. It runs on the shards anyway: ``plan_gathers`` lists those inputs at compile time,
reports them (the weight, its module, the bytes each call receives) and warns once per graph;
``gather_inputs`` replaces, at every call, each one's storage-less stand-in by the whole weight
gathered from its owners (``runtime/gather_weights.py``: freed after the call, differentiable
onto this rank's slices).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.fx as fx

from tspc.passes.analyse import analyse
from tspc.runtime.gather_weights import gather_bytes, gather_whole
from tspc.runtime.shard_store import STORE
from tspc.runtime.tsp_params import tsp_param_of

from .errors import GatheredWeightsWarning, ReleasedWeightsNeededError
from .report import CompileReport


def released_inputs(
    gm: fx.GraphModule, example_inputs: list[Any], plain: bool = False
) -> list[int]:
    """Positions of the inputs ``gm`` reads whose full storage tspc already released; with
    ``plain`` (a plain compile, fed the modules' stand-ins) also of a parameter split over the
    data-parallel axis (``data_parallel="fsdp"``), which tspc's graphs get gathered."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    out = []
    for i, (node, ex) in enumerate(zip(placeholders, example_inputs)):
        entry = STORE.get(ex) if isinstance(ex, torch.Tensor) else None
        tp = tsp_param_of(ex) if isinstance(ex, torch.Tensor) else None
        released = entry is not None and entry.released
        if plain and tp is not None and tp.storage_less:
            released = True
        if released and node.users:
            out.append(i)
    return out


def level_cause(report: CompileReport, errors: list[str]) -> str:
    """The graph's level and why it ran that level, in a warning's words."""
    failed = [f"{e.module}: {e.reason}" for e in report.skipped if "failed: " in e.reason]
    why = "; ".join(errors + failed)
    return f"level '{report.level}'" + (f": {why}" if why else "")


def plan_gathers(
    reads: fx.GraphModule,
    dynamo_gm: fx.GraphModule,
    example_inputs: list[Any],
    report: CompileReport,
    why: str,
) -> list[tuple[int, str]]:
    """(position, weight name) of every released weight the graph ``reads`` reads whole
    (``reads`` is the graph that will run: the rewritten one, or Dynamo's for a plain compile);
    recorded in ``report.gathered_weights`` and ``report.notes``, and warned about. ``why``: the
    graph's level and cause, for the warning."""
    positions = released_inputs(reads, example_inputs)
    if not positions:
        return []
    info = analyse(dynamo_gm, example_inputs)  # Dynamo's graph: its placeholders are the inputs
    names = [p.name for p in dynamo_gm.graph.find_nodes(op="placeholder")]
    planned, lines, total = [], [], 0
    for i in positions:
        name = info.inputs[i].fqn or names[i]
        entry = STORE.get(example_inputs[i])
        tp = tsp_param_of(example_inputs[i])
        if tp is not None and tp.dparam.device_mesh.ndim > 1:
            raise ReleasedWeightsNeededError(
                f"tspc: graph {report.graph_id} ({why}) reads the whole weight {name}, which an "
                "earlier graph sharded over a (dp, tsp) mesh and released; gathering it back is "
                "done for the TSP axis alone. Compile with options={'schedules': 'sp'} meanwhile."
            )
        recv, _ = gather_bytes(entry, example_inputs[i].element_size())
        module = name.rsplit(".", 1)[0] if "." in name else name
        report.gathered_weights.append({"weight": name, "module": module, "recv_bytes": recv})
        planned.append((i, name))
        lines.append(f"{module} ({name}: {recv} bytes)")
        total += recv
    report.notes.append(
        f"{len(planned)} released weight(s) gathered whole at every call of this graph, "
        f"{total} bytes received per call on this rank: " + ", ".join(lines)
    )
    warnings.warn(
        f"tspc: graph {report.graph_id} ({why}) reads whole weights that an earlier graph "
        f"sharded and released; it gathers them from their owners at every call ({total} bytes "
        f"received per call on rank {report.rank}, freed after the call): "
        + "; ".join(lines)
        + ". The numbers are unchanged; the report's gathered_weights lists them.",
        GatheredWeightsWarning,
        stacklevel=3,
    )
    return planned


def gather_inputs(flat: list[Any], planned: list[tuple[int, str]]) -> None:
    """Put the whole weight, gathered from its owners, in place of each planned input's
    stand-in in ``flat`` (the graph's arguments of this call)."""
    for i, name in planned:
        tp = tsp_param_of(flat[i])
        if tp is None:
            raise RuntimeError(
                f"tspc: the released weight {name} has no DTensor parameter to gather it from; "
                "this is a bug in tspc"
            )
        flat[i] = gather_whole(tp, name)
