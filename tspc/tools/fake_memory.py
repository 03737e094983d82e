"""Live bytes of tensor storages, op by op, on fake tensors (:class:`FakeMemoryTracker`).

There is no allocator behind fake tensors, so ``tspc.tools.memory.MemoryTracker`` (which listens
to c10's CPU allocator through the profiler) sees nothing there. A ``TorchDispatchMode`` sees
every ATen and custom op that runs, including those of aot_eager's compiled graphs (they run op
by op); each op output's storage is counted from the op that created it until the storage is
destroyed (a weak-reference callback; views share their base's storage and count once), and
``UntypedStorage.resize_`` is watched so that releasing a full weight (``resize_(0)``) shows up.
See :mod:`tspc.tools.measure` for what is and is not counted.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from tspc.runtime.compat import TorchDispatchMode, is_traceable_wrapper_subclass, tree_leaves

# Categories of the bytes live at the peak, in report order.
CATEGORIES = (
    "full_weights",  # full matched weights still held (until the backend releases them)
    "shards",  # this rank's shards of the matched weights
    "other_params",  # unmatched parameters (embeddings, norms, LM head) and buffers
    "gradients",
    "optimizer",
    "activations",  # saved activations, working set, logits, inputs: everything else
    "communication",  # buffers produced by collectives, from their start to their last use
    # buffers an eager ``torch.distributed`` collective wrote into: with data_parallel="fsdp"
    # the TSP-local weights gathered over dp for a call (runtime/dp_shard.py)
    "dp_gathered",
)
CATEGORY_LABELS = {
    "full_weights": "full wts",
    "shards": "shards",
    "other_params": "other prm",
    "gradients": "grads",
    "optimizer": "optim",
    "activations": "activ",
    "communication": "comm",
    "dp_gathered": "dp gath",
}

# Namespaces whose ops are collectives: tspc's own (start/wait pairs) and torch's functional ones.
_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional", "c10d")
# ``torch.distributed``'s eager collectives (``dist.all_gather_into_tensor``...) write into a
# buffer their caller made: the block that buffer opened is relabelled, not a new one opened.
_EAGER_COLLECTIVES = "c10d"
# ops that copy a tensor: a copy of such a buffer keeps its label
_COPIES = (torch.ops.aten.clone.default, torch.ops.aten._to_copy.default)


def _is_tspc(func: Any, suffix: str | tuple[str, ...]) -> bool:
    # tspc's collectives are start/wait pairs of custom ops (runtime/comm.py; traced, a wait
    # is torch's wait_tensor); its other custom ops (the zigzag attention kernel) are compute.
    return getattr(func, "namespace", "") == "tspc" and getattr(func, "_opname", "").endswith(
        suffix
    )


def _is_collective(func: Any) -> bool:
    return _is_tspc(func, ("_start", "_wait")) or (
        getattr(func, "namespace", "") in _COLLECTIVE_NAMESPACES
    )


def _storages(t: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    if is_traceable_wrapper_subclass(t):  # DTensor and friends: their inner tensors
        attrs, _ = t.__tensor_flatten__()
        for a in attrs:
            inner = getattr(t, a)
            if isinstance(inner, torch.Tensor):
                yield from _storages(inner)
        return
    if t.is_sparse:
        return
    yield t.untyped_storage()


@dataclass
class _Block:
    nbytes: int
    # "state" (registered before the step), "comm" (a collective's output), "eager_comm" (a
    # buffer an eager collective wrote into), "other"
    kind: str
    born: int  # op index at which it appeared
    died: float = math.inf  # index of the last op during which it was alive
    op: str = ""  # the op that produced it ("" for registered state)


class FakeMemoryTracker(TorchDispatchMode):
    """Live bytes of tensor storages, per op, on fake (or real) tensors; see the module doc.

    ``with FakeMemoryTracker() as mt: ...`` counts every storage an op creates while active, plus
    those registered with :meth:`track` (the state that existed before: weights, optimizer
    state). After exit: ``peak_bytes``, ``peak_op`` and :meth:`live_at_peak`.
    """

    def __init__(self, transient: Any = None) -> None:
        """``transient(func, args)``, when given, names buffers an op holds *inside* that its
        fake implementation does not allocate (``[(shape, dtype), ...]``): they are counted as
        live during that op only (``tools/fake_moe.py``: the routed rows of the MoE op)."""
        super().__init__()
        self._transient = transient
        self.blocks: list[_Block] = []
        # storage -> [index of its current block]; the list is shared with the storage's
        # finalizer, so a resize (new block) and a later death close the right block.
        self._live: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._op = 0
        self._orig_resize: Any = None
        self.ops = 0  # ops seen
        self.collective_ops = 0

    # -- registration ----------------------------------------------------------------------

    def track(self, tensors: Iterable[torch.Tensor | None], kind: str = "state") -> None:
        """Count the storages behind ``tensors`` from now on (idempotent per storage)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                for st in _storages(t):
                    self._see(st, kind, self._op)

    def _see(self, st: torch.UntypedStorage, kind: str, born: int, op: str = "") -> int:
        holder = self._live.get(st)
        n = st.nbytes()
        if holder is not None:
            blk = self.blocks[holder[0]]
            if kind == "eager_comm" and blk.kind == "other":
                blk.kind = kind
            if blk.nbytes != n:  # resized in place (aten.resize_, set_): close and reopen
                blk.died = self._op
                holder[0] = self._open(n, blk.kind, self._op, blk.op)
            return holder[0]
        idx = self._open(n, kind, born, op)
        holder = [idx]
        self._live[st] = holder
        weakref.finalize(st, self._close, holder)
        return idx

    def _open(self, nbytes: int, kind: str, born: int, op: str = "") -> int:
        self.blocks.append(_Block(nbytes, kind, born, op=op))
        return len(self.blocks) - 1

    def _close(self, holder: list[int]) -> None:
        blk = self.blocks[holder[0]]
        if blk.died == math.inf:
            blk.died = self._op

    def _resized(self, st: torch.UntypedStorage) -> None:
        holder = self._live.get(st)
        if holder is None:
            return
        blk = self.blocks[holder[0]]
        if blk.nbytes != st.nbytes():
            blk.died = self._op
            holder[0] = self._open(st.nbytes(), blk.kind, self._op + 1, blk.op)

    def _kind_of(self, t: Any) -> str:
        if not isinstance(t, torch.Tensor):
            return ""
        blocks = self.block_of(t)
        return self.blocks[blocks[0]].kind if blocks else ""

    def block_of(self, t: torch.Tensor) -> list[int]:
        """Indices of the blocks currently behind ``t`` (empty when untracked)."""
        out = []
        for st in _storages(t):
            holder = self._live.get(st)
            if holder is not None:
                out.append(holder[0])
        return out

    # -- the mode --------------------------------------------------------------------------

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        # Without this Dynamo skips every frame while the mode is active and the model runs
        # eagerly (not the compiled graph at all). With it, compilation runs without the mode
        # and the compiled artifact runs under it: aot_eager's graphs op by op.
        return True

    def __enter__(self) -> FakeMemoryTracker:
        # UntypedStorage.resize_ is not an op a dispatch mode sees; the backend's release of a
        # full weight (resize_(0)) goes through it.
        orig = torch.UntypedStorage.resize_
        self._orig_resize = orig
        tracker = self

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            out = orig(st, size)
            tracker._resized(st)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._op += 1
        self.ops += 1
        born = self._op
        collective = _is_collective(func)
        if collective:
            self.collective_ops += 1
        # A start returns the buffer the transfer lands in (born when it is issued); its wait
        # is ``_c10d_functional.wait_tensor`` and plain layout ops (runtime/comm.py).
        kind = "comm" if collective else "other"
        if getattr(func, "namespace", "") == _EAGER_COLLECTIVES or (
            func in _COPIES and args and self._kind_of(args[0]) == "eager_comm"
        ):
            kind = "eager_comm"  # a dim-1 gather's contiguous copy is still the gathered weight
        name = str(func)
        for t in tree_leaves(out):  # in-place ops return their input: resizes are seen here
            if isinstance(t, torch.Tensor):
                for st in _storages(t):
                    self._see(st, kind, born, name)
        if self._transient is not None:
            for size, dtype in self._transient(func, args):
                inner = torch.empty(size, dtype=dtype)  # fake under the step's FakeTensorMode
                self._see(inner.untyped_storage(), "comm", born, f"{name} (inside)")
                del inner  # its finalizer closes the block at this op
        return out

    # -- results ---------------------------------------------------------------------------

    def _sweep(self) -> tuple[int, int]:
        end = self._op + 2
        delta = [0] * (end + 1)
        for b in self.blocks:
            if b.nbytes == 0:
                continue
            died = end - 1 if b.died == math.inf else int(b.died)
            if died < b.born:
                continue
            delta[b.born] += b.nbytes
            delta[died + 1] -= b.nbytes
        best, best_op, cur = -1, 0, 0
        for i in range(end):
            cur += delta[i]
            if cur > best:
                best, best_op = cur, i
        return best, best_op

    @property
    def peak_bytes(self) -> int:
        return self._sweep()[0]

    @property
    def peak_op(self) -> int:
        return self._sweep()[1]

    @property
    def current_bytes(self) -> int:
        return sum(b.nbytes for b in self.blocks if b.died == math.inf)

    def live_at_peak(self) -> list[int]:
        """Indices of the blocks alive at the peak."""
        _, k = self._sweep()
        return [i for i, b in enumerate(self.blocks) if b.nbytes and b.born <= k <= b.died]
