"""Parameters of the called module that reach no compiled graph.

Dynamo runs some code of a model outside every graph it hands the backend: a module under
``torch.compiler.disable``, a call it cannot trace — transformers' gradient checkpointing is
one: each checkpointed layer runs eagerly. The parameters that code uses stay plain tensors,
whole on every rank; the result is exact, but two things must still hold:

* **With data parallelism their gradients are averaged over dp.** The graphs install the
  averaging on the parameters they receive; these, no graph receives. Without it each replica
  steps with its own batch's gradient and the replicas drift apart silently.
  ``first_call`` installs it on every parameter of the called module that no graph has
  received yet, at the first call of each graph (a backward comes after the forward, so a
  parameter used eagerly after that graph is covered too; one a later graph receives was
  averaged already, and averaging it again is exact).
* **The user is told.** At the module's next call (the first may still be running graphs that
  take a parameter), the parameters that reached no graph are named once, with the likely
  cause and the fix, as a ``TSPHeldWholeWarning``.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tspc.runtime.compat import outermost_module_call
from tspc.runtime.data_parallel import average_grads_over
from tspc.runtime.dp_shard import whole_over_dp
from tspc.runtime.errors import TSPHeldWholeWarning
from tspc.runtime.group import TSPGroup
from tspc.runtime.tsp_params import tsp_param_of

# An attribute, not a weak set: weakly referenced parameters make ``model.to()`` fail
# (``torch.utils.swap_tensors`` refuses them).
_RECEIVED = "_tspc_in_graph"
_CHECKED = "_tspc_outside_graphs_checked"
_ORIG = "_orig_mod."  # the prefix an OptimizedModule puts before the model's names


def first_call(args: list, params: list[int], group: TSPGroup) -> None:
    """At a graph's first call, before its inputs are replaced: mark the parameters it
    receives (positions ``params`` of ``args``); with data parallelism, average over dp the
    gradients of the called module's parameters that no graph has received; with D > 1,
    name those still outside every graph at the module's next call."""
    for i in params:
        setattr(args[i], _RECEIVED, True)
    entry = outermost_module_call()
    if entry is None:  # a compiled function: no module to look into
        return
    if group.dp_size > 1:
        outside = [p for _, p in outside_graphs(entry)]
        average_grads_over(whole_over_dp(outside), group.dp_name, group.dp_size)
    if group.size > 1 and not getattr(entry, _CHECKED, False):
        setattr(entry, _CHECKED, True)
        handle = None

        def check(module: nn.Module, _args) -> None:
            handle.remove()
            warn_outside_graphs(module, group.size)

        handle = entry.register_forward_pre_hook(torch.compiler.disable(check))


def outside_graphs(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``module``'s trainable parameters that no compiled graph has received (by name)."""
    return [
        (name.removeprefix(_ORIG), p)
        for name, p in module.named_parameters()
        if p.requires_grad
        and not isinstance(p, DTensor)
        and not getattr(p, _RECEIVED, False)
        and tsp_param_of(p) is None  # a stand-in the module holds while it runs
    ]


def warn_outside_graphs(module: nn.Module, world: int) -> str | None:
    """Warn (and return the message) if parameters of ``module`` reached no compiled graph."""
    outside = outside_graphs(module)
    if not outside:
        return None
    total = sum(p.numel() for p in module.parameters())
    n = sum(p.numel() for _, p in outside)
    owners = list(dict.fromkeys(name.rpartition(".")[0] or name for name, _ in outside))
    shown = ", ".join(owners[:4]) + (f" and {len(owners) - 4} more" if len(owners) > 4 else "")
    root = getattr(module, "_orig_mod", module)
    message = (
        f"tspc: {len(outside)} parameters of {type(root).__name__} ({n:,} of its {total:,} "
        f"values) reached no compiled graph in its first call ({shown}): the code that uses "
        "them ran eagerly, outside the graphs Dynamo handed tspc (a graph break: "
        "torch.compiler.disable, activation checkpointing, a call Dynamo cannot trace), or did "
        f"not run. They are whole on each of the {world} ranks and that code is not sharded "
        "(its results are exact). "
    )
    if any(getattr(m, "gradient_checkpointing", False) is True for m in root.modules()):
        message += (
            "transformers' gradient checkpointing runs each checkpointed layer outside the "
            "graph: call model.gradient_checkpointing_disable() and compile with "
            "options={'recompute': 'full'} (tspc's own activation recompute) instead."
        )
    else:
        message += "TORCH_LOGS=graph_breaks shows where Dynamo stopped tracing."
    warnings.warn(message, TSPHeldWholeWarning, stacklevel=2)
    return message
