"""Optimizers over a model tspc compiled: an optimizer built before the model's first call holds
the original parameters, which tspc has since replaced by DTensors (``runtime/tsp_params.py``).

Before each optimizer step, such parameters are swapped for their DTensors (and any state
loaded for them cut to this rank's slices); an optimizer over ``_StridedShard`` DTensors gets
state-dict hooks that hand DCP plain ``Shard`` tensors. torch offers no per-optimizer hook that
could be set without knowing the optimizer, so the step pre-hook is torch's global one — but
only while parameters of a model tspc compiled are alive: ``watch`` installs it at a model's
first call and it is removed when the last such parameter is gone (``hook_installed``), so
importing tspc, or a process after its tspc models are deleted, leaves torch's optimizers alone.
"""

from __future__ import annotations

import weakref

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from .compat import is_strided_shard as _is_strided
from .tsp_params import REGISTRY, TSPParam, _as_plain_shard, _like_param

_OPT_HOOKED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()


class _GlobalHook:
    """The global step pre-hook, held while ``live`` TSPParams exist."""

    def __init__(self) -> None:
        self.handle = None
        self.live = 0
        self.watched: set[int] = set()

    def watch(self, tps) -> None:
        for tp in tps:
            if id(tp) in self.watched:
                continue
            self.watched.add(id(tp))
            self.live += 1
            weakref.finalize(tp, self._gone, id(tp))
        if self.live and self.handle is None:
            self.handle = register_optimizer_step_pre_hook(_check_optimizer)

    def _gone(self, key: int) -> None:
        self.watched.discard(key)
        self.live -= 1
        if self.live == 0 and self.handle is not None:
            self.handle.remove()
            self.handle = None


_HOOK = _GlobalHook()


def watch(tps) -> None:
    """Keep the optimizer step pre-hook installed while the parameters of ``tps`` live."""
    _HOOK.watch(tps)


def hook_installed() -> bool:
    return _HOOK.handle is not None


class OptimizerParameterError(RuntimeError):
    """An optimizer holds a parameter tspc has since replaced, with state that does not fit."""


def _check_optimizer(opt: torch.optim.Optimizer, args, kwargs) -> None:
    """Before every optimizer step: a parameter that tspc replaced by its DTensor (the
    optimizer was built before the model's first call) is swapped for the DTensor, which is
    where the gradients now land, and its state (a checkpoint loaded before the first call)
    is cut to this rank's slices alongside. State that cannot be matched to the parameter
    raises: stepping would be silently wrong."""
    for group in opt.param_groups:
        params = group["params"]
        for i, p in enumerate(params):
            tp = REGISTRY.get(p)
            if tp is None or p is tp.dparam:
                continue
            state = opt.state.pop(p, None)
            if state:
                opt.state[tp.dparam] = {k: _state_like(v, p, tp, opt) for k, v in state.items()}
            params[i] = tp.dparam
    if any(_is_strided(pl) for tp in _tps_of(opt) for pl in tp.dparam.placements):
        _add_optimizer_hooks(opt)


def _state_like(v, p: torch.Tensor, tp: TSPParam, opt: torch.optim.Optimizer):
    if not isinstance(v, torch.Tensor) or isinstance(v, DTensor) or v.dim() == 0:
        return v
    if tuple(v.shape) != tuple(p.shape):
        raise OptimizerParameterError(
            f"tspc: {type(opt).__name__} holds state of shape {tuple(v.shape)} for a parameter "
            f"of shape {tuple(p.shape)} that tspc replaced by its DTensor after the model's "
            "first call; build the optimizer from model.parameters() after the first call"
        )
    return _like_param(v, tp, keep_dtype=True)


def _tps_of(opt: torch.optim.Optimizer) -> list[TSPParam]:
    return [tp for g in opt.param_groups for p in g["params"] if (tp := REGISTRY.get(p))]


def _add_optimizer_hooks(opt: torch.optim.Optimizer) -> None:
    if opt in _OPT_HOOKED:
        return
    _OPT_HOOKED.add(opt)

    def post(optimizer, state_dict):
        for st in state_dict["state"].values():
            for k, v in list(st.items()):
                if isinstance(v, DTensor):
                    st[k] = _as_plain_shard(v)
        return state_dict

    def pre(optimizer, state_dict):
        ids = [p for g in optimizer.param_groups for p in g["params"]]
        for idx, st in state_dict["state"].items():
            p = ids[idx] if isinstance(idx, int) and idx < len(ids) else None
            tp = REGISTRY.get(p) if p is not None else None
            if tp is None:
                continue
            for k, v in list(st.items()):
                if isinstance(v, DTensor) and v.shape == tp.dparam.shape:
                    st[k] = _like_param(v, tp, keep_dtype=True)
        return state_dict

    opt.register_state_dict_post_hook(post)
    opt.register_load_state_dict_pre_hook(pre)
