"""The collectives the TSP schedules use, as ``torch.library`` custom ops with a separate wait.

Each collective is two graph nodes: ``tspc::<kind>_start(...) -> handle`` issues the transfer
asynchronously and returns a small int64 handle; ``tspc::<kind>_wait(handle, x, ...) -> result``
blocks until it is done and returns the result. Between the two, a scheduler can place compute,
which is how communication hides behind GEMMs. Both nodes are marked side-effectful so that no
dead-code or common-subexpression pass removes or merges a collective.

Why a handle instead of returning the receive buffer from ``start``: the buffer is being written
by the network until the wait, so no compiled code may read it or reuse its memory before then.
Returning it only from ``wait`` makes that a data dependency. The wait also takes the start's
input ``x``, so ``x`` stays alive (and unmodified by buffer reuse) while the transfer reads it.

The ops take the group *name*, the group size ``world`` (shapes depend on it, and it must be part
of a compiled graph's cache key rather than read from torch.distributed at trace time) and a
``tag`` naming the layer, under which the transfer is counted (``runtime.counters``).

Autograd: the adjoint of a weight broadcast is a reduce of the gradient to the source; the
adjoint of the zigzag all-gather is a reduce-scatter back to the token owners (or, for the
output gather whose consumers hold identical gradients on every rank, just taking this rank's
slice); the adjoint of a sum all-reduce is an all-reduce.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .counters import COUNTER, received_and_sent
from .group import process_group
from .zigzag import zigzag_slice, zigzag_stack_parts, zigzag_unshard


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
    """Collectives waited inside use ``seconds`` (None: the process default, ``SETTINGS``)."""
    _SCOPED.append(seconds)
    try:
        yield
    finally:
        _SCOPED.pop()


def current_timeout() -> float | None:
    scoped = _SCOPED[-1] if _SCOPED else None
    return scoped if scoped is not None else SETTINGS.timeout_s


@dataclass
class _Pending:
    works: list
    finish: Callable[[], torch.Tensor]
    kind: str
    tag: str
    keepalive: tuple


_PENDING: dict[int, _Pending] = {}
_IDS = itertools.count(1)


def _register(works, finish, kind: str, tag: str, keepalive: tuple) -> torch.Tensor:
    hid = next(_IDS)
    _PENDING[hid] = _Pending(works, finish, kind, tag, keepalive)
    return torch.tensor(hid, dtype=torch.int64)


def _complete(handle: torch.Tensor) -> torch.Tensor:
    hid = int(handle.item())
    pending = _PENDING.pop(hid, None)
    if pending is None:
        raise RuntimeError(
            f"tspc: wait on unknown collective handle {hid} (waited twice, or the start was "
            "removed from the graph); this is a bug in a graph pass"
        )
    timeout = current_timeout()
    for w in pending.works:
        try:
            if timeout is None:
                w.wait()
            else:
                w.wait(timeout=timedelta(seconds=timeout))
        except RuntimeError as e:
            where = f"{pending.kind} for '{pending.tag}'"
            rank = dist.get_rank() if dist.is_initialized() else 0
            raise CollectiveTimeout(
                f"tspc: rank {rank}: {where} failed or did not complete"
                + (f" within {timeout:g}s" if timeout is not None else "")
                + f": {e}. A peer may have died or stalled, or the ranks may be running "
                "different graphs (set TSPC_COMM_TIMEOUT or options['comm_timeout'] to fail "
                "sooner)."
            ) from e
    return pending.finish()


def _count(kind: str, tag: str, sent_buffer: torch.Tensor, world: int, is_root: bool = False):
    """Count the collective by the buffer that really travels (its dtype is the wire's: an
    fp32 accumulation copy for 16-bit sums), with the one table of ``counters.py``."""
    message = sent_buffer.numel() * sent_buffer.element_size()
    recv, sent = received_and_sent(kind, message, world, is_root)
    COUNTER.record(kind, tag, recv=recv, sent=sent)


def _accumulation_copy(x: torch.Tensor) -> torch.Tensor:
    """A contiguous copy to reduce into: fp32 for 16-bit floats, whose sums over ranks would
    otherwise round at every step (gradients of bf16 training)."""
    if x.dtype in (torch.bfloat16, torch.float16):
        return x.to(torch.float32, memory_format=torch.contiguous_format)
    return x.contiguous().clone()


def _handle_fake(x: torch.Tensor) -> torch.Tensor:
    return torch.empty((), dtype=torch.int64)


def _side_effectful(*ops) -> None:
    for op in ops:
        torch.fx.node.has_side_effect(op.default)


# --------------------------------------------------------------------------- broadcast


@torch.library.custom_op("tspc::broadcast_start", mutates_args=())
def broadcast_start(
    x: torch.Tensor, src: int, numel: int, group: str, world: int, tag: str
) -> torch.Tensor:
    """Broadcast a flat buffer of ``numel`` elements from ``src``; ``x`` is this rank's own
    buffer, sent when this rank is the source (the sources' buffers may differ in size)."""
    pg = process_group(group)
    is_src = dist.get_rank(pg) == src
    if is_src:
        # The source sends its own buffer (a broadcast only reads it there) and copies it for
        # the result when the transfer is done: one copy of the shard in flight, not two.
        buf = x.contiguous().reshape(-1)
        work = dist.broadcast(buf, group_src=src, group=pg, async_op=True)
        _count("broadcast", tag, buf, world, is_src)
        return _register([work], buf.clone, "broadcast", tag, (x, buf))
    buf = x.new_empty((numel,))
    work = dist.broadcast(buf, group_src=src, group=pg, async_op=True)
    _count("broadcast", tag, buf, world, is_src)
    return _register([work], lambda: buf, "broadcast", tag, (x,))


broadcast_start.register_fake(lambda x, src, numel, group, world, tag: _handle_fake(x))


@torch.library.custom_op("tspc::broadcast_wait", mutates_args=())
def broadcast_wait(
    handle: torch.Tensor, x: torch.Tensor, src: int, numel: int, group: str, world: int, tag: str
) -> torch.Tensor:
    return _complete(handle)


broadcast_wait.register_fake(lambda handle, x, src, numel, group, world, tag: x.new_empty((numel,)))


def _broadcast_setup(ctx, inputs, output):
    _, x, ctx.src, _, ctx.group, ctx.world, ctx.tag = inputs
    ctx.x_numel = x.numel()


def _broadcast_backward(ctx, grad):
    # The source's buffer gets the sum of every rank's gradient; the others get none: every
    # rank takes part in the reduce, but a rank that is not the source drops what it gets
    # back at once. (Zeros here would be a buffer of the source's size alive until autograd
    # adds it to this rank's own buffer's gradient: up to two such buffers, a head group's
    # weights each, were alive at the backward's peak.)
    g = reduce(grad, ctx.src, ctx.group, ctx.world, ctx.tag)
    if dist.get_rank(process_group(ctx.group)) != ctx.src:
        return None, None, None, None, None, None, None
    return None, g, None, None, None, None, None


torch.library.register_autograd(
    "tspc::broadcast_wait", _broadcast_backward, setup_context=_broadcast_setup
)

# --------------------------------------------------------------------------- reduce


@torch.library.custom_op("tspc::reduce_start", mutates_args=())
def reduce_start(x: torch.Tensor, dst: int, group: str, world: int, tag: str) -> torch.Tensor:
    pg = process_group(group)
    buf = _accumulation_copy(x)
    is_dst = dist.get_rank(pg) == dst
    work = dist.reduce(buf, group_dst=dst, group=pg, async_op=True)
    _count("reduce", tag, buf, world, is_dst)

    dtype = x.dtype

    def finish():
        # Non-destination ranks hold no gradient for this shard: return zeros, not the
        # partially reduced scratch that some backends leave in the buffer.
        out = buf if is_dst else buf.zero_()
        return out.to(dtype)

    # x is not kept: what travels is its copy (``reduce`` lets x die at the start)
    return _register([work], finish, "reduce", tag, ())


reduce_start.register_fake(lambda x, dst, group, world, tag: _handle_fake(x))


@torch.library.custom_op("tspc::reduce_wait", mutates_args=())
def reduce_wait(
    handle: torch.Tensor, x: torch.Tensor, dst: int, group: str, world: int, tag: str
) -> torch.Tensor:
    return _complete(handle)


reduce_wait.register_fake(
    lambda handle, x, dst, group, world, tag: torch.empty_like(
        x, memory_format=torch.contiguous_format
    )
)

# --------------------------------------------------------------------------- zigzag all-gather


def _gathered_shape(x: torch.Tensor, dim: int, world: int) -> list[int]:
    shape = list(x.shape)
    shape[dim % x.dim()] *= world
    return shape


@torch.library.custom_op("tspc::all_gather_start", mutates_args=())
def all_gather_start(
    x: torch.Tensor, dim: int, outer: int, inner: int, group: str, world: int, tag: str
) -> torch.Tensor:
    pg = process_group(group)
    xc = x.contiguous().reshape(1, *x.shape)  # gather along a new leading rank dimension
    out = xc.new_empty((world, *x.shape))
    work = dist.all_gather_single(out, xc, group=pg, async_op=True)
    _count("all_gather", tag, xc, world)
    return _register(
        [work], lambda: zigzag_unshard(out, dim, world, outer, inner), "all_gather", tag, (x, xc)
    )


all_gather_start.register_fake(lambda x, dim, outer, inner, group, world, tag: _handle_fake(x))


@torch.library.custom_op("tspc::all_gather_wait", mutates_args=())
def all_gather_wait(
    handle: torch.Tensor,
    x: torch.Tensor,
    dim: int,
    outer: int,
    inner: int,
    reduce_grad: bool,
    group: str,
    world: int,
    tag: str,
) -> torch.Tensor:
    return _complete(handle)


all_gather_wait.register_fake(
    lambda handle, x, dim, outer, inner, reduce_grad, group, world, tag: x.new_empty(
        _gathered_shape(x, dim, world)
    )
)


def _all_gather_setup(ctx, inputs, output):
    _, x, ctx.dim, ctx.outer, ctx.inner, ctx.reduce_grad, ctx.group, ctx.world, ctx.tag = inputs


def _all_gather_backward(ctx, grad):
    if ctx.reduce_grad:
        # Gradients of replicated values are partial sums over ranks (see passes/layout.py):
        # the true gradient of my tokens is the sum over ranks of my slice.
        g = reduce_scatter(grad, ctx.dim, ctx.outer, ctx.inner, ctx.group, ctx.world, ctx.tag)
    else:
        # Every rank holds the same, complete gradient (user code after an output gather).
        rank = dist.get_rank(process_group(ctx.group))
        g = zigzag_slice(grad, ctx.dim, rank, ctx.world, ctx.outer, ctx.inner)
    return None, g, None, None, None, None, None, None, None


torch.library.register_autograd(
    "tspc::all_gather_wait", _all_gather_backward, setup_context=_all_gather_setup
)

# --------------------------------------------------------------------------- zigzag reduce-scatter


def _scattered_shape(x: torch.Tensor, dim: int, world: int) -> list[int]:
    shape = list(x.shape)
    shape[dim % x.dim()] //= world
    return shape


@torch.library.custom_op("tspc::reduce_scatter_start", mutates_args=())
def reduce_scatter_start(
    x: torch.Tensor, dim: int, outer: int, inner: int, group: str, world: int, tag: str
) -> torch.Tensor:
    pg = process_group(group)
    parts = _accumulation_copy(zigzag_stack_parts(x, dim, world, outer, inner))
    out = parts.new_empty((1, *parts.shape[1:]))
    work = dist.reduce_scatter_single(out, parts, group=pg, async_op=True)
    _count("reduce_scatter", tag, out, world)
    return _register([work], lambda: out[0].to(x.dtype), "reduce_scatter", tag, (x, parts))


reduce_scatter_start.register_fake(lambda x, dim, outer, inner, group, world, tag: _handle_fake(x))


@torch.library.custom_op("tspc::reduce_scatter_wait", mutates_args=())
def reduce_scatter_wait(
    handle: torch.Tensor,
    x: torch.Tensor,
    dim: int,
    outer: int,
    inner: int,
    group: str,
    world: int,
    tag: str,
) -> torch.Tensor:
    return _complete(handle)


reduce_scatter_wait.register_fake(
    lambda handle, x, dim, outer, inner, group, world, tag: x.new_empty(
        _scattered_shape(x, dim, world)
    )
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
    _count("ring", tag, xc, world)
    return _register(works, lambda: buf, "ring", tag, (x, xc))


ring_start.register_fake(lambda x, shift, group, world, tag: _handle_fake(x))


@torch.library.custom_op("tspc::ring_wait", mutates_args=())
def ring_wait(
    handle: torch.Tensor, x: torch.Tensor, shift: int, group: str, world: int, tag: str
) -> torch.Tensor:
    return _complete(handle)


ring_wait.register_fake(
    lambda handle, x, shift, group, world, tag: torch.empty_like(
        x, memory_format=torch.contiguous_format
    )
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


ring_chunk_start.register_fake(lambda x, shift, group, world, tag: _handle_fake(x))


@torch.library.custom_op("tspc::ring_chunk_wait", mutates_args=())
def ring_chunk_wait(
    handle: torch.Tensor, x: torch.Tensor, shift: int, group: str, world: int, tag: str
) -> torch.Tensor:
    return _complete(handle)


ring_chunk_wait.register_fake(
    lambda handle, x, shift, group, world, tag: torch.empty_like(
        x, memory_format=torch.contiguous_format
    )
)

# --------------------------------------------------------------------------- all-reduce


_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


@torch.library.custom_op("tspc::all_reduce_start", mutates_args=())
def all_reduce_start(x: torch.Tensor, op: str, group: str, world: int, tag: str) -> torch.Tensor:
    pg = process_group(group)
    buf = _accumulation_copy(x) if op == "sum" else x.contiguous().clone()
    work = dist.all_reduce(buf, op=_REDUCE_OPS[op], group=pg, async_op=True)
    _count("all_reduce", tag, buf, world)
    dtype = x.dtype
    # x is not kept: what travels is its copy (the graph keeps x as long as it needs it)
    return _register([work], lambda: buf.to(dtype), "all_reduce", tag, ())


all_reduce_start.register_fake(lambda x, op, group, world, tag: _handle_fake(x))


@torch.library.custom_op("tspc::all_reduce_wait", mutates_args=())
def all_reduce_wait(
    handle: torch.Tensor, x: torch.Tensor, op: str, group: str, world: int, tag: str
) -> torch.Tensor:
    return _complete(handle)


all_reduce_wait.register_fake(
    lambda handle, x, op, group, world, tag: torch.empty_like(
        x, memory_format=torch.contiguous_format
    )
)


def _all_reduce_setup(ctx, inputs, output):
    _, _, ctx.op, ctx.group, ctx.world, ctx.tag = inputs


def _all_reduce_backward(ctx, grad):
    if ctx.op != "sum":
        raise RuntimeError("tspc: only a sum all-reduce is differentiable")
    return None, all_reduce(grad, "sum", ctx.group, ctx.world, ctx.tag), None, None, None, None


torch.library.register_autograd(
    "tspc::all_reduce_wait", _all_reduce_backward, setup_context=_all_reduce_setup
)

_side_effectful(
    torch.ops.tspc.broadcast_start,
    torch.ops.tspc.broadcast_wait,
    torch.ops.tspc.reduce_start,
    torch.ops.tspc.reduce_wait,
    torch.ops.tspc.all_gather_start,
    torch.ops.tspc.all_gather_wait,
    torch.ops.tspc.reduce_scatter_start,
    torch.ops.tspc.reduce_scatter_wait,
    torch.ops.tspc.ring_start,
    torch.ops.tspc.ring_wait,
    torch.ops.tspc.ring_chunk_start,
    torch.ops.tspc.ring_chunk_wait,
    torch.ops.tspc.all_reduce_start,
    torch.ops.tspc.all_reduce_wait,
)

# start op -> its wait op, for the scheduler and the reports
START_TO_WAIT = {
    torch.ops.tspc.broadcast_start.default: torch.ops.tspc.broadcast_wait.default,
    torch.ops.tspc.reduce_start.default: torch.ops.tspc.reduce_wait.default,
    torch.ops.tspc.all_gather_start.default: torch.ops.tspc.all_gather_wait.default,
    torch.ops.tspc.reduce_scatter_start.default: torch.ops.tspc.reduce_scatter_wait.default,
    torch.ops.tspc.ring_start.default: torch.ops.tspc.ring_wait.default,
    torch.ops.tspc.ring_chunk_start.default: torch.ops.tspc.ring_chunk_wait.default,
    torch.ops.tspc.all_reduce_start.default: torch.ops.tspc.all_reduce_wait.default,
}
START_KIND = {
    torch.ops.tspc.broadcast_start.default: "broadcast",
    torch.ops.tspc.reduce_start.default: "reduce",
    torch.ops.tspc.all_gather_start.default: "all_gather",
    torch.ops.tspc.reduce_scatter_start.default: "reduce_scatter",
    torch.ops.tspc.ring_start.default: "ring",
    torch.ops.tspc.ring_chunk_start.default: "ring",
    torch.ops.tspc.all_reduce_start.default: "all_reduce",
}
WAIT_OPS = frozenset(START_TO_WAIT.values())
# Transfers the overlap scheduler leaves where the code that issued them put them.
FIXED_STARTS = frozenset({torch.ops.tspc.ring_chunk_start.default})


def is_transfer_start(node) -> bool:
    """An FX node that starts one of tspc's collectives (its wait is ``START_TO_WAIT``)."""
    return node.op == "call_function" and node.target in START_KIND


def is_transfer_wait(node) -> bool:
    return node.op == "call_function" and node.target in WAIT_OPS


def is_transfer(node) -> bool:
    """The one predicate for "this node is a collective" (a start or a wait) in a graph."""
    return is_transfer_start(node) or is_transfer_wait(node)


# --------------------------------------------------------------------------- synchronous helpers
# Start immediately followed by wait; the scheduler may still pull them apart in a graph.


def broadcast(x, src, numel, group, world, tag):
    h = torch.ops.tspc.broadcast_start(x, src, numel, group, world, tag)
    return torch.ops.tspc.broadcast_wait(h, x, src, numel, group, world, tag)


def reduce(x, dst, group, world, tag):
    h = torch.ops.tspc.reduce_start(x, dst, group, world, tag)
    # The wait reads only x's shape and dtype (its result is the reduce's own buffer): a
    # zero-stride stand-in lets x die once the start has copied it, instead of living beside
    # the copy until the wait (a head group's weight gradient per reduce in flight).
    return torch.ops.tspc.reduce_wait(h, _shape_of(x), dst, group, world, tag)


def _shape_of(x: torch.Tensor) -> torch.Tensor:
    """A tensor with ``x``'s shape and dtype and one element of storage."""
    return x.new_empty(()).expand(x.shape)


def all_gather(x, dim, outer, inner, reduce_grad, group, world, tag):
    h = torch.ops.tspc.all_gather_start(x, dim, outer, inner, group, world, tag)
    return torch.ops.tspc.all_gather_wait(h, x, dim, outer, inner, reduce_grad, group, world, tag)


def reduce_scatter(x, dim, outer, inner, group, world, tag):
    h = torch.ops.tspc.reduce_scatter_start(x, dim, outer, inner, group, world, tag)
    return torch.ops.tspc.reduce_scatter_wait(h, x, dim, outer, inner, group, world, tag)


def ring_hop(x, shift, group, world, tag):
    h = torch.ops.tspc.ring_start(x, shift, group, world, tag)
    return torch.ops.tspc.ring_wait(h, x, shift, group, world, tag)


def all_reduce(x, op, group, world, tag):
    h = torch.ops.tspc.all_reduce_start(x, op, group, world, tag)
    return torch.ops.tspc.all_reduce_wait(h, x, op, group, world, tag)


def all_reduce_gradient(x, group, world, tag):
    """The sum over ranks of a gradient, in a backward: no gradient flows through it, so the
    wait gets a stand-in for ``x`` (see ``reduce``) and ``x`` dies once the start has copied
    it (an embedding's or LM head's whole gradient, otherwise alive twice until the wait)."""
    h = torch.ops.tspc.all_reduce_start(x, "sum", group, world, tag)
    return torch.ops.tspc.all_reduce_wait(h, _shape_of(x), "sum", group, world, tag)
