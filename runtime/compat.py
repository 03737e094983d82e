"""torch-private names tspc needs, in one place (each says why it is needed).

Everything tspc reads from a private torch module (``torch._ops``, ``torch._subclasses``,
``torch.utils._python_dispatch``, ``torch.fx._lazy_graph_module``, ``torch._C``, ...) is
imported or called here, so a torch upgrade that moves one breaks one file. The aot/Inductor
entry points of the inner compiler and the tools' profiler internals are the two other places
(``tspc/inner.py``, ``tspc/tools/memory.py``), each import commented.
"""

from __future__ import annotations

import contextlib
import sys

import torch

# The classes of ``torch.ops`` entries (the objects are public; the module is not).
from torch._ops import OpOverload, OpOverloadPacket

# Fake tensors: shape propagation and ``tspc plan --measure`` run ops on them.
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

# How the MLP matcher and the device check see which ATen ops a node dispatches to.
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass

# torch's pytree (what Dynamo and aot_autograd use to walk nested args).
from torch.utils._pytree import tree_leaves, tree_map, tree_map_only

try:  # the lazy GraphModule Dynamo and Inductor use: code generated once, when first run
    from torch.fx._lazy_graph_module import _LazyGraphModule as LazyGraphModule
except ImportError:  # pragma: no cover - other torch versions
    LazyGraphModule = torch.fx.GraphModule

__all__ = [
    "FakeTensor",
    "FakeTensorMode",
    "LazyGraphModule",
    "OpOverload",
    "OpOverloadPacket",
    "TorchDispatchMode",
    "is_traceable_wrapper_subclass",
    "tree_leaves",
    "tree_map",
    "tree_map_only",
]

# Namespaces whose functions Dynamo records under their own objects (``torch._C._nn.gelu`` is
# ``F.gelu``; ``torch._C._set_grad_enabled`` marks grad-mode changes in a graph).
TORCH_C_NAMESPACES = (torch._C._nn, torch._C)


def strided_shard(dim: int, split_factor: int):
    """DTensor's ``_StridedShard``: k equal parts of a dim, each chunked over the mesh (the
    layout of a fused weight such as ``gate_up_proj``). Private in torch 2.13."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=split_factor)


def is_strided_shard(placement) -> bool:
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(placement, _StridedShard)


def no_fake_mode():
    """Leave an active FakeTensorMode for a moment: a DeviceMesh is built from real tensors
    (``tspc plan --measure`` runs the whole step under fake tensors)."""
    try:
        from torch._subclasses.fake_tensor import unset_fake_temporarily
    except ImportError:  # pragma: no cover - a torch without it
        return contextlib.nullcontext()
    return unset_fake_temporarily()


def queue_backward_callback(fn) -> None:
    """Run ``fn`` when the current backward pass ends (what DDP and FSDP use to finish their
    gradient reductions; private in torch 2.13)."""
    from torch.autograd import Variable

    Variable._execution_engine.queue_callback(fn)


def fake_tensor_mode(**kwargs):
    """``FakeTensorMode``: tensors with shape, dtype and device but no data (``tspc dump
    --device cuda`` traces CUDA graphs on a machine without one)."""
    return FakeTensorMode(**kwargs)


def disable_torch_function_subclass():
    """Run tensor methods without ``__torch_function__`` of a subclass (a released parameter's
    own guard must read its metadata without re-entering itself)."""
    return torch._C.DisableTorchFunctionSubclass()


def dispatch_key_for_device(device_type: str) -> str:
    """The dispatch key name of a device type ("cpu" -> "CPU", "cuda" -> "CUDA")."""
    return torch._C._dispatch_key_for_device(device_type)


def tracing_context():
    """Dynamo's current TracingContext (None outside a compile): its fake mode and the
    graph's example inputs."""
    return torch._guards.TracingContext.try_get()


def fake_process_group_store():
    """The store of torch's ``fake`` process-group backend (graph-only runs as rank r of D,
    no peers): it lives in ``torch.testing._internal`` in torch 2.13."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore()


def resolve_process_group(name: str):
    """The ProcessGroup registered under ``name`` (the name functional collectives take)."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def has_kernel_for_dispatch_key(op_name: str, key: str) -> bool:
    """Whether the dispatcher holds a kernel of ``op_name`` ("aten::mm", "aten::add.Tensor")
    for dispatch key ``key`` ("CUDA", "CompositeImplicitAutograd", ...). Private in 2.13."""
    import torch

    return torch._C._dispatch_has_kernel_for_dispatch_key(op_name, key)


def joint_graph_cse(graph):
    """aot_autograd's common-subexpression elimination of a joint graph (``fx_graph_cse``,
    private in 2.13): the min-cut partitioner runs it first, and would merge the copies of a
    transfer that ``tspc.passes.aot_graphs.split_recomputed_transfers`` makes, so tspc runs it
    before making them and then partitions with ``partitioner_without_cse``."""
    from torch._functorch.compile_utils import fx_graph_cse

    return fx_graph_cse(graph)


def partitioner_without_cse():
    """A context in which aot_autograd's partitioner skips its own CSE (``functorch.config``)."""
    from torch._functorch import config

    return config.patch(cse=False)


def autograd_cache_off():
    """A context in which aot_autograd neither looks up nor stores AOTAutograd cache entries,
    local or remote, even where ``force_autograd_cache`` is set (``functorch.config``)."""
    from torch._functorch import config

    return config.patch(enable_autograd_cache=False, enable_remote_autograd_cache=False)


def eager_backward_compile():
    """A context in which aot_autograd compiles the backward graph when it compiles the
    forward, not lazily at the first backward (``functorch.config``)."""
    from torch._functorch import config

    return config.patch(force_non_lazy_backward_lowering=True)


def current_dynamo_compile_id():
    """Dynamo's id of the frame compile in progress ("0/1": frame 0, its first recompile), or
    None outside one (``torch._guards.CompileContext``, private in 2.13): tspc's compile log
    names it so a line matches Dynamo's own ``TORCH_LOGS=recompiles`` output."""
    from torch._guards import CompileContext

    return CompileContext.current_compile_id()


def dynamo_counters():
    """Dynamo's process-wide counters (``torch._dynamo.utils.counters``, a
    ``defaultdict(Counter)``): tspc adds its own compile counts under ``"tspc"``."""
    from torch._dynamo.utils import counters

    return counters


def interpreter_state_functions() -> frozenset:
    """Functions Dynamo records in a graph that change functorch's interpreter-wide state: the
    vmap and jvp nesting levels and the forward-AD dual level (``torch._functorch.predispatch``,
    private in 2.13). Their results are usually unused, yet dropping one leaves the levels
    unbalanced: a graph that vmaps (transformers' Mamba scans with ``torch.func.vmap``) then
    fails in aot_autograd with "your tensor may have escaped from inside a function being
    vmapped". torch.fx's own list of side-effectful functions holds the jvp ones but not
    vmap's, so dead-code elimination must be told."""
    from torch._functorch import predispatch

    names = (
        "_vmap_increment_nesting",
        "_vmap_decrement_nesting",
        "_jvp_increment_nesting",
        "_jvp_decrement_nesting",
        "_enter_dual_level",
        "_exit_dual_level",
        "lazy_load_decompositions",
    )
    found = {getattr(predispatch, n) for n in names if hasattr(predispatch, n)}
    functorch_c = torch._C._functorch
    found |= {getattr(functorch_c, n) for n in names if hasattr(functorch_c, n)}
    return frozenset(found)


def global_state_snapshot():
    """Dynamo's snapshot of the global state its graphs depend on (grad mode, autocast,
    deterministic algorithms, default dtype, ...): ``.check()`` is True while it is unchanged
    (``torch._C._dynamo.guards.GlobalStateGuard``, private in 2.13). A compiled graph is reused
    for another trace only under the state it was compiled in."""
    from torch._C._dynamo.guards import GlobalStateGuard

    return GlobalStateGuard()


def register_work(tensor: torch.Tensor, work) -> None:
    """Put ``work`` in torch's registry of in-flight collectives, under ``tensor``'s storage:
    ``wait_tensor(tensor)`` then waits it (``torch._C._distributed_c10d._register_work``,
    what torch's functional collectives do; private in 2.13)."""
    torch._C._distributed_c10d._register_work(tensor, work)


def work_registry_size() -> int:
    """How many Works torch's registry holds (registered, not yet waited): 0 after a step
    whose every collective was waited (private in torch 2.13)."""
    return torch._C._distributed_c10d._get_work_registry_size()


def wait_tensor_op():
    """``_c10d_functional::wait_tensor``: completes every Work registered under a tensor and
    returns the tensor. aot_autograd, Inductor and the profiler know it as a collective's wait
    (a private operator namespace in torch 2.13)."""
    return torch.ops._c10d_functional.wait_tensor.default


@contextlib.contextmanager
def inductor_collective_lowerings(ops):
    """While the context is open, Inductor lowers each of ``ops`` (returns a new buffer that a
    collective writes until its ``wait_tensor``) as its own out-of-place collective kernel
    (``_CollectiveKernel``): ``_WaitKernel.get_volatile_reads`` then keeps the op's input
    buffer from being reused before the wait, while the network may still read it. The
    lowerings are removed again on exit: Inductor's table is the process's (private Inductor
    API in 2.13)."""
    from torch._inductor.comm_lowering import _create_out_of_place
    from torch._inductor.lowering import lowerings, register_lowering

    added = [op for op in ops if op not in lowerings]
    for op in added:
        register_lowering(op)(lambda inp, *args, op=op: _create_out_of_place(op, inp, *args))
    try:
        yield
    finally:
        for op in added:
            lowerings.pop(op, None)


@contextlib.contextmanager
def marked_side_effectful(fns):
    """While the context is open, torch.fx's dead-code elimination (and aot_autograd's and
    Inductor's, which ask ``Node.is_impure``) keeps calls of ``fns`` whose result is unused.
    ``torch.fx.node._side_effectful_functions`` is one set for the whole process (its note asks
    not to add operators to it for good): only those not already there are added, and removed
    on exit, so graphs compiled outside the context are untouched."""
    from torch.fx.node import _side_effectful_functions

    added = [f for f in fns if f not in _side_effectful_functions]
    _side_effectful_functions.update(added)
    try:
        yield
    finally:
        _side_effectful_functions.difference_update(added)


def optimized_module_class() -> type:
    """The class of ``torch.compile(module)``'s wrapper (``OptimizedModule``, in a private
    Dynamo module in torch 2.13): ``generate`` finds the user's model behind it."""
    from torch._dynamo.eval_frame import OptimizedModule

    return OptimizedModule


def op_schema(op: OpOverload):
    """The dispatcher schema of an op overload (its arguments, alias and mutation info)."""
    return op._schema


def op_base_name(op: OpOverload) -> str:
    """``add`` of ``aten::add.Tensor``."""
    return op._opname


def op_packet_qualified_name(packet: OpOverloadPacket) -> str:
    """``aten::add`` of the packet ``torch.ops.aten.add``."""
    return packet._qualified_op_name


def is_erased(node) -> bool:
    """Whether an fx node has been erased from its graph."""
    return node._erased


def tensor_version(t: torch.Tensor) -> int:
    """The tensor's in-place modification counter (autograd's version counter)."""
    return t._version


def keep_boxed_call(wrapped, wrapper) -> None:
    """Mark ``wrapper`` as taking its inputs boxed (one list) when ``wrapped`` does: aot
    autograd's calling convention, read from the private ``_boxed_call`` flag."""
    if getattr(wrapped, "_boxed_call", False):
        wrapper._boxed_call = True


def compiled_module_original(module):
    """The user's module behind ``torch.compile(module)``'s wrapper (``OptimizedModule``)."""
    return module._orig_mod


def compile_options(compiled) -> dict | None:
    """The ``options`` given to ``torch.compile(..., backend=..., options=...)`` that made
    ``compiled`` (an ``OptimizedModule`` or a compiled function), None if there were none or
    they cannot be found. Dynamo keeps them on the backend wrapper behind its frame callback
    (``_torchdynamo_orig_backend`` links, ending at ``torch._TorchCompileWrapper.kwargs``)."""
    ctx = getattr(compiled, "dynamo_ctx", None)
    if ctx is None:  # a compiled function: its context is a closure variable of the wrapper
        closure = getattr(compiled, "__closure__", None) or ()
        names = getattr(getattr(compiled, "__code__", None), "co_freevars", ())
        ctx = dict(zip(names, (c.cell_contents for c in closure))).get("self")
    backend = getattr(ctx, "callback", None)
    for _ in range(8):  # a short chain of wrappers
        if backend is None:
            return None
        kwargs = getattr(backend, "kwargs", None)
        if isinstance(kwargs, dict) and "options" in kwargs:
            options = kwargs["options"]
            return dict(options) if isinstance(options, dict) else None
        backend = getattr(backend, "_torchdynamo_orig_backend", None)
    return None


def outermost_module_call():
    """The outermost ``nn.Module`` whose ``__call__`` runs eagerly on the current Python stack
    (None if none): frames are matched against the code of ``nn.Module``'s private call
    implementations, the one place a module call shows on the stack."""
    calls = (torch.nn.Module._call_impl.__code__, torch.nn.Module._wrapped_call_impl.__code__)
    found = None
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in calls:
            m = frame.f_locals.get("self")
            if isinstance(m, torch.nn.Module):
                found = m
        frame = frame.f_back
    return found


def symbolic_fake_mode(length: int, name: str):
    """A fresh ``FakeTensorMode`` with its own ``ShapeEnv``, one symbolic size in it (hint
    ``length``) and that symbol: tspc hands aot_autograd fake inputs whose sequence dims are
    that symbol, so one trace serves every length (``ShapeEnv``, ``DimDynamic`` and the
    ``Source`` naming the symbol in guards are private in torch 2.13). Returns
    ``(fake_mode, shape_env, symint)``."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    shape_env = ShapeEnv()
    mode = FakeTensorMode(shape_env=shape_env, allow_non_fake_inputs=False)
    symint = shape_env.create_unspecified_symint_and_symbol(
        length, ConstantSource(name), DimDynamic.DYNAMIC
    )
    return mode, shape_env, symint


def shape_env_guards(shape_env) -> list:
    """The sympy expressions a symbolic trace assumed of its sizes (``ShapeEnv.guards``, private
    in torch 2.13): a length for which one is false needs another trace."""
    return [g.expr for g in shape_env.guards]


def storage_use_count(t: torch.Tensor) -> int:
    """How many tensors (TensorImpls) and storage handles share ``t``'s storage, the handle
    this call makes included (``torch._C._storage_Use_Count``, private in torch 2.13): above 2,
    another live tensor (a view, the flat buffer ``t`` was carved from, a tied alias) reads it,
    so freeing it would pull the data from under that tensor."""
    return torch._C._storage_Use_Count(t.untyped_storage()._cdata)


def maybe_mark_dynamic(t: torch.Tensor, dim: int) -> None:
    """Ask Dynamo to trace ``t``'s ``dim`` with a symbolic size from its first trace, without
    failing if the code makes it static (``torch._dynamo.maybe_mark_dynamic``)."""
    torch._dynamo.maybe_mark_dynamic(t, dim)


def mark_static(t: torch.Tensor, dim: int) -> None:
    """Keep ``t``'s ``dim`` a constant in Dynamo's traces, also after it changed between calls
    (``torch._dynamo.mark_static``: no automatic dynamic size there)."""
    torch._dynamo.mark_static(t, dim)


def is_inductor_codegen_error(error: BaseException) -> bool:
    """Whether ``error`` is Inductor's own failure to lower or generate code for a graph
    (``torch._inductor.exc.InductorError``), as opposed to one raised by a pass of ours."""
    from torch._inductor.exc import InductorError

    return isinstance(error, InductorError)


def donate_no_saved_buffers() -> None:
    """Called while aot_autograd compiles a backward graph: no saved activation is donated to
    it (the compile's ``fw_metadata.bw_donated_idxs`` is emptied, which Inductor reads for its
    buffer reuse and aot_autograd for its ``retain_graph`` check). tspc compiles the backward
    with the forward (``eager_backward_compile``); torch empties the donations only for a
    backward compiled lazily under ``retain_graph=True``, and with them kept every
    ``backward(retain_graph=True)`` that plain ``torch.compile`` runs is refused. (A donation
    lets Inductor write into a saved activation's buffer instead of a fresh one; the backward
    still frees each input after its last use.)"""
    from torch._guards import TracingContext

    ctx = TracingContext.try_get()
    if ctx is not None and ctx.fw_metadata is not None:
        ctx.fw_metadata.bw_donated_idxs = []


def copy_grad_hooks(src: torch.Tensor, dst: torch.Tensor, skip=lambda hook: False) -> None:
    """Register on ``dst`` the gradient hooks the user put on ``src`` (``register_hook``,
    ``register_post_accumulate_grad_hook``; torch keeps them in private attributes): a
    parameter tspc replaces by its DTensor keeps them, as it does under plain torch.compile.
    ``skip(hook)``: hooks not to copy (tspc's own, which it installs on ``dst`` itself)."""
    for hook in (getattr(src, "_backward_hooks", None) or {}).values():
        if not skip(hook):
            dst.register_hook(hook)
    for hook in (getattr(src, "_post_accumulate_grad_hooks", None) or {}).values():
        if not skip(hook):
            dst.register_post_accumulate_grad_hook(hook)
