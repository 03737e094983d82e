"""Fake values of tspc's own opaque callables, for ``propagate_shapes`` (``passes/analyse.py``).

``VALUE_RULES`` maps a call target to ``rule(*args, **kwargs)``, which gets the fake inputs and
returns the output's fake value without running the target: for callables whose Python body is
costly on fake tensors (the MLP ring runs its whole ring). aot_autograd still runs the real body
when it traces the graph. A plain table, read by the propagation: no module registers into it
on import.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tspc.runtime.ring_mlp import ring_mlp


def ring_mlp_value(x, w_in, b_in, w_down, chain, orient, *rest, **options):
    """The ring's output metadata: ``x``'s leading dimensions and the down projection's
    output features, contiguous, in ``x``'s dtype (the ring adds matmul results)."""
    out = x.new_empty((*x.shape[:-1], w_down.shape[1 if orient[-1] == "t" else 0]))
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (x, *w_in, *b_in, w_down)
    )
    # not a leaf when it needs a gradient: the model may add into it in place (Llama-4 adds
    # its routed experts into the shared expert's output), which autograd refuses on a leaf
    return out.requires_grad_(True).clone() if needs_grad else out


VALUE_RULES: dict[Any, Callable[..., Any]] = {ring_mlp: ring_mlp_value}
