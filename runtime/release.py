"""Release the full storage of a sharded parameter once the module holds its DTensor.

After a module's first compiled call its parameters are DTensors (``runtime/tsp_params.py``);
the original full ``nn.Parameter`` of a sharded weight is no longer held by any module, but the
user may still hold it (an optimizer built before the first call, a variable). Its storage is
freed (the memory TSP exists to save) and its class becomes ``ReleasedParameter``, whose
``__torch_function__`` raises a clear error for anything that would read the freed data
(reading a released storage would be a segfault, not an exception); metadata stays readable.
"""

from __future__ import annotations

import gc
import sys
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from .compat import disable_torch_function_subclass, storage_use_count
from .errors import TSPHeldWholeWarning
from .shard_store import STORE

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
    """tspc's own code (the backend, compiled graphs) may handle released parameters: it never
    reads their data."""
    _internal[0] += 1
    try:
        yield
    finally:
        _internal[0] -= 1


class ReleasedParameter(nn.Parameter):
    """An original full parameter whose storage tspc released after the module took its
    DTensor (which holds this rank's slices)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _internal[0] or torch.compiler.is_compiling() or _func_name(func) in _METADATA:
            with disable_torch_function_subclass():
                return func(*args, **kwargs)
        raise ReleasedParameterError(
            f"tspc: {_func_name(func) or func} would read a parameter of shape "
            f"{tuple(args[0].shape) if args and isinstance(args[0], torch.Tensor) else '?'} "
            "that tspc replaced: after the model's first compiled call its module holds a "
            "DTensor parameter with this rank's slices, and the full tensor was released. Use "
            "model.parameters() / model.named_parameters() (DTensors) and model.state_dict(); "
            ".full_tensor() of a DTensor gathers it."
        )

    def __repr__(self) -> str:
        return f"ReleasedParameter(shape={tuple(self.shape)}, dtype={self.dtype}; see tspc)"

    def __deepcopy__(self, memo):
        raise ReleasedParameterError(
            "tspc: cannot deep-copy a released parameter; the module now holds its DTensor"
        )


class ReleasedParameterError(RuntimeError):
    pass


def owner_modules_of(params: list[torch.Tensor]) -> dict[int, list[nn.Module]]:
    """For each of ``params`` (by id), the modules that hold it in their ``_parameters``.

    The backend sees parameters, never the module that owns them. Adoption runs inside the
    compiled model's call, so the modules on the Python call stack (the compiled module, or a
    model the compiled function was handed) are searched first, with all their submodules;
    only parameters not found there are looked up through the GC graph, which scans the whole
    heap (right after compiling the heap is large: ~1 s per scan for a 32-layer model).

    A parameter also held by a module outside every module on the stack (weights tied to an
    unrelated model object) is replaced only in the modules found."""
    wanted = {id(p) for p in params}
    owners: dict[int, list[nn.Module]] = {id(p): [] for p in params}
    if not params:
        return owners
    _add_owners(modules_on_stack(), wanted, owners)
    missing = [p for p in params if not owners[id(p)]]
    if missing:
        _add_owners(_modules_referring_to(missing), wanted, owners)
    return owners


def _add_owners(roots: Iterable[nn.Module], wanted: set[int], owners) -> None:
    seen: set[int] = set()
    for root in roots:
        for m in root.modules():
            if id(m) in seen:
                continue
            seen.add(id(m))
            for v in m.__dict__.get("_parameters", {}).values():
                if v is not None and id(v) in wanted and not any(o is m for o in owners[id(v)]):
                    owners[id(v)].append(m)


def modules_on_stack() -> list[nn.Module]:
    """The modules that are locals of the frames on the Python stack (the compiled module, or
    a model a compiled function was handed), outermost last."""
    found: dict[int, nn.Module] = {}
    frame = sys._getframe(1)
    while frame is not None:
        for v in frame.f_locals.values():
            if isinstance(v, nn.Module):
                found.setdefault(id(v), v)
        frame = frame.f_back
    return list(found.values())


def _modules_referring_to(params: list[torch.Tensor]) -> list[nn.Module]:
    """Modules whose ``_parameters`` dict holds one of ``params``, through ``gc.get_referrers``
    (parameter -> its ``_parameters`` dict -> the module, or the instance ``__dict__``
    between them): three heap scans for all parameters together."""
    wanted = {id(p) for p in params}
    param_dicts = [
        d
        for d in gc.get_referrers(*params)
        if isinstance(d, dict) and any(id(v) in wanted for v in d.values())
    ]
    if not param_dicts:
        return []
    by_id = {id(d): d for d in param_dicts}
    modules: list[nn.Module] = []
    instance_dicts = []
    for holder in gc.get_referrers(*param_dicts):
        if isinstance(holder, nn.Module) and id(holder.__dict__.get("_parameters")) in by_id:
            modules.append(holder)
        elif isinstance(holder, dict) and id(holder.get("_parameters")) in by_id:
            instance_dicts.append(holder)  # an instance __dict__ between module and dict
    if instance_dicts:
        for holder in gc.get_referrers(*instance_dicts):
            if isinstance(holder, nn.Module) and id(holder.__dict__.get("_parameters")) in by_id:
                modules.append(holder)
    return modules


def owner_modules(param: torch.Tensor) -> list[nn.Module]:
    """Modules that hold ``param`` in their ``_parameters`` (see ``owner_modules_of``)."""
    return owner_modules_of([param])[id(param)]


def is_released(t: torch.Tensor) -> bool:
    entry = STORE.get(t)
    return bool(entry and entry.released and isinstance(t, ReleasedParameter))


def release_original(p: nn.Parameter, whole_too: bool = False) -> int | None:
    """Free the storage of an original full parameter the modules no longer hold; returns the
    number of bytes released, or None where the storage is shared (below). ``whole_too``: also
    one tspc does not shard over the TSP axis (with ``data_parallel="fsdp"`` every parameter's
    DTensor is split over the mesh).

    A storage another live tensor also uses (``p`` is a view, or was carved from a flat buffer,
    or views of ``p`` exist) is left alone: ``resize_(0)`` would pull the data from under that
    tensor (a parameter kept whole, a buffer), whose next read is a crash. ``p`` itself is
    released all the same (its reads raise); only the memory stays until the other tensors go."""
    entry = STORE.get(p)
    if isinstance(p, ReleasedParameter) or entry is None and not whole_too:
        return 0
    if entry is not None and entry.released:
        return 0
    freed = None
    if storage_use_count(p) <= 2:  # p and the handle storage_use_count makes
        storage = p.untyped_storage()
        freed = storage.nbytes()
        storage.resize_(0)
    p.grad = None  # a gradient of the full tensor is meaningless now
    p.__class__ = ReleasedParameter
    if entry is not None:
        entry.released = True
    return freed


@torch.inference_mode(False)  # a stand-in made at a first call under inference_mode
def storage_less(like: torch.Tensor) -> nn.Parameter:
    """A full-shape tensor with no storage: the stand-in of a sharded weight, which the
    compiled graphs receive but never read (they read its shards). Same metadata as the
    parameter Dynamo traced, so its guards still hold."""
    t = torch.empty_strided(like.shape, like.stride(), dtype=like.dtype, device=like.device)
    t.untyped_storage().resize_(0)
    return nn.Parameter(t, requires_grad=like.requires_grad)


def storage_less_like(dp: torch.Tensor) -> nn.Parameter:
    t = torch.empty(dp.shape, dtype=dp.dtype, device=dp.device)
    return storage_less(t.requires_grad_(dp.requires_grad))


def warn_shared_storage(names: list[str]) -> None:
    """The sharded weights (``Module.name``) whose full storage ``release_original`` left."""
    if names:
        warnings.warn(
            f"tspc: {len(names)} sharded weight(s) ({', '.join(names[:4])}"
            f"{', ...' if len(names) > 4 else ''}) share their storage with other tensors "
            "(views of one tensor, a flat buffer): it is not freed, so these weights still take "
            "their full memory on every rank. Give each parameter its own storage before "
            "compiling (p.data = p.data.clone()) for the 1/D memory.",
            TSPHeldWholeWarning,
            stacklevel=4,
        )


def stack_root(owners: list[nn.Module]) -> nn.Module | None:
    """With no module call on the stack (the model called inside a compiled function, traced
    with it), the module that function was handed: the smallest module in a frame's locals
    holding every one of ``owners``. Its hooks then make Dynamo run its call eagerly and
    compile its forward as a frame of its own, with the stand-ins in place."""
    want = {id(m) for m in owners}
    best: tuple[int, nn.Module] | None = None
    for m in modules_on_stack():
        inside = {id(x) for x in m.modules()}
        if want <= inside and (best is None or len(inside) < best[0]):
            best = (len(inside), m)
    return best[1] if best else None
