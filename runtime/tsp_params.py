"""The model's parameters as DTensors on the TSP axis, as FSDP2 holds them.

After a module's first compiled call, every parameter the compiled graphs read is an
``nn.Parameter`` holding a DTensor on the TSP mesh:

* a matched weight holds only this rank's slices: ``Shard(dim)`` when the slices are the even
  chunks ``torch.chunk`` would cut (separate Q/K/V/O, gate/up/down, their biases);
  ``_StridedShard(dim, k)`` for a fused weight of k equal parts, each chunked (``qkv_proj`` of
  multi-head attention, ``gate_up_proj``); ``Replicate()`` with the full value where the
  slices are no DTensor placement (fused Q/K/V of unequal sizes, KV heads fewer than ranks)
  or where a graph also reads the whole weight — there the gradient is summed over the group,
  so the replicas stay equal (the compile report says which);
* every other parameter (norms, embeddings, unmatched layers) is a ``Replicate()`` DTensor
  sharing the original's storage.

So ``model.parameters()``, torch's optimizers, ``clip_grad_norm_``, ``model.state_dict()`` and
``torch.distributed.checkpoint`` see one consistent set of DTensors. The compiled graphs still
run on plain tensors: while the model runs, a hook on the module the user called (the
``OptimizedModule``, or the model whose ``forward`` was compiled) puts back, for each parameter,
the plain *stand-in* Dynamo compiled against (same metadata, so no recompile; for a sharded
weight a full-shape tensor without storage), and puts the DTensors back when the call returns.
The runtime feeds the graph views of each DTensor's local tensor (``to_local`` is
differentiable: gradients land on the DTensor parameters, as DTensors).
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, Shard
from torch.utils.weak import WeakIdKeyDictionary

from .autograd_glue import sync_replicated_grad
from .compat import (
    copy_grad_hooks,
    no_fake_mode,
    optimized_module_class,
    outermost_module_call,
    strided_shard,
)
from .compat import is_strided_shard as _is_strided
from .data_parallel import grad_written, is_averaging_hook
from .dp_shard import dp_part, is_dp_sharded, make_dparam, tsp_local
from .errors import TSPConfigError, TSPHeldWholeWarning
from .group import process_group
from .release import storage_less, storage_less_like
from .shard_store import STORE, Layout, ShardedParam, ShardSpec

log = logging.getLogger("tspc")


# --------------------------------------------------------------------------- layout -> placement


def layout_placement(layout: Layout, shape: tuple[int, ...]) -> tuple:
    """The DTensor placement that says exactly which slices each rank holds, as
    ``("shard", dim)``, ``("strided", dim, k)`` or ``("replicate",)`` when none does."""
    world = len(layout)
    specs = [s for own in layout for s in own]
    dims = {s.dim for s in specs}
    if len(dims) != 1:
        return ("replicate",)
    (d,) = dims
    n = shape[d]
    chunk = -(-n // world)
    as_chunks = tuple(
        ((ShardSpec(d, r * chunk, min((r + 1) * chunk, n)),) if r * chunk < n else ())
        for r in range(world)
    )
    if layout == as_chunks:
        return ("shard", d)
    k = len(layout[0])
    if k >= 2 and n % k == 0 and (n // k) % world == 0:
        seg, c = n // k, n // k // world
        strided = tuple(
            tuple(ShardSpec(d, j * seg + r * c, j * seg + (r + 1) * c) for j in range(k))
            for r in range(world)
        )
        if layout == strided:
            return ("strided", d, k)
    return ("replicate",)


def _placement_object(placement: tuple):
    if placement[0] == "shard":
        return Shard(placement[1])
    if placement[0] == "strided":
        return strided_shard(placement[1], placement[2])
    return Replicate()


# --------------------------------------------------------------------------- meshes

# (group name, device type, the group's id) -> the mesh, held weakly: the DTensor parameters on
# a mesh own it (their specs hold it), so it lives exactly as long as something tspc made on it
# does. The group's id: a name comes back for a new group after ``destroy_process_group``, and
# the new group gets a mesh of its own (an id is unique among live objects, and the old
# group's mesh keeps the old group alive).
_MESHES: weakref.WeakValueDictionary[tuple, DeviceMesh] = weakref.WeakValueDictionary()


def mesh_of(group_name: str, device: torch.device) -> DeviceMesh:
    """The 1-D DeviceMesh of the TSP group on ``device``'s type."""
    pg = process_group(group_name)
    key = (group_name, device.type, id(pg))
    mesh = _MESHES.get(key)
    if mesh is None:
        with no_fake_mode():
            mesh = _MESHES[key] = DeviceMesh.from_group(pg, device.type)
    return mesh


# --------------------------------------------------------------------------- the registry


@dataclass(eq=False)
class TSPParam:
    """One parameter of a module tspc compiled: the DTensor the module holds between calls and
    the plain stand-in its compiled graphs were traced with."""

    dparam: nn.Parameter  # the DTensor parameter (what model.parameters() yields)
    handle: nn.Parameter  # the plain tensor Dynamo sees while the model runs
    mesh: DeviceMesh
    group: str
    world: int
    entry: ShardedParam | None = None  # None for a replicated parameter
    owners: list[tuple[nn.Module, str]] = field(default_factory=list)
    original: nn.Parameter | None = None  # until the modules hold the DTensor

    @property
    def sharded(self) -> bool:
        return self.entry is not None and self.entry.placement[0] != "replicate"

    @property
    def storage_less(self) -> bool:  # its stand-in holds no data: the DTensor is all there is
        return self.sharded or is_dp_sharded(self.dparam)

    @property
    def placement(self) -> tuple:
        return self.entry.placement if self.entry is not None else ("replicate",)


class _Registry:
    """original parameter, stand-in and DTensor parameter -> their TSPParam.

    The DTensor parameters and the stand-ins are looked up by id, through a weak reference to
    their TSPParam: ``model.to()`` converts a DTensor parameter in place with
    ``torch.utils.swap_tensors``, which refuses a tensor that has a weak reference, and a
    TSPParam holds its stand-in, so a dictionary weakly keyed on the stand-in would keep both
    alive for good (with replicated weights, whose stand-in is the original). The TSPParams
    live as long as the module that runs them (``_WATCHED``) or an original an optimizer holds."""

    def __init__(self) -> None:
        self._weak: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._by_id: dict[int, weakref.ref] = {}

    def get(self, t: torch.Tensor) -> TSPParam | None:
        ref = self._by_id.get(id(t))
        tp = ref() if ref is not None else None
        if tp is not None and (tp.dparam is t or tp.handle is t):
            return tp
        return self._weak.get(t) if not isinstance(t, DTensor) else None

    def add(self, t: torch.Tensor, tp: TSPParam) -> None:
        if isinstance(t, DTensor) or t is tp.handle:
            key = id(t)
            by_id = self._by_id

            def drop(ref: weakref.ref, key: int = key) -> None:
                if by_id.get(key) is ref:
                    del by_id[key]

            by_id[key] = weakref.ref(tp, drop)
        else:
            self._weak[t] = tp

    def __contains__(self, t: torch.Tensor) -> bool:
        return self.get(t) is not None

    def meshes(self) -> list[DeviceMesh]:  # of the live DTensor parameters tspc made
        return [tp.dparam.device_mesh for r in list(self._by_id.values()) if (tp := r())]


REGISTRY = _Registry()


def tsp_param_of(t: torch.Tensor) -> TSPParam | None:
    return REGISTRY.get(t)


def is_tsp_dtensor(t: torch.Tensor) -> bool:
    tp = REGISTRY.get(t)
    return tp is not None and tp.dparam is t


# --------------------------------------------------------------------------- creation


@torch.inference_mode(False)  # made under inference_mode too: trainable, not inference tensors
def create_sharded_dparam(full: nn.Parameter, entry: ShardedParam, keep_whole: bool) -> None:
    """Cut this rank's slices of ``full`` into the local tensor of a new DTensor parameter.

    ``keep_whole``: a graph also reads the whole weight, so it stays replicated."""
    placement = ("replicate",) if keep_whole else layout_placement(entry.layout, full.shape)
    entry.placement = placement
    mesh = mesh_of(entry.group, full.device)
    with torch.no_grad():
        if placement[0] == "replicate":
            local = full.detach()  # the full value, shared with the original (no copy)
            entry.offsets = {s: s.start for s in entry.own}
        else:
            d = placement[1]
            parts, offset = [], 0
            for spec in entry.own:
                parts.append(full.detach().narrow(d, spec.start, spec.length))
                entry.offsets[spec] = offset
                offset += spec.length
            local = torch.cat(parts, d) if parts else full.new_empty(0)
        dt = DTensor.from_local(
            local,
            mesh,
            [_placement_object(placement)],
            run_check=False,
            shape=full.shape,
            stride=full.stride(),
        )
    two_d = make_dparam(local, dt.placements[0], entry.group, full, STORE.held_whole(full))
    entry.dparam = (
        two_d if two_d is not None else nn.Parameter(dt, requires_grad=full.requires_grad)
    )


def bind_to_replicated(entry: ShardedParam, tp: TSPParam) -> None:
    """A later graph reads slices of a weight an earlier graph of the same model reads whole
    (a module matched at one length and skipped at another): the slices are views of the
    replicated DTensor the module already holds, so the gradient lands on the module's own
    parameter, summed over the group (``local_views``); the weight stays whole, since the
    earlier graph still reads it so. A new DTensor here would take the later graph's
    gradients where no optimizer sees them."""
    entry.placement = ("replicate",)
    entry.offsets = {s: s.start for s in entry.own}
    entry.dparam = tp.dparam
    warnings.warn(
        f"tspc: a weight of shape {tuple(entry.full_shape)} that this graph shards is read "
        "whole by a graph compiled earlier for the same model (a module left unsharded at "
        "another sequence length): it stays whole on every rank, so its memory is not 1/D. "
        "The compile reports name the module; tspc.last_report() per graph.",
        TSPHeldWholeWarning,
        stacklevel=3,
    )


@torch.inference_mode(False)  # (see create_sharded_dparam)
def _replicated_dparam(p: nn.Parameter, mesh: DeviceMesh, group: str) -> nn.Parameter:
    two_d = make_dparam(p.detach(), Replicate(), group, p, STORE.held_whole(p))
    if two_d is not None:  # data_parallel="fsdp": split over the mesh (runtime/dp_shard.py)
        return two_d
    with torch.no_grad():
        dt = DTensor.from_local(p.detach(), mesh, [Replicate()], run_check=False)
    return nn.Parameter(dt, requires_grad=p.requires_grad)


# --------------------------------------------------------------------------- per call


def local_views(entry: ShardedParam, specs: list[ShardSpec]) -> list[torch.Tensor]:
    """This call's views of the DTensor's local tensor, one per slice the graph reads.

    A weight held whole (Replicate) gets its gradient summed here, outside the graph: every
    rank must then read at least one slice of it, or the sums would not pair up across ranks
    (true of the layouts the passes make: fused Q/K/V, weights also used whole; separate K/V
    weights of shared KV heads never come here, they stay plain replicated inputs)."""
    local = tsp_local(entry.dparam)
    if entry.placement[0] == "replicate" and entry.world > 1 and torch.is_grad_enabled():
        # the same gradient sum the graphs put after replicated inputs
        local = sync_replicated_grad(local, entry.group, entry.world, "replicated_slices")
    # A slice along a dim other than the first (a Conv1D weight's output columns held as
    # several slices) is not contiguous; graphs are compiled for contiguous shard inputs
    # (``ShardStore.example_shard``), and the broadcast packs a copy of it anyway.
    return [local.narrow(s.dim, entry.offsets[s], s.length).contiguous() for s in specs]


# --------------------------------------------------------------------------- adoption


def prepare(p: nn.Parameter, group: str, world: int) -> TSPParam:
    """The TSPParam of a parameter a graph receives (created at its first call): the DTensor
    parameter exists from the first call on, so gradients land on it from the first backward.
    The module keeps the original until ``adopt``."""
    tp = REGISTRY.get(p)
    if tp is not None:
        return tp
    entry = STORE.get(p)
    mesh = mesh_of(group, p.device)
    if entry is not None and entry.dparam is not None:
        dparam = entry.dparam
        whole = entry.placement[0] == "replicate" and not is_dp_sharded(dparam)
        handle = p if whole else storage_less(p)
        STORE.alias(handle, p)
    else:
        entry = None
        dparam = _replicated_dparam(p, mesh, group)
        handle = storage_less(p) if is_dp_sharded(dparam) else p
    tp = TSPParam(dparam, handle, mesh, group, world, entry, original=p)
    # the user's, before tspc's own (``_route_grad``) on p; dp averaging is the backend's
    copy_grad_hooks(p, dparam, skip=is_averaging_hook)
    REGISTRY.add(p, tp)
    REGISTRY.add(handle, tp)
    REGISTRY.add(dparam, tp)
    if not tp.storage_less:
        # graphs get the DTensor's local tensor in its place (``graph_input``); a use of the
        # stand-in outside them (eager code between graph breaks) is routed here
        _route_grad(handle, tp)
    return tp


def graph_input(tp: TSPParam) -> torch.Tensor:
    """What a compiled graph receives for this parameter in this call: the local tensor of a
    replicated DTensor (``to_local`` is differentiable: the gradient lands on the DTensor), or
    the storage-less stand-in of a sharded weight (the graph reads its slices instead)."""
    return tp.handle if tp.sharded else tsp_local(tp.dparam)


def adopt(tps: Iterable[TSPParam]) -> None:
    """Make the modules holding the parameters of ``tps`` hold their DTensors instead (after
    a graph's first call), and release the full storage of the sharded ones."""
    from .release import owner_modules_of, release_original, stack_root, warn_shared_storage

    todo = [tp for tp in tps if not tp.owners and tp.original is not None]
    todo = list({id(tp): tp for tp in todo}.values())
    if not todo:
        return
    originals = [tp.original for tp in todo]
    owners = owner_modules_of(originals)
    entry_module = _entry_module()  # (an OptimizedModule: no truth value, it has __len__)
    if entry_module is None:
        entry_module = stack_root([m for ms in owners.values() for m in ms])
    shared = []
    for tp, p in zip(todo, originals):
        for m in owners[id(p)]:
            for name, v in m._parameters.items():
                if v is p:
                    tp.owners.append((m, name))
        for m, name in tp.owners:
            m._parameters[name] = tp.dparam
            _own(m, tp)
            _add_eager_guard(m)
            if tp.placement[0] == "strided":
                _add_state_dict_hooks(m)
            _add_load_hooks(m)
        if tp.storage_less and release_original(p, whole_too=True) is None:
            shared.extend(f"{type(m).__name__}.{name}" for m, name in tp.owners[:1])
        tp.original = None  # released or the stand-in itself: nothing more to do with it
    warn_shared_storage(shared)
    if entry_module is not None:
        _watch(entry_module, todo)
    else:
        _UNWATCHED.extend(todo)  # no module to live as long as: kept for the process
        log.warning(
            "tspc: the compiled graph was not called from a module's __call__; the model now "
            "holds DTensor parameters and must be called through torch.compile(model, "
            "backend='tsp') (or a model whose forward was compiled)"
        )


def _route_grad(handle: nn.Parameter, tp: TSPParam) -> None:
    """The graphs differentiate the plain stand-in of a replicated parameter; its gradient
    (already summed over the group in-graph) moves to the DTensor parameter."""
    if not handle.requires_grad:
        return
    ref = weakref.ref(tp)

    def move(h: torch.Tensor) -> None:
        tp_ = ref()
        g = h.grad
        if tp_ is None or g is None:
            return
        h.grad = None
        dp = tp_.dparam
        with torch.no_grad():
            if dp.grad is None:
                dp.grad = DTensor.from_local(g, tp_.mesh, [Replicate()], run_check=False)
            else:
                dp.grad.to_local().add_(g)
        grad_written(dp)  # with data parallelism: averaged over dp like autograd's gradients

    handle.register_post_accumulate_grad_hook(move)


_GUARDED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _own(m: nn.Module, tp: TSPParam) -> None:
    """The module holding ``tp``'s DTensor holds ``tp``: the record lives as long as that
    module, not only as long as the compiled module whose first call made it. An attribute,
    not a weakly keyed table: ``tp`` refers to ``m`` (its owners), which would keep a table's
    key alive for good; a cycle through the module goes with it."""
    records = m.__dict__.setdefault("_tspc_records", _Records())
    if tp not in records:
        records.append(tp)


class _Records(list):
    """A module's TSPParams. A deep copy of the module (``AveragedModel``, an EMA copy) gets
    none: its DTensors are copied with it, and a copy of a record would copy the storage-less
    stand-in, whose data copy reads memory it does not have (both ranks crashed)."""

    def __deepcopy__(self, memo) -> _Records:
        return _Records()


def _add_eager_guard(m: nn.Module) -> None:
    if m not in _GUARDED:
        _GUARDED.add(m)
        m.register_forward_pre_hook(_eager_guard)


def _another_compiled_module(module: nn.Module) -> TSPConfigError:
    return TSPConfigError(
        f"tspc: {type(module).__name__} already holds DTensor parameters from an earlier "
        "torch.compile(model, backend='tsp'), and this compiled module is another one: tspc "
        "runs a model through the compiled module whose first call sharded it. Keep that "
        "compiled module and call it (it recompiles after torch.compiler.reset() too); for a "
        "second compile, build a fresh model and load get_model_state_dict(model, "
        "options=StateDictOptions(full_state_dict=True)) into it."
    )


def _eager_guard(module: nn.Module, args) -> None:
    """Calling a module eagerly while it holds DTensor parameters would mix them with plain
    activations (DTensor's error names neither the cause nor the fix). Traced by Dynamo,
    DTensors here mean a compiled wrapper other than the one whose first call made them (its
    hook puts the plain stand-ins in place first): say so, not DTensor's mixed-tensor error."""
    if torch.compiler.is_compiling():
        if any(isinstance(p, DTensor) for p in module._parameters.values()):
            raise _another_compiled_module(module)  # Dynamo runs the call eagerly: see below
        return
    _check_eager_call(module)


@torch.compiler.disable  # reads the Python stack, which Dynamo cannot trace
def _check_eager_call(module: nn.Module) -> None:
    names = [  # a deep copy's DTensors: not registered, on a copy of a tspc mesh
        n
        for n, p in module._parameters.items()
        if isinstance(p, DTensor)
        and (is_tsp_dtensor(p) or any(p.device_mesh == m for m in REGISTRY.meshes()))
    ]
    if not names:
        return
    entry = _entry_module()
    if entry is not module and isinstance(entry, optimized_module_class()):
        raise _another_compiled_module(module)
    from .release import ReleasedParameterError

    raise ReleasedParameterError(
        f"tspc: calling {type(module).__name__} eagerly: its parameters {names} are DTensors "
        "holding this rank's slices since the model's first compiled call. Call the "
        "compiled model; for a plain copy, load get_model_state_dict(model, "
        "options=StateDictOptions(full_state_dict=True)) into a fresh model."
    )


# --------------------------------------------------------------------------- the call's swap

_UNWATCHED: list[TSPParam] = []
_WATCHED: weakref.WeakKeyDictionary[nn.Module, list[TSPParam]] = weakref.WeakKeyDictionary()


def _entry_module() -> nn.Module | None:  # the OptimizedModule, or the compiled model
    return outermost_module_call()  # (the outermost module called eagerly on the stack)


def _watch(module: nn.Module, tps: list[TSPParam]) -> None:
    watched = _WATCHED.get(module)
    if watched is None:
        watched = _WATCHED[module] = []
        module.register_forward_pre_hook(_put_handles, prepend=True)
        module.register_forward_hook(_put_dparams, always_call=True)
    watched.extend(tps)


@torch.compiler.disable
def _put_handles(module: nn.Module, args) -> None:
    for tp in _WATCHED.get(module, ()):
        _refresh_handle(tp)
        for m, name in tp.owners:
            m._parameters[name] = tp.handle


@torch.compiler.disable
def _put_dparams(module: nn.Module, args, out) -> None:
    for tp in _WATCHED.get(module, ()):
        for m, name in tp.owners:
            m._parameters[name] = tp.dparam


def _refresh_handle(tp: TSPParam) -> None:
    """After ``model.to(dtype)`` (or device, or ``requires_grad_``) the DTensor changed: the
    stand-in follows it (Dynamo then compiles once for the new dtype)."""
    dp, h = tp.dparam, tp.handle
    if (h.dtype, h.device, h.requires_grad) == (dp.dtype, dp.device, dp.requires_grad) and (
        tp.storage_less or h.is_set_to(_local(dp))
    ):
        return
    if tp.storage_less:
        new = storage_less_like(dp)
    else:
        new = nn.Parameter(_local(dp), requires_grad=dp.requires_grad)
        _route_grad(new, tp)
    tp.handle = new
    REGISTRY.add(new, tp)
    if tp.entry is not None:
        STORE.alias(new, h)


def _local(dp: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return dp.to_local()


# --------------------------------------------------------------------------- checkpoints
#
# torch.distributed.checkpoint describes a DTensor shard by one offset and one size: right for
# Shard, not for _StridedShard (k separate pieces per rank). Such parameters (and their
# optimizer state) therefore enter state dicts as Shard DTensors (a redistribution, one weight
# at a time) and are turned back on load. Plain full tensors loaded into a DTensor parameter
# (``model.load_state_dict(full)``, an HF checkpoint) are cut locally: no communication.

_SD_HOOKED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
_LOAD_HOOKED: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def _as_plain_shard(t: torch.Tensor) -> torch.Tensor:
    if isinstance(t, DTensor) and any(_is_strided(p) for p in t.placements):
        placements = [Shard(p.dim) if _is_strided(p) else p for p in t.placements]
        return t.redistribute(t.device_mesh, placements)
    return t


def _like_param(value: torch.Tensor, tp: TSPParam, keep_dtype: bool = False) -> torch.Tensor:
    """``value`` (a full plain tensor, or a DTensor of any placement) as a DTensor with the
    parameter's placement (and dtype, unless ``keep_dtype``: optimizer state)."""
    dp = tp.dparam
    if isinstance(value, DTensor):
        if tuple(value.placements) != tuple(dp.placements):
            value = value.redistribute(dp.device_mesh, dp.placements)
        return value
    if tuple(value.shape) != tuple(dp.shape):
        return value  # let load_state_dict report the mismatch
    if tp.sharded:
        d = tp.entry.placement[1]
        parts = [value.narrow(d, s.start, s.length) for s in tp.entry.own]
        local = torch.cat(parts, d) if parts else value.new_empty(0)
    else:
        local = value
    local = dp_part(local, dp)
    return DTensor.from_local(
        local if keep_dtype else local.to(dp.dtype),
        dp.device_mesh,
        dp.placements,
        run_check=False,
        shape=dp.shape,
        stride=dp.stride(),
    )


def _add_state_dict_hooks(m: nn.Module) -> None:
    if m in _SD_HOOKED:
        return
    _SD_HOOKED.add(m)

    def post(module, state_dict, prefix, local_metadata):
        for name in module._parameters:
            key = prefix + name
            if key in state_dict and isinstance(state_dict[key], DTensor):
                state_dict[key] = _as_plain_shard(state_dict[key])

    m.register_state_dict_post_hook(post)


def _add_load_hooks(m: nn.Module) -> None:
    if m in _LOAD_HOOKED:
        return
    _LOAD_HOOKED.add(m)

    def pre(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
        for name, p in module._parameters.items():
            key = prefix + name
            tp = REGISTRY.get(p) if p is not None else None
            if tp is not None and key in state_dict:
                state_dict[key] = _like_param(state_dict[key], tp)

    m.register_load_state_dict_pre_hook(pre)
