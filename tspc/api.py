"""Thin helpers over torch's own training machinery.

After the first call of a ``backend="tsp"`` model its parameters are DTensors on the TSP axis
(``runtime/tsp_params.py``), so the ordinary idioms work unchanged: ``model.parameters()`` for
an optimizer, ``torch.nn.utils.clip_grad_norm_``, ``model.state_dict()`` and
``torch.distributed.checkpoint``. What is here only names those idioms for old callers:

* ``parameters(model)`` — ``model.parameters()`` of the original model.
* ``state_dict(model)`` — the full, unsharded state dict on every rank (a collective; meant for
  tests and small models: for checkpoints use ``torch.distributed.checkpoint``).
* ``load_state_dict(model, state_dict)`` — ``model.load_state_dict``: full tensors are cut to
  each rank's slices locally, DTensors of any placement are redistributed.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor


def _root(model: nn.Module) -> nn.Module:
    return getattr(model, "_orig_mod", model)


def named_parameters(model: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """``model.named_parameters()`` of the original model (DTensors once it has run)."""
    return _root(model).named_parameters()


def parameters(model: nn.Module) -> Iterator[nn.Parameter]:
    """``model.parameters()`` of the original model (DTensors once it has run)."""
    return _root(model).parameters()


def state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The full state dict — same keys and shapes as the model had before compiling — on every
    rank. A collective over the TSP group: call it on every rank."""
    out = {}
    for key, t in _root(model).state_dict().items():
        out[key] = t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()
    return out


def load_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor], strict: bool = True):
    """``model.load_state_dict(state)``: full tensors or DTensors of any placement."""
    return _root(model).load_state_dict(dict(state), strict=strict)
