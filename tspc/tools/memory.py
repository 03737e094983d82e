"""Per-rank memory measurement on CPU: peak and current bytes, split by what holds them.

There is no CUDA caching allocator on CPU, so nothing like ``torch.cuda.max_memory_allocated``
exists. This module measures allocations through the one hook that every CPU tensor allocation
passes: c10's ``DefaultCPUAllocator`` reports each ``allocate``/``free`` (pointer, byte count,
thread, op stack) to the PyTorch profiler when the profiler runs with ``profile_memory=True``.
That sees, measured on torch 2.13 (see ``tests/test_memory_tracker.py`` and the report that
chose this design):

* eager ops, the buffers of ``aot_eager`` graphs, and the ``empty_strided_cpu`` buffers that
  Inductor-generated wrapper code allocates (a ``torch.UntypedStorage`` too);
* allocations inside ``torch.distributed`` collectives, including the temporaries that gloo
  allocates on its own worker threads (the process group carries the profiler's thread-local
  state into its work), each nested under the collective's op (``c10d::...``,
  ``_c10d_functional::...``, ``gloo:...``), which is how communication buffers are recognised.

Alternatives that were tried and rejected: a ``TorchDispatchMode`` changes what it measures:
with a mode active, an Inductor-compiled ``mm -> relu*2 -> sin -> mm`` ran as its five separate
ATen ops (all seen by the mode) instead of Inductor's fused kernel, and a mode sees only op
outputs, never op-internal temporaries. A C++ extension replacing the CPU allocator
(``c10::SetCPUAllocator``) saw eager, ``aot_eager`` and Inductor buffers at no per-op cost, but
needs a ~20 s compile per environment and missed ``torch.UntypedStorage(n)`` (which takes the
default allocator directly; the profiler sees it). ``mallinfo`` has no peak. The profiler costs
~4x on a tiny op-bound model (1.9 -> 8-10 ms per training step of the reference model) and much
less on large ops: do not measure speed under it.

What one ``MemoryTracker`` counts: every CPU block allocated while it is active and not yet freed.
``current_bytes`` is their sum, ``peak_bytes`` its high-water mark. The allocator reports sizes
exactly as requested (no rounding: the measured slack for ``torch.empty(n)`` is 0 bytes; ops add
their own small temporaries, e.g. 4-8 byte scalar wrappers in ``aot_eager`` graphs). Blocks that
were allocated *before* the tracker started are invisible: their frees are not reported (c10 only
knows sizes of blocks it saw allocated under profiling), so they are ignored, and a tracker
started after model construction reports the increase above that point. ``breakdown`` adds the
model state that existed before the tracker back in, by tensor identity. Start the tracker before
building the model to see everything (including weights freed later, e.g. by sharding).

Limits:

* Allocations on threads that do not inherit the profiler state (intra-op worker threads of
  ``at::parallel_for``; measurement runs are normally single-threaded) are not seen.
* Events are collected per profiler session. A session ends when the outermost tracker exits, and
  is restarted (a fraction of a millisecond) when a nested tracker enters or exits and when a
  value is read while a tracker is active (``sync``). A free that another thread makes after its
  session ended is lost and the block stays counted as live. Measured case: gloo frees its
  gather temporary on its worker thread just *after* ``wait()`` returns, so a tracker that exits
  (or is read) right after a collective may keep that temporary in ``current_bytes``
  (occasionally, under load). Peaks up to that point are unaffected. ``reset_peak`` does not
  restart the session (it is a marker in the event stream).
* Only one profiler runs per process: a tracker cannot run inside ``torch.profiler.profile``
  (this raises) and must not be wrapped around one.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch._C._profiler import (
    ProfilerActivity,
    ProfilerConfig,
    ProfilerState,
    _EventType,
    _ExperimentalConfig,
    _RecordFunctionFast,
)
from torch.autograd import (
    _disable_profiler,
    _enable_profiler,
    _prepare_profiler,
    _profiler_enabled,
)

__all__ = [
    "MemoryTracker",
    "breakdown",
    "comm_region",
    "state_bytes",
    "storage_bytes",
    "tag_comm_buffer",
]

# Allocations made inside ops (or record_function regions) whose name starts with one of these
# are communication buffers: eager c10d ops, functional collectives, gloo's worker-thread work,
# and regions opened by ``comm_region``.
_COMM_PREFIXES = ("c10d::", "_c10d_functional::", "c10d_functional::", "gloo:", "tspc.comm")
_TAG_PREFIX = "tspc.comm_tag:"
_RESET_PREFIX = "tspc.reset_peak:"
_REGION_NAME = "tspc.comm_region"

# Trackers currently active, innermost last. They share one profiler session: entering or
# leaving a tracker stops the session, hands its events to every active tracker, and restarts.
_ACTIVE: list[MemoryTracker] = []
_LOCK = threading.Lock()

# Row kinds in the event stream handed to trackers.
_ALLOC, _TAG, _RESET = 0, 1, 2


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Silence fd 2 for the duration: libkineto writes two "USDT ... profiler_start/stop" lines
    to stderr for every session, and no environment variable turns them off (KINETO_LOG_LEVEL
    does not). Only the profiler start/stop calls run inside this."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no usable fd 2 (embedded interpreter): just be noisy
        yield
        return
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, 2)
        finally:
            os.close(devnull)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _start_session() -> None:
    cfg = ProfilerConfig(
        ProfilerState.KINETO,
        False,  # report_input_shapes
        True,  # profile_memory: the point of the exercise
        False,  # with_stack
        False,  # with_flops
        False,  # with_modules
        _ExperimentalConfig(),
    )
    acts = {ProfilerActivity.CPU}
    if _profiler_enabled():
        # Starting a second session would silently take over the user's profiler.
        raise RuntimeError(
            "tspc.tools.memory.MemoryTracker measures through the PyTorch profiler, and another "
            "profiler (torch.profiler.profile?) is already active in this thread"
        )
    with _quiet_stderr():
        # _prepare_profiler is not optional: enabling without it crashed (SIGSEGV) on 2.13.
        _prepare_profiler(cfg, acts)
        _enable_profiler(cfg, acts)


def _stop_session() -> list[tuple]:
    """Stop the profiler and return its CPU allocation and tag events in time order.

    Each row is ``(time_ns, seq, kind, ptr, nbytes, comm)``; ``nbytes`` is negative for a free.
    """
    with _quiet_stderr():
        result = _disable_profiler()
    rows: list[tuple] = []
    seq = 0
    # Depth-first over the op tree, carrying "inside a collective" down to the allocations.
    stack: list[tuple[Any, bool]] = [(e, False) for e in reversed(result.experimental_event_tree())]
    while stack:
        ev, comm = stack.pop()
        seq += 1
        if ev.tag == _EventType.Allocation:
            f = ev.extra_fields
            if f.device.type == "cpu" and f.alloc_size != 0:
                rows.append((ev.start_time_ns, seq, _ALLOC, f.ptr, f.alloc_size, comm))
            continue
        name = ev.name
        if name.startswith(_TAG_PREFIX):
            rows.append((ev.start_time_ns, seq, _TAG, int(name[len(_TAG_PREFIX) :], 16), 0, True))
        elif name.startswith(_RESET_PREFIX):
            rows.append((ev.start_time_ns, seq, _RESET, int(name[len(_RESET_PREFIX) :]), 0, False))
        elif not comm and name.startswith(_COMM_PREFIXES):
            comm = True
        children = ev.children
        if children:
            stack.extend((c, comm) for c in reversed(children))
    # Threads interleave (gloo work runs on its own thread): order by time, ties by tree order.
    rows.sort(key=lambda r: (r[0], r[1]))
    return rows


def _flush_locked(restart: bool) -> None:
    rows = _stop_session()
    for t in _ACTIVE:
        t._consume(rows)
    if restart:
        _start_session()


def _synced(count: str) -> property:
    """A tracker's count (the attribute ``count``), read after processing the events recorded
    so far (``MemoryTracker.sync``)."""

    def read(tracker: MemoryTracker) -> int:
        tracker.sync()
        return getattr(tracker, count)

    return property(read)


class MemoryTracker:
    """Measure CPU memory allocated while active: ``with MemoryTracker() as mt: ...``.

    Attributes (bytes; read any time, also while active, which processes the events so far):

    * ``current_bytes``: blocks allocated since the tracker started and still live.
    * ``peak_bytes``: the high-water mark of ``current_bytes`` since start or ``reset_peak()``.
    * ``comm_current_bytes`` / ``comm_peak_bytes``: the same for communication buffers only
      (blocks allocated inside a collective op or ``comm_region``, or passed to
      ``tag_comm_buffer``).
    * ``comm_bytes_at_peak``: communication buffers live at the moment of ``peak_bytes``.
    * ``num_allocations``: allocation events seen.

    Trackers nest (each sees the events of its own lifetime) and are meant for one thread.
    """

    def __init__(self) -> None:
        # ptr -> [nbytes, is_comm, seq of its allocation]
        self._live: dict[int, list] = {}
        self._seq = 0
        self._current = 0
        self._peak = 0
        self._peak_seq = 0
        self._comm_current = 0
        self._comm_peak = 0
        self._comm_at_peak = 0
        self._num_allocations = 0
        self._active = False
        self._done = False

    # -- context manager -------------------------------------------------------------------

    def __enter__(self) -> MemoryTracker:
        if self._active or self._done:
            raise RuntimeError("a MemoryTracker can be entered only once")
        with _LOCK:
            if _ACTIVE:
                _flush_locked(restart=False)
            _start_session()
            _ACTIVE.append(self)
            self._active = True
        return self

    def __exit__(self, *exc: object) -> None:
        with _LOCK:
            _flush_locked(restart=False)
            _ACTIVE.remove(self)
            self._active = False
            self._done = True
            if _ACTIVE:
                _start_session()

    # -- reading ---------------------------------------------------------------------------

    def sync(self) -> None:
        """Process the events recorded so far (a no-op once the tracker has exited)."""
        if self._active:
            with _LOCK:
                _flush_locked(restart=True)

    def reset_peak(self) -> None:
        """Start a new peak window at the current live bytes (like CUDA's reset_peak_memory).

        While active this only drops a marker into the event stream (no profiler restart, so
        no window in which a free could be missed); it takes effect where it was called."""
        if self._active:
            with _RecordFunctionFast(f"{_RESET_PREFIX}{id(self)}"):
                pass
        else:
            self._reset_peak()

    def _reset_peak(self) -> None:
        self._peak = self._current
        self._peak_seq = self._seq
        self._comm_peak = self._comm_current
        self._comm_at_peak = self._comm_current

    current_bytes = _synced("_current")
    peak_bytes = _synced("_peak")
    comm_current_bytes = _synced("_comm_current")
    comm_peak_bytes = _synced("_comm_peak")
    comm_bytes_at_peak = _synced("_comm_at_peak")
    num_allocations = _synced("_num_allocations")

    def live_blocks(self) -> dict[int, tuple[int, bool, bool]]:
        """``ptr -> (nbytes, is_comm, was_live_at_peak)`` for the blocks live now."""
        self.sync()
        return {p: (n, comm, seq <= self._peak_seq) for p, (n, comm, seq) in self._live.items()}

    # -- event processing ------------------------------------------------------------------

    def _consume(self, rows: list[tuple]) -> None:
        live = self._live
        for _t, _s, kind, ptr, nbytes, comm in rows:
            if kind == _RESET:
                if ptr == id(self):
                    self._reset_peak()
                continue
            if kind == _TAG:
                blk = live.get(ptr)
                if blk is not None and not blk[1]:
                    blk[1] = True
                    self._comm_current += blk[0]
                    self._comm_peak = max(self._comm_peak, self._comm_current)
                    if blk[2] <= self._peak_seq:  # allocated before the peak, live since
                        self._comm_at_peak += blk[0]
                continue
            if nbytes > 0:
                old = live.get(ptr)
                if old is not None:  # its free fell in a restart gap: drop the stale block
                    self._drop(old)
                self._seq += 1
                self._num_allocations += 1
                live[ptr] = [nbytes, comm, self._seq]
                self._current += nbytes
                if comm:
                    self._comm_current += nbytes
                    if self._comm_current > self._comm_peak:
                        self._comm_peak = self._comm_current
                if self._current > self._peak:
                    self._peak = self._current
                    self._peak_seq = self._seq
                    self._comm_at_peak = self._comm_current
            else:
                blk = live.pop(ptr, None)
                if blk is not None:  # a free of a block from before the tracker is ignored
                    self._drop(blk)

    def _drop(self, blk: list) -> None:
        self._current -= blk[0]
        if blk[1]:
            self._comm_current -= blk[0]


# -- communication buffers -------------------------------------------------------------------


@torch.compiler.disable
def _emit_tag(t: torch.Tensor) -> None:
    # A zero-length profiler event carrying the block's address: it lands in the event stream
    # in order with the allocations, so the tracker marks exactly the block live at this point.
    with _RecordFunctionFast(f"{_TAG_PREFIX}{t.untyped_storage().data_ptr():x}"):
        pass


def tag_comm_buffer(t: torch.Tensor) -> torch.Tensor:
    """Mark the block holding ``t`` as a communication buffer for every active tracker.

    For buffers the runtime allocates itself before handing them to a collective (a receive
    buffer, a packed send buffer). Buffers allocated *inside* a c10d op or a functional
    collective are recognised without this. Costs one list check when no tracker is active.
    Call it from code that runs eagerly (custom-op bodies, runtime helpers), not from code that
    Dynamo traces. Returns ``t``.
    """
    if _ACTIVE:
        _emit_tag(t)
    return t


_NULL = contextlib.nullcontext()


def comm_region() -> contextlib.AbstractContextManager:
    """``with comm_region(): ...`` counts every allocation made inside as communication.

    Only the calling thread's allocations are attributed (gloo's worker threads are recognised
    by their own ops). Cheap (a shared null context) when no tracker is active.
    """
    if not _ACTIVE:
        return _NULL
    return _RecordFunctionFast(_REGION_NAME)


# -- model state -----------------------------------------------------------------------------


def _storages(t: torch.Tensor | None) -> Iterator[torch.UntypedStorage]:
    if t is None:
        return
    from tspc.runtime.compat import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(t):  # DTensor and friends: count the local tensors
        attrs, _ = t.__tensor_flatten__()
        for a in attrs:
            inner = getattr(t, a)
            if isinstance(inner, torch.Tensor):  # DTensor also lists its DeviceMesh here
                yield from _storages(inner)
        return
    if t.device.type == "meta" or t.is_sparse:
        return
    yield t.untyped_storage()


def storage_bytes(tensors: Iterable[torch.Tensor | None], _seen: set[int] | None = None) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and aliases counted once; a
    storage resized to 0, as when a full weight is released after sharding, counts 0)."""
    return sum(st.nbytes() for st in _unique_storages(tensors, set() if _seen is None else _seen))


def _unique_storages(
    tensors: Iterable[torch.Tensor | None], seen: set[int]
) -> Iterator[torch.UntypedStorage]:
    for t in tensors:
        for st in _storages(t):
            key = st._cdata  # the StorageImpl's address: identity across views and wrappers
            if key not in seen:
                seen.add(key)
                yield st


def _state_tensors(
    model: nn.Module | None,
    optimizer: torch.optim.Optimizer | None,
    extra_params: Iterable[torch.Tensor] | None,
) -> dict[str, list[torch.Tensor]]:
    params: list[torch.Tensor] = []
    buffers: list[torch.Tensor] = []
    if model is not None:
        params.extend(model.parameters())
        buffers.extend(model.buffers())
    if extra_params is not None:
        params.extend(extra_params)
    if optimizer is not None:  # an optimizer may own parameters the model no longer lists
        for group in optimizer.param_groups:
            params.extend(group["params"])
    grads = [p.grad for p in params if p.grad is not None]
    opt_state: list[torch.Tensor] = []
    if optimizer is not None:
        for st in optimizer.state.values():
            opt_state.extend(v for v in st.values() if isinstance(v, torch.Tensor))
    return {
        "parameters": params,
        "buffers": buffers,
        "gradients": grads,
        "optimizer_state": opt_state,
    }


def state_bytes(
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    extra_params: Iterable[torch.Tensor] | None = None,
) -> dict[str, int]:
    """Bytes held right now in parameters, buffers, gradients and optimizer state.

    By storage identity: each storage is counted once, in the first category that holds it
    (parameters, buffers, gradients, optimizer state, in that order). DTensors count their
    local shard. Optimizer state is every tensor in ``optimizer.state`` (for Adam/AdamW: both
    moments and the scalar ``step``)."""
    return {k: v for k, (v, _) in _state_storages(model, optimizer, extra_params).items()}


def _state_storages(model, optimizer, extra_params) -> dict[str, tuple[int, list[int]]]:
    seen: set[int] = set()
    out: dict[str, tuple[int, list[int]]] = {}
    for cat, tensors in _state_tensors(model, optimizer, extra_params).items():
        sts = list(_unique_storages(tensors, seen))
        ptrs = [st.data_ptr() for st in sts if st.nbytes() > 0 and st.device.type == "cpu"]
        out[cat] = (sum(st.nbytes() for st in sts), ptrs)
    return out


def breakdown(
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    extra_params: Iterable[torch.Tensor] | None = None,
    tracker: MemoryTracker | None = None,
) -> dict[str, int]:
    """Per-rank memory by category, in bytes.

    Always (held right now, see ``state_bytes``): ``parameters``, ``buffers``, ``gradients``,
    ``optimizer_state``.

    With a ``tracker`` (finished or active), also, at the tracker's peak:

    * ``peak``: model state that existed before the tracker started (and is still held) plus
      ``tracker.peak_bytes``. With the tracker started before the model was built this is the
      full high-water mark of the rank's tracked memory; otherwise it assumes that state stayed
      live throughout (frees of memory from before the tracker are invisible, see module doc).
    * ``communication``: communication buffers live at the peak.
    * ``activations``: everything else the tracker saw live at the peak that is not model state:
      the blocks live at the peak minus communication buffers minus the blocks that are still
      held now as parameters, buffers, gradients or optimizer state. This is saved activations
      plus whatever transient workspace was live at that moment (e.g. the causal mask, logits).
      Call ``breakdown`` before ``optimizer.zero_grad(set_to_none=True)``, or the freed
      gradients that were live at the peak are counted as activations.
    * ``communication_peak``: the high-water mark of communication buffers alone (may occur at
      another moment than ``peak``).
    * ``tracked_peak``: ``tracker.peak_bytes`` itself.
    """
    st = _state_storages(model, optimizer, extra_params)
    out = {cat: nbytes for cat, (nbytes, _) in st.items()}
    if tracker is None:
        return out
    live = tracker.live_blocks()
    new_now = 0  # state allocated while the tracker ran (so part of its measurements)
    new_at_peak = 0
    for _cat, (_n, ptrs) in st.items():
        for p in ptrs:
            blk = live.get(p)
            if blk is None:
                continue
            nbytes, comm, at_peak = blk
            new_now += nbytes
            if at_peak and not comm:
                new_at_peak += nbytes
    state_total = sum(out.values())
    preexisting = state_total - new_now
    out["tracked_peak"] = tracker.peak_bytes
    out["peak"] = preexisting + tracker.peak_bytes
    out["communication"] = tracker.comm_bytes_at_peak
    out["communication_peak"] = tracker.comm_peak_bytes
    out["activations"] = tracker.peak_bytes - tracker.comm_bytes_at_peak - new_at_peak
    return out
