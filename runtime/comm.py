"""The collectives the TSP schedules use: a start op that issues the transfer and a wait.

Each collective is two graph nodes. ``tspc::<kind>_start(x, ...) -> pending`` issues the
transfer asynchronously and returns the buffer it lands in, with the transfer's c10d Work
registered under that buffer in torch's own work registry (``_register_work``, what torch's
functional collectives do); ``tspc::<kind>_wait(pending, x, ...)`` completes it with
``_c10d_functional::wait_tensor`` and puts the result in the caller's layout (the zigzag
order of a gathered sequence, the values' dtype after a 16-bit sum moved in fp32). Between
the two, a scheduler can place compute, which is how communication hides behind GEMMs. There
is no tspc table of handles: a Work lives in torch's registry until ``wait_tensor`` pops it.

The waits are ``CompositeImplicitAutograd``: the graph passes see one ``tspc::<kind>_wait``
node (with the start's arguments, which they read), while aot_autograd traces it into
``_c10d_functional.wait_tensor(pending)`` and the plain layout ops after it, so the forward
and backward graphs that Inductor compiles hold torch's own wait, and Inductor lowers each
start as one of its collective kernels (``lowered_for_inductor``): ``wait_tensor``'s volatile
reads then keep the start's input buffer from being reused while the network reads it.
The starts are issued through the c10d API (``dist.broadcast``, ``all_gather_single``,
``reduce_scatter_single``, ``all_reduce``, ``reduce``, ``batch_isend_irecv``) rather than the
``_c10d_functional`` issue ops, whose own Work registration could not carry this graph's
``comm_timeout`` or name the layer in a timeout error; what is registered is a
``_TransferWork`` that waits the c10d Works and does both.

Until the wait, the buffer is being written by the network, so no compiled code may read it;
the start's output is consumed only by its wait, which makes that a data dependency. Both
nodes are marked side-effectful so that no dead-code or common-subexpression pass removes or
merges a collective.

The ops take the group *name*, the group size ``world`` (shapes depend on it, and it must be part
of a compiled graph's cache key rather than read from torch.distributed at trace time) and a
``tag`` naming the layer, under which the transfer is counted (``runtime.counters``).

Autograd (registered on the starts; ``wait_tensor`` passes gradients through, and the layout
ops of the waits differentiate as plain tensor ops): the adjoint of a weight broadcast is a
reduce of the gradient to the source; the adjoint of the all-gather is a reduce-scatter back
to the token owners (or, for the output gather whose consumers hold identical gradients on
every rank, just taking this rank's part); the adjoint of a sum all-reduce is an all-reduce.

Timeouts: a wait on a CPU (gloo) buffer waits each Work with this graph's timeout
(``timeout_scope``), and raises ``CollectiveTimeout`` naming the collective and the layer. On
CUDA, ``Work.wait()`` only makes the current stream wait (NCCL's semantics: no CPU blocking),
so the group's own timeout and its watchdog apply there.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .compat import (
    inductor_collective_lowerings,
    marked_side_effectful,
    register_work,
    wait_tensor_op,
)
from .counters import count_collective
from .group import process_group
from .precision import accumulation_dtype
from .zigzag import zigzag_stack_parts, zigzag_unshard


class CollectiveTimeout(RuntimeError):
    """A collective did not finish in time: a peer died, stalled, or ranks diverged."""


def _default_timeout() -> float | None:
    v = os.environ.get("TSPC_COMM_TIMEOUT")
    return float(v) if v else None


@dataclass
class _Settings:
    # Seconds a wait may block before raising CollectiveTimeout (None: the group's own timeout).
    timeout_s: float | None = None


SETTINGS = _Settings(timeout_s=_default_timeout())

# Timeouts of the graphs running now, innermost last (``timeout_scope``): a model compiled with
# options={"comm_timeout": t} gets t for its own collectives without changing anyone else's.
_SCOPED: list[float | None] = []


@contextlib.contextmanager
def timeout_scope(seconds: float | None):
    """Collectives issued inside use ``seconds`` (None: the process default, ``SETTINGS``)."""
    _SCOPED.append(seconds)
    try:
        yield
    finally:
        _SCOPED.pop()


def current_timeout() -> float | None:
    scoped = _SCOPED[-1] if _SCOPED else None
    return scoped if scoped is not None else SETTINGS.timeout_s


class _TransferWork(dist.Work):
    """The Work registered under a start's output: waits the c10d Works of one transfer
    (``wait_tensor`` calls it), with this graph's timeout, naming the collective on failure.
    It holds the tensors the transfer reads or writes until then (``keepalive``)."""

    def __init__(self, works, kind: str, tag: str, keepalive: tuple, on_cpu: bool):
        super().__init__()
        self._works = list(works)
        self._kind = kind
        self._tag = tag
        self._keepalive = keepalive
        # CPU blocking waits take a timeout; a CUDA wait only orders streams (see docstring).
        self._timeout = current_timeout() if on_cpu else None

    def wait(self, timeout=None) -> bool:
        try:
            for w in self._works:
                if self._timeout is None:
                    w.wait()
                else:
                    w.wait(timeout=timedelta(seconds=self._timeout))
        except RuntimeError as e:
            raise CollectiveTimeout(
                f"tspc: rank {dist.get_rank() if dist.is_initialized() else 0}: "
                f"{self._kind} for '{self._tag}' failed or did not complete"
                + (f" within {self._timeout:g}s" if self._timeout is not None else "")
                + f": {e}. A peer may have died or stalled, or the ranks may be running "
                "different graphs (set TSPC_COMM_TIMEOUT or options['comm_timeout'] to fail "
                "sooner)."
            ) from e
        finally:
            self._works, self._keepalive = [], ()
        return True


def _pending(out: torch.Tensor, works, kind: str, tag: str, keepalive: tuple) -> torch.Tensor:
    """Register the transfer writing ``out`` in torch's work registry and return ``out``."""
    register_work(out, _TransferWork(works, kind, tag, keepalive, out.device.type == "cpu"))
    return out


def wait_works(works, kind: str, tag: str, on_cpu: bool) -> None:
    """Wait c10d Works issued outside the start/wait ops (inside a runtime op), with this
    graph's timeout and the same ``CollectiveTimeout`` naming ``kind`` and the layer."""
    _TransferWork(works, kind, tag, (), on_cpu).wait()


def _wait(pending: torch.Tensor) -> torch.Tensor:
    return _WAIT_TENSOR(pending)


def _accumulation_copy(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy to reduce into: fp32 for 16-bit floats, whose sums over ranks would
    otherwise round at every step (gradients of bf16 training)."""
    acc = accumulation_dtype(x.dtype)
    if x.dtype != acc:
        return x.to(acc, memory_format=torch.contiguous_format)
    return x.contiguous().clone()


def _wire_dtype(x: torch.Tensor) -> torch.dtype:
    return accumulation_dtype(x.dtype)


def _define_wait(name: str, schema: str, body) -> None:
    """A wait op: ``CompositeImplicitAutograd``, so tracing turns it into ``wait_tensor`` and
    the layout ops of ``body`` (module docstring)."""
    torch.library.define(f"tspc::{name}", schema, lib=_LIB)
    torch.library.impl(f"tspc::{name}", "CompositeImplicitAutograd", lib=_LIB)(body)


_LIB = torch.library.Library("tspc", "FRAGMENT")

# --------------------------------------------------------------------------- broadcast


@torch.library.custom_op("tspc::broadcast_start", mutates_args=())
def broadcast_start(
    x: torch.Tensor, src: int, numel: int, group: str, world: int, tag: str
) -> torch.Tensor:
    """Broadcast a flat buffer of ``numel`` elements from ``src``; ``x`` is this rank's own
    buffer, sent when this rank is the source (the sources' buffers may differ in size)."""
    pg = process_group(group)
    buf = x.new_empty((numel,))
    is_src = dist.get_rank(pg) == src
    if is_src:
        buf.copy_(x.reshape(-1))
    work = dist.broadcast(buf, group_src=src, group=pg, async_op=True)
    count_collective("broadcast", tag, buf, world, is_src)
    return _pending(buf, [work], "broadcast", tag, ())  # x was copied into buf


broadcast_start.register_fake(lambda x, src, numel, group, world, tag: x.new_empty((numel,)))


def _broadcast_setup(ctx, inputs, output):
    _, ctx.src, _, ctx.group, ctx.world, ctx.tag = inputs


def _broadcast_backward(ctx, grad):
    # The source's buffer gets the sum of every rank's gradient; the others get none: every
    # rank takes part in the reduce, but a rank that is not the source drops what it gets
    # back at once. (Zeros here would be a buffer of the source's size alive until autograd
    # adds it to this rank's own buffer's gradient: up to two such buffers, a head group's
    # weights each, were alive at the backward's peak.)
    g = reduce(grad, ctx.src, ctx.group, ctx.world, ctx.tag)
    if dist.get_rank(process_group(ctx.group)) != ctx.src:
        return None, None, None, None, None, None
    return g, None, None, None, None, None


torch.library.register_autograd(
    "tspc::broadcast_start", _broadcast_backward, setup_context=_broadcast_setup
)

_define_wait(
    "broadcast_wait",
    "(Tensor pending, Tensor x, int src, int numel, str group, int world, str tag) -> Tensor",
    lambda pending, x, src, numel, group, world, tag: _wait(pending),
)

# --------------------------------------------------------------------------- reduce


@torch.library.custom_op("tspc::reduce_start", mutates_args=())
def reduce_start(x: torch.Tensor, dst: int, group: str, world: int, tag: str) -> torch.Tensor:
    """Sum ``x`` over the ranks into ``dst`` (fp32 for 16-bit values). The other ranks'
    result is zeros: they hold no gradient for this shard, and some backends leave partial
    sums in their scratch buffer (kept alive by the Work until the wait)."""
    pg = process_group(group)
    buf = _accumulation_copy(x)
    is_dst = dist.get_rank(pg) == dst
    work = dist.reduce(buf, group_dst=dst, group=pg, async_op=True)
    count_collective("reduce", tag, buf, world, is_dst)
    out = buf if is_dst else torch.zeros_like(buf)
    # x is not kept: what travels is its copy, so x may die once the start has made it
    return _pending(out, [work], "reduce", tag, (buf,))


reduce_start.register_fake(
    lambda x, dst, group, world, tag: x.new_empty(x.shape, dtype=_wire_dtype(x))
)

_define_wait(
    "reduce_wait",
    "(Tensor pending, Tensor x, int dst, str group, int world, str tag) -> Tensor",
    lambda pending, x, dst, group, world, tag: _wait(pending).to(x.dtype),
)

# --------------------------------------------------------------------------- zigzag all-gather


@torch.library.custom_op("tspc::all_gather_start", mutates_args=())
def all_gather_start(
    x: torch.Tensor,
    dim: int,
    outer: int,
    inner: int,
    reduce_grad: bool,
    group: str,
    world: int,
    tag: str,
) -> torch.Tensor:
    """Gather every rank's ``x`` into ``[D, *x.shape]`` (the wait puts it in token order)."""
    pg = process_group(group)
    xc = x.contiguous().reshape(1, *x.shape)  # gather along a new leading rank dimension
    out = xc.new_empty((world, *x.shape))
    work = dist.all_gather_single(out, xc, group=pg, async_op=True)
    count_collective("all_gather", tag, xc, world)
    return _pending(out, [work], "all_gather", tag, (xc,))  # what is sent, not x


all_gather_start.register_fake(
    lambda x, dim, outer, inner, reduce_grad, group, world, tag: x.new_empty((world, *x.shape))
)


def _all_gather_setup(ctx, inputs, output):
    x, _, _, _, ctx.reduce_grad, ctx.group, ctx.world, ctx.tag = inputs
    ctx.x_dtype = x.dtype


def _all_gather_backward(ctx, grad):
    # ``grad``: [D, *local], every rank's part (the wait's zigzag reordering differentiates
    # as the plain tensor ops it is).
    if ctx.reduce_grad:
        # Gradients of replicated values are partial sums over ranks (see passes/layout.py):
        # the true gradient of my tokens is the sum over ranks of my part.
        g = reduce_scatter_parts(grad, ctx.group, ctx.world, ctx.tag)
    else:
        # Every rank holds the same, complete gradient (user code after an output gather).
        g = grad[dist.get_rank(process_group(ctx.group))]
    return g.to(ctx.x_dtype), None, None, None, None, None, None, None


torch.library.register_autograd(
    "tspc::all_gather_start", _all_gather_backward, setup_context=_all_gather_setup
)

_define_wait(
    "all_gather_wait",
    "(Tensor pending, Tensor x, int dim, int outer, int inner, bool reduce_grad, str group, "
    "int world, str tag) -> Tensor",
    lambda pending, x, dim, outer, inner, reduce_grad, group, world, tag: zigzag_unshard(
        _wait(pending), dim, world, outer, inner
    ),
)

# --------------------------------------------------------------------------- reduce-scatter


@torch.library.custom_op("tspc::reduce_scatter_start", mutates_args=())
def reduce_scatter_start(x: torch.Tensor, group: str, world: int, tag: str) -> torch.Tensor:
    """Sum ``x`` = ``[D, *part]`` over the ranks; rank r receives the sum of part r, as
    ``[1, *part]`` (fp32 for 16-bit values)."""
    pg = process_group(group)
    parts = _accumulation_copy(x)
    out = parts.new_empty((1, *parts.shape[1:]))
    work = dist.reduce_scatter_single(out, parts, group=pg, async_op=True)
    count_collective("reduce_scatter", tag, out, world)
    return _pending(out, [work], "reduce_scatter", tag, (parts,))


reduce_scatter_start.register_fake(
    lambda x, group, world, tag: x.new_empty((1, *x.shape[1:]), dtype=_wire_dtype(x))
)

_define_wait(
    "reduce_scatter_wait",
    "(Tensor pending, Tensor x, str group, int world, str tag) -> Tensor",
    lambda pending, x, group, world, tag: _wait(pending)[0].to(x.dtype),
)

# --------------------------------------------------------------------------- ring hop (p2p)


@torch.library.custom_op("tspc::ring_start", mutates_args=())
def ring_start(x: torch.Tensor, shift: int, group: str, world: int, tag: str) -> torch.Tensor:
    """Send ``x`` to rank ``(r + shift) % D`` and receive the same-shaped buffer from
    ``(r - shift) % D``: one hop of a ring when ``shift`` is +1 or -1."""
    return _ring_hop_start(x, shift, group, world, tag)


def _ring_hop_start(x: torch.Tensor, shift: int, group: str, world: int, tag: str) -> torch.Tensor:
    pg = process_group(group)
    rank = dist.get_rank(pg)
    xc = x.contiguous()
    buf = torch.empty_like(xc)
    ops = [
        dist.P2POp(dist.isend, xc, group=pg, group_peer=(rank + shift) % world),
        dist.P2POp(dist.irecv, buf, group=pg, group_peer=(rank - shift) % world),
    ]
    works = dist.batch_isend_irecv(ops)
    count_collective("ring", tag, xc, world)
    return _pending(buf, works, "ring", tag, (xc,))


def _ring_fake(x, shift, group, world, tag):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


_RING_WAIT_SCHEMA = "(Tensor pending, Tensor x, int shift, str group, int world, str tag) -> Tensor"

ring_start.register_fake(_ring_fake)
_define_wait(
    "ring_wait", _RING_WAIT_SCHEMA, lambda pending, x, shift, group, world, tag: _wait(pending)
)


# A hop of one sub-shard chunk of the MLP ring (``ring_mlp(..., hop_chunks=k)``): the same
# transfer as ``ring_start``/``ring_wait``. A distinct op because the overlap scheduler must leave
# these where the ring placed them: each chunk's hop is waited right after the compute it
# overlaps, so that its send buffer dies and only about one chunk per stream is in flight. The
# scheduler's rule for whole-shard hops (wait at the first use, one step later) would keep
# every chunk's send buffer alive for a step: two shards again.
@torch.library.custom_op("tspc::ring_chunk_start", mutates_args=())
def ring_chunk_start(x: torch.Tensor, shift: int, group: str, world: int, tag: str) -> torch.Tensor:
    return _ring_hop_start(x, shift, group, world, tag)


ring_chunk_start.register_fake(_ring_fake)
_define_wait(
    "ring_chunk_wait",
    _RING_WAIT_SCHEMA,
    lambda pending, x, shift, group, world, tag: _wait(pending),
)

# --------------------------------------------------------------------------- all-reduce


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@torch.library.custom_op("tspc::all_reduce_start", mutates_args=())
def all_reduce_start(x: torch.Tensor, op: str, group: str, world: int, tag: str) -> torch.Tensor:
    pg = process_group(group)
    buf = _accumulation_copy(x) if op == "sum" else x.contiguous().clone()
    work = dist.all_reduce(buf, op=_REDUCE_OPS[op], group=pg, async_op=True)
    count_collective("all_reduce", tag, buf, world)
    # x is not kept: what travels is its copy (the graph keeps x as long as it needs it)
    return _pending(buf, [work], "all_reduce", tag, ())


all_reduce_start.register_fake(
    lambda x, op, group, world, tag: x.new_empty(
        x.shape, dtype=_wire_dtype(x) if op == "sum" else x.dtype
    )
)


def _all_reduce_setup(ctx, inputs, output):
    x, ctx.op, ctx.group, ctx.world, ctx.tag = inputs
    ctx.x_dtype = x.dtype


def _all_reduce_backward(ctx, grad):
    if ctx.op != "sum":
        raise RuntimeError("tspc: only a sum all-reduce is differentiable")
    g = all_reduce(grad, "sum", ctx.group, ctx.world, ctx.tag).to(ctx.x_dtype)
    return g, None, None, None, None


torch.library.register_autograd(
    "tspc::all_reduce_start", _all_reduce_backward, setup_context=_all_reduce_setup
)

_define_wait(
    "all_reduce_wait",
    "(Tensor pending, Tensor x, str op, str group, int world, str tag) -> Tensor",
    lambda pending, x, op, group, world, tag: _wait(pending).to(x.dtype),
)

_STARTS = {
    torch.ops.tspc.broadcast_start.default: ("broadcast", torch.ops.tspc.broadcast_wait.default),
    torch.ops.tspc.reduce_start.default: ("reduce", torch.ops.tspc.reduce_wait.default),
    torch.ops.tspc.all_gather_start.default: ("all_gather", torch.ops.tspc.all_gather_wait.default),
    torch.ops.tspc.reduce_scatter_start.default: (
        "reduce_scatter",
        torch.ops.tspc.reduce_scatter_wait.default,
    ),
    torch.ops.tspc.ring_start.default: ("ring", torch.ops.tspc.ring_wait.default),
    torch.ops.tspc.ring_chunk_start.default: ("ring", torch.ops.tspc.ring_chunk_wait.default),
    torch.ops.tspc.all_reduce_start.default: ("all_reduce", torch.ops.tspc.all_reduce_wait.default),
}
_WAIT_TENSOR = wait_tensor_op()

# Ops a graph must run even where their result is unused: a wait pops the Work from torch's
# registry, a start issues a transfer its peers wait for. tspc's passes keep them
# (``passes/graph_utils.has_side_effects``); aot_autograd and Inductor are told so only while
# they compile tspc's graphs (``collectives_kept``), not process-wide.
SIDE_EFFECT_OPS = frozenset((*_STARTS, *(w for _, w in _STARTS.values()), _WAIT_TENSOR))


def collectives_kept():
    """A context (and decorator) in which fx's dead-code elimination keeps ``SIDE_EFFECT_OPS``."""
    return marked_side_effectful(SIDE_EFFECT_OPS)


# start op -> its wait op in the graphs tspc's passes build (aot_autograd traces that wait
# into ``wait_tensor`` and layout ops), and start op -> the collective's kind
START_TO_WAIT = {start: wait for start, (_, wait) in _STARTS.items()}
START_KIND = {start: kind for start, (kind, _) in _STARTS.items()}
WAIT_OPS = frozenset(START_TO_WAIT.values())
# Transfers the overlap scheduler leaves where the code that issued them put them.
FIXED_STARTS = frozenset({torch.ops.tspc.ring_chunk_start.default})


def is_transfer_start(node) -> bool:
    """An FX node that starts one of tspc's collectives."""
    return node.op == "call_function" and node.target in START_KIND


def is_transfer_wait(node) -> bool:
    """A node that completes one: a ``tspc::<kind>_wait`` (graphs of tspc's passes) or the
    ``wait_tensor`` of a tspc start (the forward / backward graphs aot_autograd traces)."""
    if node.op != "call_function":
        return False
    if node.target in WAIT_OPS:
        return True
    return (
        node.target is _WAIT_TENSOR
        and isinstance(node.args[0], torch.fx.Node)
        and is_transfer_start(node.args[0])
    )


def is_transfer(node) -> bool:
    """The one predicate for "this node is a collective" (a start or a wait) in a graph."""
    return is_transfer_start(node) or is_transfer_wait(node)


def wait_of(start) -> torch.fx.Node | None:
    """The node that completes the transfer ``start`` issues (None if the graph has none)."""
    return next((u for u in start.users if is_transfer_wait(u)), None)


def lowered_for_inductor():
    """A context in which Inductor lowers every tspc start as a collective kernel (``compat``'s
    ``inductor_collective_lowerings``), removed again on exit."""
    return inductor_collective_lowerings(START_KIND)


# --------------------------------------------------------------------------- synchronous helpers
# Start immediately followed by wait; the scheduler may still pull them apart in a graph.


def broadcast(x, src, numel, group, world, tag):
    h = torch.ops.tspc.broadcast_start(x, src, numel, group, world, tag)
    return torch.ops.tspc.broadcast_wait(h, x, src, numel, group, world, tag)


def reduce(x, dst, group, world, tag):
    return torch.ops.tspc.reduce_wait(
        torch.ops.tspc.reduce_start(x, dst, group, world, tag), x, dst, group, world, tag
    )


def all_gather(x, dim, outer, inner, reduce_grad, group, world, tag):
    h = torch.ops.tspc.all_gather_start(x, dim, outer, inner, reduce_grad, group, world, tag)
    return torch.ops.tspc.all_gather_wait(h, x, dim, outer, inner, reduce_grad, group, world, tag)


def reduce_scatter_parts(parts, group, world, tag):
    """Rank r gets the sum over ranks of ``parts[r]`` (``parts``: ``[D, *part]``)."""
    h = torch.ops.tspc.reduce_scatter_start(parts, group, world, tag)
    return torch.ops.tspc.reduce_scatter_wait(h, parts, group, world, tag)


def reduce_scatter(x, dim, outer, inner, group, world, tag):
    """The adjoint of the zigzag all-gather: rank r gets the sum over ranks of its zigzag
    part of ``x`` along ``dim``."""
    return reduce_scatter_parts(zigzag_stack_parts(x, dim, world, outer, inner), group, world, tag)


def ring_hop(x, shift, group, world, tag):
    h = torch.ops.tspc.ring_start(x, shift, group, world, tag)
    return torch.ops.tspc.ring_wait(h, x, shift, group, world, tag)


def all_reduce(x, op, group, world, tag):
    h = torch.ops.tspc.all_reduce_start(x, op, group, world, tag)
    return torch.ops.tspc.all_reduce_wait(h, x, op, group, world, tag)
