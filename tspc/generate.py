"""``generate()`` on a TSP-compiled model: the prompt on the TSP schedules, decoding on the shards.

* **Prefill** (the prompt) runs the compiled TSP graph with its K/V outputs left sharded: each
  rank keeps its own zigzag tokens' K/V of every head (1/D of one process's cache) in a
  ``TSPCache``; only the last position's logits are gathered (transformers' ``generate`` asks for
  ``logits_to_keep=1``).
* **Decode** (one new token per sequence) runs the model's own code eagerly with every matched
  weight applied where it lies, as tensor parallelism would (``runtime/decode.py``): q/k/v
  projections give this rank's head group, the output and MLP down projections give partial
  sums that are all-reduced, and attention reads the sequence-sharded cache with a distributed
  flash-decoding merge. No weight moves and nothing recompiles per token.

How a user gets there (see docs/generation.md):

* ``model.forward = torch.compile(model.forward, backend="tsp")`` (transformers' idiom): the
  first compiled call routes ``model.forward`` through ``GenerateForward``, so
  ``model.generate(...)`` works; the very first prompt was compiled with the user's options, so
  its K/V come back gathered and are cut to this rank's tokens (later prompts stay sharded).
* ``cm = torch.compile(model, backend="tsp")``: after the first compiled call ``cm.generate``
  is routed the same way; ``tspc.enable_generate(cm)`` routes it before any call.

Only calls made by ``generate`` take the prompt path; a plain call of the routed forward returns
what the compiled forward returns; a call with a filled cache decodes on the shards.

Decoding needs ``nn.Linear`` projections whose weights are sharded by whole head groups /
F-slices (``Shard(0)`` rows, ``Shard(1)`` columns; weights kept whole are used whole) and a model
that reads its attention through transformers' attention interface and its cache through
``Cache.update`` (Llama, Mistral, Qwen2/3, Gemma, Phi, GPT-NeoX's fused qkv of whole heads). A
fused projection held as ``_StridedShard`` (Phi-3's ``qkv_proj`` / ``gate_up_proj``) or a Conv1D
raises ``GenerateUnsupportedError`` naming the module, and so does a decode step whose code
fails on a head group (OLMo-2's norms over every head's features) — never a wrong token.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tspc.decode_attention import ATTN_NAME, DecodeStep, register_decode_attention
from tspc.decode_layout import (
    GatherOutput,
    feature_dims,
    gather_output_map,
    is_conv1d,
    own_input_index,
)
from tspc.generate_cache import (
    DECODE,
    GenerateUnsupportedError,
    cache_from_prefill,
    full_prefill_cache,
    layer_windows,
    tsp_cache_type,
)
from tspc.prefill_buckets import bucket_prompt, trim_prefill_output
from tspc.runtime.compat import compile_options, compiled_module_original, optimized_module_class
from tspc.runtime.decode import DecodeComm
from tspc.runtime.decode_moe import is_stacked_experts, local_experts_hooks
from tspc.runtime.dp_shard import is_dp_sharded
from tspc.runtime.tsp_params import _refresh_handle, is_tsp_dtensor, tsp_local, tsp_param_of


@dataclass
class _TPPlan:
    """Where the model's TSP parameters lie (found once per model: walking every module on
    every decoded token would cost more than the token)."""

    params: list[tuple[nn.Module, str, str]]  # (module, parameter name, module name)
    # row-parallel projections: (module, name, this rank's input features, all input features)
    row_parallel: list[tuple[nn.Module, str, torch.Tensor, int]]
    # column-parallel projections: (module, name, the map gathering its output, whether it is
    # always gathered: a fused weight held strided, or a Conv1D; ``decode_layout.py``)
    column_parallel: list[tuple[nn.Module, str, GatherOutput, bool]]
    conv1d: list[nn.Module] = field(default_factory=list)  # their ``nf`` is set to the local
    experts: list[tuple[nn.Module, str]] = field(default_factory=list)  # runtime/decode_moe.py


def _tp_plan(model: nn.Module) -> _TPPlan:
    params, row_parallel, column_parallel, conv1d, experts = [], [], [], [], []
    for fqn, mod in model.named_modules():
        dims = feature_dims(mod)
        for name, p in mod._parameters.items():
            tp = tsp_param_of(p) if p is not None else None
            if tp is None:
                continue
            placement = tp.placement
            if placement[:2] == ("shard", 0) and is_stacked_experts(mod, name, p):
                params.append((mod, name, fqn))
                if (mod, fqn) not in experts:
                    experts.append((mod, fqn))
                continue
            if placement[0] in ("shard", "strided") and dims is None:
                raise GenerateUnsupportedError(
                    f"tspc: decoding needs the sharded weights in projections (nn.Linear, "
                    f"Conv1D); {fqn}.{name} ({type(mod).__name__}) is held as {placement[0]}"
                )
            params.append((mod, name, fqn))
            if name != "weight" or placement[0] not in ("shard", "strided"):
                continue
            layout, dim = tp.entry.layout, placement[1]
            if dim == dims[1]:
                features = tp.entry.full_shape[dim]
                row_parallel.append((mod, fqn, own_input_index(layout, tp.entry.rank), features))
            else:
                always = placement[0] == "strided" or is_conv1d(mod)
                gather = gather_output_map(layout, tp.entry.full_shape[dim])
                column_parallel.append((mod, fqn, gather, always))
            if is_conv1d(mod):
                conv1d.append(mod)
    return _TPPlan(params, row_parallel, column_parallel, conv1d, experts)


@contextmanager
def _tensor_parallel(plan: _TPPlan, comm: DecodeComm, gather_all: bool) -> Iterator[None]:
    """Every module holds plain tensors of what this rank has: a sharded weight's local slices
    (column-parallel: its rows, the module computes its head group / F-slice, gathered to every
    feature where ``decode_layout.py`` says so, or every one with ``gather_all``;
    row-parallel: its columns, the module's output is a partial sum, all-reduced by a hook; the
    bias added once), a replicated parameter's full value. Restored on exit."""
    saved: list[tuple[nn.Module, str, Any]] = []
    hooks = []
    nf = [(mod, mod.nf) for mod in plan.conv1d]
    try:
        for mod, name, fqn in plan.params:
            p = mod._parameters[name]
            tp = tsp_param_of(p)
            if tp is None:
                raise RuntimeError(f"tspc: {fqn}.{name} is no longer a TSP parameter")
            local = _decode_weight(tp.dparam)
            saved.append((mod, name, p))
            mod._parameters[name] = local
        for mod in plan.conv1d:  # Conv1D shapes its output by ``nf``: this rank's features
            mod.nf = mod._parameters["weight"].shape[1]
        for mod, fqn, own, features in plan.row_parallel:
            if mod._parameters.get("bias") is not None and comm.rank != 0:
                saved.append((mod, "bias", mod._parameters["bias"]))
                # the sum of the partials adds it once (Conv1D's addmm needs a tensor: zeros)
                bias = mod._parameters["bias"]
                mod._parameters["bias"] = torch.zeros_like(bias) if is_conv1d(mod) else None

            def narrow(m, args, own=own, features=features):
                x = args[0]
                if x.shape[-1] == features and own.numel() != features:  # a gathered input
                    return (x.index_select(-1, own.to(x.device)), *args[1:])
                return None

            def reduce(m, args, out, tag=f"decode:{fqn}"):
                return comm.all_reduce(out, tag)

            hooks.append(mod.register_forward_pre_hook(narrow))
            hooks.append(mod.register_forward_hook(reduce))
        for mod, fqn in plan.experts:
            hooks += local_experts_hooks(mod, comm, fqn)
        for mod, fqn, gather, always in plan.column_parallel:
            if not (always or gather_all) or comm.world == 1:
                continue

            def gather_out(m, args, out, gather=gather, tag=f"decode:{fqn}"):
                return gather(out, comm.all_gather(gather.pad(out), tag))

            hooks.append(mod.register_forward_hook(gather_out))
        yield
    finally:
        for h in hooks:
            h.remove()
        for mod, value in nf:
            mod.nf = value
        for mod, name, p in reversed(saved):
            mod._parameters[name] = p


def _decode_weight(dparam: torch.Tensor) -> torch.Tensor:
    """This rank's TSP-local tensor of ``dparam``. Split over dp (``data_parallel="fsdp"``), it
    is gathered over dp once per ``generate`` call, by ``gather_for_decode`` after the prompt:
    a gather at every step would pair only while the dp ranks decode in lockstep, and one
    stopping early (its own EOS, fewer new tokens) left the others waiting forever."""
    weights = getattr(DECODE, "weights", None)
    local = weights.get(id(dparam)) if weights is not None else None
    if local is None:
        with torch.no_grad():
            local = tsp_local(dparam)
    return local


def gather_for_decode(model: nn.Module) -> None:
    """After a prompt inside ``generate``: gather over dp every weight the decode steps read
    (each ``generate`` call has exactly one prompt, so the dp ranks' gathers pair up)."""
    weights = getattr(DECODE, "weights", None)
    if weights is None:
        return
    for mod, name, _ in _tp_plan(model).params:
        tp = tsp_param_of(mod._parameters[name])
        if tp is not None and is_dp_sharded(tp.dparam) and id(tp.dparam) not in weights:
            with torch.no_grad():
                weights[id(tp.dparam)] = tsp_local(tp.dparam)


@contextmanager
def _stand_ins(model: nn.Module) -> Iterator[None]:
    """The compiled graphs were traced with the plain stand-ins of the DTensor parameters: a
    hook on the module the user called puts them in place, but a routed ``cm.generate`` calls
    the inner model, whose modules may still hold the DTensors. Put them in place here too."""
    swapped = []
    for mod in model.modules():
        for name, p in mod._parameters.items():
            if p is not None and is_tsp_dtensor(p):
                tp = tsp_param_of(p)
                _refresh_handle(tp)
                swapped.append((mod, name, p))
                mod._parameters[name] = tp.handle
    try:
        yield
    finally:
        for mod, name, p in swapped:
            mod._parameters[name] = p


def _tsp_group_of(model: nn.Module) -> tuple[str, int] | None:
    for p in model.parameters():
        tp = tsp_param_of(p)
        if tp is not None:
            return tp.group, tp.world
    for mod in model.modules():  # during a call the modules hold the stand-ins
        for p in mod._parameters.values():
            tp = tsp_param_of(p) if p is not None else None
            if tp is not None:
                return tp.group, tp.world
    return None


# --------------------------------------------------------------------------- the routed forward


class GenerateForward:
    """``model.forward`` while tspc routes it: prompts run the TSP graph (K/V left sharded),
    decode steps run tensor-parallel on the shards; any other call runs the compiled forward."""

    def __init__(self, model: nn.Module, compiled: Any | None, options: dict | None):
        self._model = weakref.ref(model)
        self.options = {k: v for k, v in (options or {}).items() if k != "outputs"}
        self.eager = type(model).forward.__get__(model)
        self.compiled = compiled or torch.compile(
            self.eager, backend="tsp", options={**self.options, "outputs": "gathered"}
        )
        self._setup = None  # (DecodeComm, _TPPlan, counter tags), at the first decode step
        self._gather_all = False  # every column-parallel output gathered (decode_layout.py)
        self.prefill = torch.compile(
            self.eager, backend="tsp", options={**self.options, "outputs": "sharded"}
        )
        functools.update_wrapper(self, type(model).forward)  # generate() reads the signature
        register_decode_attention()

    @property
    def model(self) -> nn.Module:
        return self._model()

    @functools.cached_property
    def windows(self) -> list[int | None]:
        """Each layer's sliding window (None: full attention)."""
        return layer_windows(self.model.config)

    def __call__(self, *args, **kwargs):
        cache_key = "cache" if "cache" in kwargs else "past_key_values"
        cache = kwargs.get(cache_key)
        ids = kwargs.get("input_ids", args[0] if args else None)
        use_cache = kwargs.get("use_cache")
        if use_cache is None:
            use_cache = getattr(self.model.config, "use_cache", False)
        cache_type = tsp_cache_type()
        if isinstance(cache, cache_type):
            return self._decode(args, kwargs)
        if cache is not None and cache.get_seq_length() > 0:
            # a cache the compiled forward filled (gathered K/V: the first prompt of the idiom)
            grp = _tsp_group_of(self.model)
            group, world = grp if grp is not None else ("", 1)  # D = 1: nothing sharded
            rank = dist.get_rank(_pg(group)) if world > 1 else 0
            kwargs[cache_key] = cache_from_prefill(
                cache, cache.get_seq_length(), False, group, world, rank, self.windows
            )
            return self._decode(args, kwargs)
        if not getattr(DECODE, "generating", 0) or not use_cache or ids is None:
            # a plain call (not from generate: exactly what the compiled forward returns)
            with _stand_ins(self.model):
                return self.compiled(*args, **kwargs)
        return self._prefill(args, kwargs, cache_key)

    def _prefill(self, args, kwargs, cache_key):
        ids = kwargs.get("input_ids", args[0] if args else None)
        keep = kwargs.get("logits_to_keep")
        kwargs = {**kwargs, cache_key: full_prefill_cache(self.windows), "use_cache": True}
        sharded = isinstance(keep, int) and keep >= 1  # else the logits of every token: gathered
        bucket = None
        if self.options.get("prefill_buckets", True):
            # a few programs for every prompt shape (``tspc/prefill_buckets.py``)
            args, kwargs, bucket = bucket_prompt(args, kwargs, self._tsp_world())
        with _stand_ins(self.model):
            out = (self.prefill if sharded else self.compiled)(*args, **kwargs)
        name = "cache" if "cache" in out else "past_key_values"
        if bucket is not None:
            out = trim_prefill_output(out, bucket, name, sharded)
        grp = _tsp_group_of(self.model)
        group, world = grp if grp is not None else ("", 1)
        rank = dist.get_rank(_pg(group)) if world > 1 else 0
        out[name] = cache_from_prefill(
            out[name], ids.shape[1], sharded, group, world, rank, self.windows
        )
        gather_for_decode(self.model)
        return out

    def _tsp_world(self) -> int:
        """D: of the sharded weights, or (before the first compile) of the group the options
        name, as the backend will resolve it."""
        grp = _tsp_group_of(self.model)
        if grp is not None:
            return grp[1]
        from tspc.runtime.group import resolve_group

        o = self.options
        return resolve_group(
            o.get("group"), o.get("mesh_dim"), o.get("data_parallel", "replicate")
        ).size

    def _decode(self, args, kwargs):
        model = self.model
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if self._setup is None:
            grp = _tsp_group_of(model)
            group, world = grp if grp is not None else (cache.group, cache.world)
            names = _attention_names(model)
            self._setup = (
                DecodeComm(group, world, cache.rank),
                _tp_plan(model),
                {i: f"decode:{n}" for i, n in names.items()},
            )
        comm, plan, tags = self._setup
        config = model.config
        before = config._attn_implementation
        try:
            config._attn_implementation = ATTN_NAME
            try:
                out = self._decode_step(args, kwargs, cache, self._gather_all)
            except RuntimeError as e:
                if isinstance(e, (GenerateUnsupportedError, dist.DistError)):
                    raise  # (a collective's failure: a peer's error, not this model's code)
                if self._gather_all or DECODE.failed_step.touched:
                    raise self._unsupported(e) from e
                # the model's code failed on a slice before the cache saw the step (every rank
                # alike: the same code on the same shapes): decode with every projection's
                # output gathered, as one process computes it (``decode_layout.py``)
                self._gather_all = True
                try:
                    out = self._decode_step(args, kwargs, cache, True)
                except RuntimeError as e2:
                    if isinstance(e2, GenerateUnsupportedError):
                        raise
                    raise self._unsupported(e2) from e2
        finally:
            config._attn_implementation = before
        name = "cache" if "cache" in out else "past_key_values"
        out[name] = cache
        return out

    def _decode_step(self, args, kwargs, cache, gather_all: bool):
        comm, plan, tags = self._setup
        step = DecodeStep(
            comm, cache, tag_of_layer=tags, layout=self.options.get("decode_layout", "sequence")
        )
        DECODE.step = step
        try:
            with torch.no_grad(), _tensor_parallel(plan, comm, gather_all):
                return self.eager(*args, **kwargs)
        except RuntimeError:
            DECODE.failed_step = step
            raise
        finally:
            DECODE.step = None

    def _unsupported(self, e: RuntimeError) -> GenerateUnsupportedError:
        return GenerateUnsupportedError(
            f"tspc: {type(self.model).__name__}'s decode step failed with each projection "
            "applied on this rank's shards, its outputs gathered to every feature: "
            f"its code needs something tensor-parallel decoding does not provide: {e}"
        )


def _pg(group: str):
    from tspc.runtime.group import process_group

    return process_group(group)


def _attention_names(model: nn.Module) -> dict[int, str]:
    """layer index -> the attention module's name (counter tags)."""
    return {
        m.layer_idx: fqn
        for fqn, m in model.named_modules()
        if isinstance(getattr(m, "layer_idx", None), int) and hasattr(m, "config")
    }


# --------------------------------------------------------------------------- routing


def _is_generative(model: Any) -> bool:
    return isinstance(model, nn.Module) and callable(getattr(type(model), "generate", None))


@contextmanager
def _generating() -> Iterator[None]:
    """Calls of a routed forward inside ``generate`` take the prompt / decode paths; any other
    call gets what the compiled forward returns, unchanged (its gathered K/V included)."""
    depth = getattr(DECODE, "generating", 0)
    DECODE.generating = depth + 1
    if depth == 0:
        DECODE.weights = {}  # id(DTensor) -> its TSP-local tensor, for this call's decode steps
    try:
        yield
    finally:
        DECODE.generating = depth
        if depth == 0:
            DECODE.weights = None


def route(model: nn.Module, compiled: Any | None, options: dict | None) -> None:
    """Route ``model.forward`` through ``GenerateForward``, and mark ``model.generate``'s calls
    (idempotent)."""
    if isinstance(model.__dict__.get("forward"), GenerateForward):
        return
    model.forward = GenerateForward(model, compiled, options)
    cls_generate = type(model).generate
    ref = weakref.ref(model)

    @functools.wraps(cls_generate)
    def generate(*args, **kwargs):
        with _generating():
            return cls_generate(ref(), *args, **kwargs)

    model.__dict__["generate"] = generate


def enable_generate(model: Any, options: dict | None = None) -> Any:
    """Make ``model.generate`` (a transformers model, its ``torch.compile(model, backend="tsp")``
    wrapper, or a model whose forward was compiled) run the prompt on the TSP schedules and the
    decode steps tensor-parallel on the shards. Returns ``model``.

    The prompt compiles with the options ``torch.compile`` was given (inner compiler, dump
    directory, ...), updated by ``options`` where both name one."""
    OptimizedModule = optimized_module_class()  # noqa: N806 - a class

    if isinstance(model, OptimizedModule):
        inner = compiled_module_original(model)
        if not _is_generative(inner):
            raise GenerateUnsupportedError(f"tspc: {type(inner).__name__} has no generate()")
        _route_compiled_module(model, _with_compile_options(model, options))
        return model
    if not _is_generative(model):
        raise GenerateUnsupportedError(f"tspc: {type(model).__name__} has no generate()")
    own = model.__dict__.get("forward")
    if own is None or isinstance(own, GenerateForward):
        route(model, None, options)
    else:
        route(model, own, _with_compile_options(own, options))
    return model


def _with_compile_options(compiled: Any, options: dict | None) -> dict | None:
    """The options ``compiled`` was made with by ``torch.compile``, updated by ``options``."""
    found = compile_options(compiled)
    if found is None:
        return options
    return {**found, **(options or {})}


def _route_compiled_module(cm: nn.Module, options: dict | None) -> None:
    """``cm.generate`` runs the inner model's generate with its forward routed (only during the
    call: ``cm(...)`` itself keeps tracing the model's own forward)."""
    inner = compiled_module_original(cm)
    if "generate" in cm.__dict__:
        return
    fwd = GenerateForward(inner, None, options)

    @functools.wraps(type(inner).generate)
    def generate(*args, **kwargs):
        had = inner.__dict__.get("forward")
        inner.forward = fwd
        try:
            with _generating():
                return type(inner).generate(inner, *args, **kwargs)
        finally:
            if had is None:
                del inner.forward
            else:
                inner.forward = had

    cm.__dict__["generate"] = generate


def route_from_backend(options: dict | None) -> None:
    """Called by the ``tsp`` backend while it compiles: route ``generate`` of the module being
    called (the model whose forward the user compiled, or ``torch.compile(model)``'s wrapper)."""
    OptimizedModule = optimized_module_class()  # noqa: N806 - a class

    from tspc.runtime.tsp_params import _entry_module

    entry = _entry_module()
    if entry is None:
        return
    if isinstance(entry, OptimizedModule):
        if _is_generative(compiled_module_original(entry)):
            _route_compiled_module(entry, options)
        return
    own = entry.__dict__.get("forward")
    if _is_generative(entry) and own is not None and not isinstance(own, GenerateForward):
        route(entry, own, options)
