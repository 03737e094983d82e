"""Release the full storage of sharded parameters, and guard everything against reading it.

Dynamo passes parameters to the compiled graph as inputs, so slicing shards inside the graph
would save nothing: the full tensors would stay alive on every rank. After the first compiled
call, when the graph reads only shards, each full parameter's storage is resized to zero — the
FSDP technique: the ``nn.Parameter`` object and its metadata stay (Dynamo's guards look only at
metadata, so the compiled graph keeps being reused), its memory goes.

Reading a released storage is a segfault, not an exception. So a released parameter's class
becomes ``ReleasedParameter``, whose ``__torch_function__`` raises a clear error for anything
that would read its data (metadata — shape, dtype, ``.grad`` — stays readable), and the modules
that own one get hooks with the same error for an eager call and for ``state_dict()``.
``tspc.state_dict(model)`` rebuilds the full tensors from the shards. Changing the class makes
Dynamo recompile each graph once (its guards check the parameter's type); the recompile finds
the shards in the store.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .shard_store import STORE

_GUARDED: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # modules that carry the hooks
_permits = [0]  # >0 while tspc's own code walks a guarded module's state_dict
_internal = [0]  # >0 while tspc itself handles released parameters (compiling, running)

# What may be asked of a released parameter: its metadata, never its data.
_METADATA = frozenset(
    """shape dtype device requires_grad is_leaf grad grad_fn layout ndim names is_cuda is_cpu
    is_meta is_sparse is_quantized is_nested is_mkldnn size dim stride numel nelement
    element_size data_ptr untyped_storage _is_view is_contiguous storage_offset __len__
    requires_grad_ register_hook register_post_accumulate_grad_hook _backward_hooks
    _post_accumulate_grad_hooks is_complex is_floating_point __hash__ _version _base
    is_inference __reduce_ex__""".split()
)


def _func_name(func) -> str:
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__", "__delete__"):
        return getattr(getattr(func, "__self__", None), "__name__", name)
    return name


@contextmanager
def tspc_internal() -> Iterator[None]:
    """tspc's own code (the backend, compiled graphs, state_dict) may handle released
    parameters: it never reads their data."""
    _internal[0] += 1
    try:
        yield
    finally:
        _internal[0] -= 1


class ReleasedParameter(nn.Parameter):
    """A parameter whose full storage tspc released after cutting its shards."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _internal[0] or torch.compiler.is_compiling() or _func_name(func) in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        raise ReleasedParameterError(
            f"tspc: {_func_name(func) or func} would read a parameter of shape "
            f"{tuple(args[0].shape) if args and isinstance(args[0], torch.Tensor) else '?'} "
            "whose full storage was released after tspc sharded it (each rank keeps only its "
            "shards). Use tspc.state_dict(model) for the full weights, "
            "tspc.load_state_dict(model, sd) to load, and tspc.parameters(model) for an optimizer."
        )

    def __repr__(self) -> str:
        return f"ReleasedParameter(shape={tuple(self.shape)}, dtype={self.dtype}; see tspc)"

    def __deepcopy__(self, memo):
        raise ReleasedParameterError(
            "tspc: cannot deep-copy a released parameter; build the copy from "
            "tspc.state_dict(model)"
        )


class ReleasedParameterError(RuntimeError):
    pass


def _message(module: nn.Module, what: str) -> str:
    names = [n for n, p in module.named_parameters(recurse=False) if is_released(p)]
    return (
        f"tspc: {what} of {type(module).__name__} reads parameter(s) {names}, whose full storage "
        "was released after tspc sharded them (each rank keeps only its shards). Use the compiled "
        "model, tspc.state_dict(model) for the full state dict, tspc.load_state_dict(model, sd) "
        "to load one, and tspc.parameters(model) for an optimizer."
    )


def _forward_guard(module: nn.Module, args) -> None:
    if torch.compiler.is_compiling():
        return
    raise ReleasedParameterError(_message(module, "calling the module eagerly"))


def _state_dict_guard(module: nn.Module, prefix: str, keep_vars: bool) -> None:
    if _permits[0]:
        return
    raise ReleasedParameterError(_message(module, "state_dict()"))


@contextmanager
def allow_state_dict() -> Iterator[None]:
    """Inside this context the state_dict guard lets tspc's own code walk the module."""
    _permits[0] += 1
    try:
        yield
    finally:
        _permits[0] -= 1


def owner_modules(param: torch.Tensor) -> list[nn.Module]:
    """Modules that hold ``param`` in their ``_parameters`` (found through the GC graph: the
    backend sees parameters, never the module that owns them)."""
    owners: list[nn.Module] = []

    def visit(obj, params_dict):
        is_owner = isinstance(obj, nn.Module) and obj.__dict__.get("_parameters") is params_dict
        if is_owner and not any(o is obj for o in owners):
            owners.append(obj)

    for params_dict in gc.get_referrers(param):
        if not isinstance(params_dict, dict):
            continue
        for holder in gc.get_referrers(params_dict):
            visit(holder, params_dict)
            # an instance __dict__ may stand between the module and its _parameters
            if isinstance(holder, dict) and holder.get("_parameters") is params_dict:
                for module in gc.get_referrers(holder):
                    visit(module, params_dict)
    return owners


def is_released(t: torch.Tensor) -> bool:
    entry = STORE.get(t)
    return bool(entry and entry.released)


def release(params: Iterable[torch.Tensor]) -> int:
    """Free the full storage of sharded parameters; returns the number of bytes released."""
    freed = 0
    for p in params:
        entry = STORE.get(p)
        if entry is None or entry.released:
            continue
        for m in owner_modules(p):
            if m not in _GUARDED:
                m.register_forward_pre_hook(_forward_guard)
                m.register_state_dict_pre_hook(_state_dict_guard)
                _GUARDED.add(m)
        storage = p.untyped_storage()
        freed += storage.nbytes()
        storage.resize_(0)
        p.__class__ = ReleasedParameter
        entry.released = True
        if p.grad is not None:  # a gradient of the full tensor is meaningless now
            p.grad = None
    return freed
