"""Measured per-rank memory of the real TSP graph at full scale, on fake tensors.

``tspc plan --measure`` runs what a user would run — the Llama-style reference model built from
the plan's model shape, wrapped with its loss, ``torch.compile(..., backend="tsp")``, one
training step (forward, loss, backward, AdamW) or one evaluation forward — as rank r of D, for
every rank, and reports each rank's peak live bytes next to the analytic figure of
``tspc/tools/plan.py``. Nothing is allocated for real:

* The model, inputs, activations, gradients and optimizer state are ``FakeTensor``\\ s (shape,
  dtype and device ``cpu``, no data), so a 7B model at 128K tokens costs no memory. Building
  on ``cpu`` fake tensors rather than ``meta`` matters: Dynamo, aot_autograd and the passes then
  take exactly the CPU code paths a real run takes (SDPA lowers to the CPU flash kernel, which
  never materialises an S x S score matrix; on ``meta`` it would pick the math fallback).
* The process group is torch's ``fake`` backend (rank r of D, no peers). The collectives are
  tspc custom ops, which on fake tensors run their registered fake implementations: no
  communication happens, but every transfer's buffer appears with its true shape.
* The backend, the passes, aot_autograd's partitioner and the eager execution of the
  partitioned graphs are the real ones: what is measured is the graph that would run.

Counting live bytes (:class:`FakeMemoryTracker`). There is no allocator behind fake tensors, so
``tspc.tools.memory.MemoryTracker`` (which listens to c10's CPU allocator through the profiler) sees
nothing here. A ``TorchDispatchMode`` sees every ATen and custom op that runs, including those
of aot_eager's compiled graphs (they run op by op); each op output's storage is counted from the
op that created it until the storage is destroyed (a weak-reference callback; views share their
base's storage and count once), and ``UntypedStorage.resize_`` is watched so that releasing a
full weight (``resize_(0)``) shows up. ``tspc.tools.memory`` rejected a dispatch mode for *real* runs
because it can change what Inductor runs and misses op-internal temporaries; neither matters
for a count of tensors on fake tensors with the aot_eager inner compiler.

What it does not count: op-internal workspace (kernels' temporaries), allocator rounding and
fragmentation, the CUDA context, NCCL/gloo internal buffers, and the runtime's own staging
copies inside a collective (the un-reordered all-gather buffer, reduce-scatter's packed input):
roughly the planner's fixed overhead ``c0``, which is therefore *not* part of the measured
figure. A collective's result buffer is counted from its *start* op, not from its wait: the
real runtime allocates the receive buffer when the transfer is issued, so a prefetched weight
shard occupies memory during the compute it overlaps with.

Layer-count override. Tracing costs ~5-8 s per transformer layer and rank at D = 8 on 2 cores
(aot_autograd's tracing and partitioning dominate; a full 32-layer 7B rank takes minutes). With
``layers=n`` the model is measured with n and n+1 layers and each category of the peak is
extrapolated linearly to the full depth: ``x(L) = x(n) + (L - n) * (x(n+1) - x(n))``. That is
exact when the peak falls at the same point of the step for both depths and every term is
affine in the layer count, which holds for this model: weights, gradients and optimizer state
are per layer; a training step keeps one set of saved activations per layer until the backward
reaches it; the working set of the layer being computed, the transfers in flight, the logits
and the embedding do not depend on L. ``tspc plan`` uses n = 2 by default, the smallest depth
at which the step has the full model's structure (a layer's transfers are prefetched during
the previous layer's compute; with one layer there is no previous layer). The report prints
both measured depths so the per-layer increment can be checked, and
``tests/test_plan_measure.py`` checks the extrapolation against a full-depth trace.
"""

from __future__ import annotations

import contextlib
import math
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from tspc.runtime.compat import TorchDispatchMode, is_traceable_wrapper_subclass, tree_leaves

__all__ = [
    "CATEGORIES",
    "FakeMemoryTracker",
    "LossModel",
    "Measurement",
    "RankMeasurement",
    "measure",
    "measure_rank",
    "ref_config_from_shape",
    "reference_model",
]

MODES = ("train", "forward")

# Categories of the bytes live at the peak, in report order.
CATEGORIES = (
    "full_weights",  # full matched weights still held (until the backend releases them)
    "shards",  # this rank's shards of the matched weights
    "other_params",  # unmatched parameters (embeddings, norms, LM head) and buffers
    "gradients",
    "optimizer",
    "activations",  # saved activations, working set, logits, inputs: everything else
    "communication",  # buffers produced by collectives, from their start to their last use
)
CATEGORY_LABELS = {
    "full_weights": "full wts",
    "shards": "shards",
    "other_params": "other prm",
    "gradients": "grads",
    "optimizer": "optim",
    "activations": "activ",
    "communication": "comm",
}

# Namespaces whose ops are collectives: tspc's own (start/wait pairs) and torch's functional ones.
_COLLECTIVE_NAMESPACES = ("_c10d_functional", "c10d_functional", "c10d")


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
    kind: str  # "state" (registered before the step), "comm" (a collective's output), "other"
    born: int  # op index at which it appeared
    died: float = math.inf  # index of the last op during which it was alive
    op: str = ""  # the op that produced it ("" for registered state)


class FakeMemoryTracker(TorchDispatchMode):
    """Live bytes of tensor storages, per op, on fake (or real) tensors; see the module doc.

    ``with FakeMemoryTracker() as mt: ...`` counts every storage an op creates while active, plus
    those registered with :meth:`track` (the state that existed before: weights, optimizer
    state). After exit: ``peak_bytes``, ``peak_op`` and :meth:`live_at_peak`.
    """

    def __init__(self) -> None:
        super().__init__()
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
        name = str(func)
        for t in tree_leaves(out):  # in-place ops return their input: resizes are seen here
            if isinstance(t, torch.Tensor):
                for st in _storages(t):
                    self._see(st, kind, born, name)
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


# --------------------------------------------------------------------------------------------
# The model a measurement runs
# --------------------------------------------------------------------------------------------


class LossModel(nn.Module):
    """``model(ids) -> logits`` plus the token-level cross-entropy, as one compiled module.

    Compiling the loss with the model is what a long-context user does: tspc then computes the
    loss of each rank's own tokens and all-reduces one number, instead of gathering the
    ``[B, S, vocab]`` logits on every rank. The targets are given already shifted.
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model(input_ids)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def ref_config_from_shape(shape: Any, layers: int | None = None) -> Any:
    """The reference model's config for a planner ``ModelShape`` (optionally fewer layers)."""
    from tspc.samples.reference_model import RefConfig

    if shape.head_dim is not None and shape.head_dim != shape.hidden // shape.heads:
        raise ValueError(
            f"the reference model derives head_dim = hidden / heads; this model has head_dim "
            f"{shape.head_dim} != {shape.hidden} / {shape.heads}"
        )
    return RefConfig(
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_layers=shape.layers if layers is None else layers,
        num_heads=shape.heads,
        num_kv_heads=shape.kv_heads,
        tie_embeddings=shape.tied_embeddings,
        mask="causal",
    )


def reference_model(shape: Any, layers: int | None = None, seed: int = 0) -> nn.Module:
    """The reference model of a planner ``ModelShape``, with the deterministic random weights
    of ``build_reference_model(seed)`` (the same on every rank)."""
    from tspc.samples.reference_model import build_reference_model

    return build_reference_model(seed, **asdict(ref_config_from_shape(shape, layers)))


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    """The local tensor of a DTensor (what this rank holds), else ``t``."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        with torch.no_grad():
            return t.to_local()
    return t


def shards_of(model: nn.Module) -> list[torch.Tensor]:
    """The local tensors of ``model``'s sharded DTensor parameters (empty when nothing is
    sharded)."""
    return [_local(p) for p in model.parameters() if is_matched_param(p)]


# --------------------------------------------------------------------------------------------
# One rank
# --------------------------------------------------------------------------------------------


@dataclass
class RankMeasurement:
    """One rank's measured step: the peak and what was live at that moment, in bytes."""

    rank: int
    world: int
    layers: int
    mode: str
    peak: int
    at_peak: dict[str, int]
    level: str  # what the backend ran: "tsp", "sp" or "replicated"
    matched_attention: int
    matched_mlp: int
    skipped: list[str]
    gathers: list[str]
    compile_seconds: float
    step_seconds: float
    ops: int
    # what is live at the peak, summed by (category, the op that made it): the largest
    largest_at_peak: list[tuple[int, str, str]] = field(default_factory=list)


@contextlib.contextmanager
def _fake_group(rank: int, world: int) -> Iterator[None]:
    """Rank ``rank`` of ``world`` on torch's ``fake`` process-group backend, for the duration."""
    import torch.distributed as dist

    from tspc.runtime.compat import fake_process_group_store

    if dist.is_initialized():
        backend = dist.get_backend()
        if backend != "fake":
            raise RuntimeError(
                f"tspc measure runs on the 'fake' process group, but a '{backend}' process "
                "group is already initialised in this process"
            )
        dist.destroy_process_group()
    dist.init_process_group("fake", store=fake_process_group_store(), rank=rank, world_size=world)
    try:
        yield
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


@contextlib.contextmanager
def _keep_fake_parameter_class() -> Iterator[None]:
    """TEMPORARY, until ``runtime/release.py`` leaves fake parameters' class alone.

    The backend's weight release frees each full weight's storage (``resize_(0)``) and, as a
    guard against reading freed memory, turns the parameter into a ``ReleasedParameter``. A
    ``FakeTensor`` whose class is changed can no longer dispatch (Dynamo's recompile then fails
    with "dispatch_on_subclass called with NO overloaded args"). Fake tensors have no data to
    protect and the guard has no memory effect, so here the class swap is a no-op (the
    parameter keeps its class); the storage release itself runs unchanged and is measured.
    """
    from unittest import mock

    from tspc.runtime import release
    from tspc.runtime.compat import FakeTensor

    if not hasattr(release, "ReleasedParameter"):
        yield
        return
    with mock.patch.object(release, "ReleasedParameter", FakeTensor):
        yield


TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def warm_up(
    step: Callable, ids: Any, targets: Any, mode: str, steps: int, make_optimizer: Callable
) -> torch.optim.Optimizer | None:
    """``steps`` calls of ``step(ids, targets)`` as the measured one runs them (``mode``: "train"
    or "forward"). In training the optimizer is made after the first call, when the shards
    exist, and each step runs it (the first creates its moments). Returns the optimizer."""
    optimizer = None
    for _ in range(steps):
        if mode == "train":
            step(ids, targets).backward()
            if optimizer is None:
                optimizer = make_optimizer()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                step(ids, targets)
    return optimizer


def measured_step(
    step: Callable, ids: Any, targets: Any, mode: str, optimizer: torch.optim.Optimizer | None
) -> torch.Tensor:
    """The measured step: the forward, and in training its backward and the optimizer step."""
    if mode != "train":
        with torch.no_grad():
            return step(ids, targets)
    loss = step(ids, targets)
    loss.backward()
    optimizer.step()
    return loss


def measure_rank(
    config: Any,
    *,
    seq_len: int,
    micro_batch: int = 1,
    dtype: str = "bf16",
    rank: int = 0,
    world: int = 1,
    mode: str = "train",
    schedules: str = "tsp",
    recompute: str = "none",
) -> RankMeasurement:
    """Compile and run one step of the reference model as ``rank`` of ``world``, on fake
    tensors, and measure the step's peak live bytes (see the module doc).

    ``config`` is a ``samples.reference_model.RefConfig``. ``mode``: "train" (forward, loss,
    backward, AdamW step; two warm-up steps compile and create the optimizer state, the third
    is measured) or "forward" (the loss under ``torch.no_grad()``).
    """
    import tspc
    from tspc.runtime.compat import FakeTensorMode
    from tspc.samples.reference_model import RefModel

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    torch._dynamo.reset()  # a fresh model per rank: stale guards would recompile, then give up
    last_id = tspc.report.last_graph_id()
    with (
        _fake_group(rank, world),
        _default_dtype(TORCH_DTYPES[dtype]),
        _keep_fake_parameter_class(),
        FakeTensorMode(),
    ):
        t0 = time.perf_counter()
        model = LossModel(RefModel(config))
        ids = torch.randint(0, config.vocab_size, (micro_batch, seq_len))
        targets = torch.randint(0, config.vocab_size, (micro_batch, seq_len))
        compiled = torch.compile(
            model,
            backend="tsp",
            # fake tensors: aot_eager (Inductor would generate and build kernels for them)
            options={"schedules": schedules, "recompute": recompute, "inner": "aot_eager"},
        )
        # the first call compiles; a recompile would come at the second
        optimizer = warm_up(
            compiled,
            ids,
            targets,
            mode,
            2,
            lambda m=model: torch.optim.AdamW(m.parameters(), lr=1e-4),
        )
        t1 = time.perf_counter()

        shards = shards_of(model)
        # the original full weights are released (storage-less stand-ins): nothing to count
        full: list[torch.Tensor] = []
        other = [_local(p) for p in model.parameters() if not is_matched_param(p)]
        tracker = FakeMemoryTracker()
        tracker.track([*other, *model.buffers(), *shards, ids, targets])
        if optimizer is not None:
            tracker.track(
                _local(v)
                for st in optimizer.state.values()
                for v in st.values()
                if torch.is_tensor(v)
            )
        with tracker:
            loss = measured_step(compiled, ids, targets, mode, optimizer)
        t2 = time.perf_counter()

        # What each block live at the peak is, by what holds it at the end of the step.
        role: dict[int, str] = {}

        def claim(tensors: Iterable[torch.Tensor | None], category: str) -> None:
            for t in tensors:
                if isinstance(t, torch.Tensor):
                    for i in tracker.block_of(t):
                        role.setdefault(i, category)

        claim(full, "full_weights")
        claim(shards, "shards")
        claim([*other, *model.buffers()], "other_params")
        claim((_local(p.grad) for p in model.parameters()), "gradients")
        if optimizer is not None:
            claim(
                (
                    _local(v)
                    for st in optimizer.state.values()
                    for v in st.values()
                    if torch.is_tensor(v)
                ),
                "optimizer",
            )
        at_peak = dict.fromkeys(CATEGORIES, 0)
        largest: list[tuple[int, str, str]] = []
        for i in tracker.live_at_peak():
            blk = tracker.blocks[i]
            cat = role.get(i) or ("communication" if blk.kind == "comm" else "activations")
            at_peak[cat] += blk.nbytes
            largest.append((blk.nbytes, cat, blk.op or "(state)"))
        by_op: dict[tuple[str, str], int] = {}
        for nbytes, cat, op in largest:
            by_op[(cat, op)] = by_op.get((cat, op), 0) + nbytes
        largest = sorted(((v, c, o) for (c, o), v in by_op.items()), reverse=True)
        peak = tracker.peak_bytes
        del loss, optimizer, compiled, model

    reports = tspc.report.reports_after(last_id)
    report = reports[-1] if reports else None
    sharded = world > 1 and report is not None and report.level != "replicated"
    if sharded and tracker.collective_ops == 0:  # then what ran was not the compiled graph
        raise RuntimeError(
            "tspc measure: no collective ran during the measured step; the compiled graph "
            "did not run under the tracker"
        )
    return RankMeasurement(
        rank=rank,
        world=world,
        layers=config.num_layers,
        mode=mode,
        peak=peak,
        at_peak=at_peak,
        level=report.level if report else "?",
        matched_attention=sum(
            1 for e in (report.matched if report else []) if e.kind == "attention"
        ),
        matched_mlp=sum(1 for e in (report.matched if report else []) if e.kind == "mlp"),
        skipped=[f"{e.kind} {e.module}: {e.reason}" for e in (report.skipped if report else [])],
        gathers=[f"{g['value']} for {g['op']}" for g in (report.gathers if report else [])],
        compile_seconds=t1 - t0,
        step_seconds=t2 - t1,
        ops=tracker.ops,
        largest_at_peak=largest[:12],
    )


def is_matched_param(p: torch.Tensor) -> bool:
    """Whether ``p`` is the DTensor parameter of a weight the backend sharded (this rank may
    hold no slice of it)."""
    from tspc.runtime.tsp_params import tsp_param_of

    tp = tsp_param_of(p)
    return tp is not None and tp.sharded


# --------------------------------------------------------------------------------------------
# All ranks, full depth (or extrapolated to it)
# --------------------------------------------------------------------------------------------


@dataclass
class Measurement:
    """Every measured rank, and each rank's peak at the model's full depth."""

    layers: int  # the model's depth
    measured_layers: tuple[int, ...]  # the depths actually run (two when extrapolating)
    mode: str
    schedules: str
    recompute: str
    runs: dict[int, list[RankMeasurement]]  # depth -> one entry per measured rank
    full: list[dict[str, float]] = field(default_factory=list)  # per rank: category -> bytes

    @property
    def extrapolated(self) -> bool:
        return self.measured_layers != (self.layers,)

    def peak(self, rank_index: int) -> float:
        return sum(self.full[rank_index].values())

    @property
    def max_peak(self) -> float:
        return max(self.peak(i) for i in range(len(self.full)))


def measure(
    shape: Any,
    *,
    devices: int,
    seq_len: int,
    micro_batch: int = 1,
    dtype: str = "bf16",
    mode: str = "train",
    layers: int | None = None,
    ranks: Sequence[int] | None = None,
    schedules: str = "tsp",
    recompute: str = "none",
    progress: Any = None,
) -> Measurement:
    """Measure ``ranks`` (default: all) of a D-rank TSP run of the model ``shape`` (a planner
    ``ModelShape``). ``layers=n`` with n + 1 below the model's depth measures n and n+1 layers
    and extrapolates linearly (module doc); otherwise, and with ``None``, the full depth."""
    ranks = list(range(devices)) if ranks is None else list(ranks)
    bad = [r for r in ranks if not 0 <= r < devices]
    if bad:
        raise ValueError(f"ranks {bad} are not in 0..{devices - 1}")
    if layers is None or layers + 1 >= shape.layers:  # the full depth costs no more
        depths: tuple[int, ...] = (shape.layers,)
    else:
        if layers < 1:
            raise ValueError(f"layers must be >= 1, got {layers}")
        depths = (layers, layers + 1)
    runs: dict[int, list[RankMeasurement]] = {}
    for depth in depths:
        config = ref_config_from_shape(shape, depth)
        runs[depth] = []
        for r in ranks:
            res = measure_rank(
                config,
                seq_len=seq_len,
                micro_batch=micro_batch,
                dtype=dtype,
                rank=r,
                world=devices,
                mode=mode,
                schedules=schedules,
                recompute=recompute,
            )
            runs[depth].append(res)
            if progress is not None:
                progress(res)
    full = []
    for i in range(len(ranks)):
        if len(depths) == 1:
            full.append({k: float(v) for k, v in runs[depths[0]][i].at_peak.items()})
        else:
            a, b = runs[depths[0]][i], runs[depths[1]][i]
            extra = shape.layers - depths[0]
            full.append(
                {k: a.at_peak[k] + extra * (b.at_peak[k] - a.at_peak[k]) for k in CATEGORIES}
            )
    return Measurement(
        layers=shape.layers,
        measured_layers=depths,
        mode=mode,
        schedules=schedules,
        recompute=recompute,
        runs=runs,
        full=full,
    )


# --------------------------------------------------------------------------------------------
# Next to the analytic model
# --------------------------------------------------------------------------------------------

GB = 1e9
MB = 1e6


def analytic_as_measured(shape: Any, inputs: Any, mode: str, recompute: str = "none") -> Any:
    """The planner's TSP breakdown under the assumptions of what ``measure`` runs.

    Training: weights, gradients and both AdamW moments in the model dtype (kappa = 4 bytes x
    the dtype's width; no fp32 master copy), the recomputation the measured step ran
    (``recompute``), two weight shards in flight, no fixed overhead c0 (fake tensors have none).
    Forward: weights only (kappa = the dtype's width) and no stored activations (``no_grad``).
    """
    import dataclasses

    from tspc.tools.plan import memory_breakdown

    beta = inputs.act_bytes
    matched = dataclasses.replace(
        inputs,
        kappa=float(4 * beta if mode == "train" else beta),
        recompute=recompute if mode == "train" else "full",
        overhead_gb=0.0,
        tsp_inflight_shards=2,
    )
    d = inputs.devices
    m = memory_breakdown(shape, matched, "TSP", d, d)
    if mode == "forward":
        # One layer's working set and nothing stored: the recompute="full" working set term.
        m = dataclasses.replace(m, stored_activations=0.0)
    return m


def format_measurement(meas: Measurement, shape: Any, inputs: Any, seconds: float) -> str:
    """The ``--measure`` section of ``tspc plan``: per-rank peaks and the analytic figures."""
    from tspc.tools.plan import memory_breakdown

    d = inputs.devices
    unit, scale = ("GB", GB) if meas.max_peak >= 0.5 * GB else ("MB", MB)
    what = (
        "training step (forward + loss + backward + AdamW)"
        if meas.mode == "train"
        else "forward (loss under no_grad)"
    )
    first = next(iter(meas.runs.values()))[0]
    lines = ["", f"Measured: TSP(D={d}) on fake tensors, {what}, recompute={meas.recompute}"]
    text = (
        f"the real rewritten graph ran at level '{first.level}': {first.matched_attention} "
        f"attention and {first.matched_mlp} MLP layers matched in the {first.layers}-layer trace"
    )
    if first.skipped:
        text += f"; skipped: {'; '.join(first.skipped)}"
    if first.gathers:
        text += f"; sequence gathers: {', '.join(first.gathers)}"
    lines += _wrap(text)
    if meas.extrapolated:
        a, b = meas.measured_layers
        lines += _wrap(
            f"traced {a} and {b} layers per rank; each component extrapolated linearly to "
            f"{meas.layers} layers: x(L) = x({a}) + (L - {a}) * (x({b}) - x({a}))"
        )
    ranks = [r.rank for r in meas.runs[meas.measured_layers[0]]]
    headers = ["rank", *(CATEGORY_LABELS[c] for c in CATEGORIES), "peak"]
    rows = []
    for i, rank in enumerate(ranks):
        full = meas.full[i]
        rows.append(
            [str(rank)]
            + [f"{full[c] / scale:.2f}" for c in CATEGORIES]
            + [f"{meas.peak(i) / scale:.2f}"]
        )
    lines.append(f"  per-rank peak ({unit}) and what is live at that moment:")
    lines += _table(headers, rows)
    if meas.extrapolated:
        lines.append(f"  the traced depths, rank {ranks[0]} ({unit}):")
        depth_rows = []
        for depth in meas.measured_layers:
            r = meas.runs[depth][0]
            depth_rows.append(
                [f"{depth} layer(s)"]
                + [f"{r.at_peak[c] / scale:.3f}" for c in CATEGORIES]
                + [f"{r.peak / scale:.3f}"]
            )
        lines += _table(["traced", *headers[1:]], depth_rows)

    plan_tsp = memory_breakdown(shape, inputs, "TSP", d, d)
    matched = analytic_as_measured(shape, inputs, meas.mode, meas.recompute)
    kappa = 4 * inputs.act_bytes if meas.mode == "train" else inputs.act_bytes
    assumed = (
        f"kappa={kappa} B/param, recompute={meas.recompute}"
        if meas.mode == "train"
        else "weights only, nothing stored"
    )
    lines += [
        f"  measured vs analytic, TSP(D={d}), per rank ({unit}):",
        f"    measured, max over ranks                  {meas.max_peak / scale:10.2f}",
        f"    analytic, this plan's assumptions         {plan_tsp.total / scale:10.2f}",
        f"    analytic, the measured step's assumptions {matched.total / scale:10.2f}"
        f"   ({assumed}, 2 shards in flight, c0=0)",
    ]
    lines += _explain(meas, shape, inputs, plan_tsp, matched, unit, scale)
    traces = sum(len(v) for v in meas.runs.values())
    lines.append(f"  time: {seconds:.0f} s for {traces} trace(s) (one per rank and depth)")
    return "\n".join(lines)


def _wrap(text: str, first: str = "  ", rest: str = "    ") -> list[str]:
    import textwrap

    return textwrap.wrap(
        text, width=98, initial_indent=first, subsequent_indent=rest, break_on_hyphens=False
    )


def _explain(
    meas: Measurement,
    shape: Any,
    inputs: Any,
    plan_tsp: Any,
    matched: Any,
    unit: str,
    scale: float,
) -> list[str]:
    """Where the measured figure and the analytic ones differ, component by component."""
    i = max(range(len(meas.full)), key=meas.peak)
    full = meas.full[i]
    state_keys = ("full_weights", "shards", "other_params", "gradients", "optimizer")
    state = sum(full[c] for c in state_keys)
    acts = full["activations"] + full["communication"]
    plan_acts = plan_tsp.total - plan_tsp.model_state - plan_tsp.overhead
    h = shape.hidden
    tokens = inputs.micro_batch * inputs.seq_len / inputs.devices

    def f(x: float) -> str:
        return f"{x / scale:.2f}"

    lines = ["  where they differ (measured vs this plan):"]
    held = ", ".join(
        f"{label} {f(full[c])}"
        for c, label in (
            ("shards", "weight shards"),
            ("other_params", "unmatched parameters"),
            ("full_weights", "unreleased full weights"),
            ("gradients", "gradients"),
            ("optimizer", "optimizer state"),
        )
    )
    lines += _wrap(
        f"model state {f(state)} vs {f(plan_tsp.model_state)}: the plan counts kappa = "
        f"{inputs.kappa:g} B/param (bf16 weights and gradients, fp32 master weights and Adam "
        f"moments) with every gradient present; at its peak the measured step holds {held} "
        + ("(AdamW moments in the parameter dtype)" if meas.mode == "train" else ""),
        first="  - ",
    )
    lines += _wrap(
        f"activations and collective buffers {f(acts)} vs {f(plan_acts)} (stored "
        f"{f(plan_tsp.stored_activations)}, working set {f(plan_tsp.working_set)}, gathered "
        f"K/V {f(plan_tsp.kv_gathered)}, logits {f(plan_tsp.logits)}, shards in flight "
        f"{f(plan_tsp.weights_in_flight)})",
        first="  - ",
    )
    if meas.extrapolated:
        a, b = (meas.runs[depth][i] for depth in meas.measured_layers)
        act_inc = sum(b.at_peak[c] - a.at_peak[c] for c in ("activations", "communication"))
        state_inc = sum(b.at_peak[c] - a.at_peak[c] for c in state_keys)
        per_token = act_inc / (tokens * inputs.act_bytes) / h
        no_recompute = (inputs.a_rep(shape) + inputs.a_sh(shape)) / h
        if meas.mode == "train":
            planned = {
                "full": "1h (only the layer input: full recomputation)",
                "none": f"{no_recompute:g}h",
            }.get(inputs.recompute, f"{matched_per_token(shape, inputs):g}h")
            saved_by = {
                "none": "tspc ran no recomputation, aot_autograd's min-cut partitioner decided "
                "what is saved",
                "full": "tspc recomputed every block (only its input is saved)",
                "selective": "tspc recomputed each attention, the partitioner chose the rest",
            }[meas.recompute]
            n0 = meas.measured_layers[0]
            fixed = sum(a.at_peak[c] for c in ("activations", "communication")) - n0 * act_inc
            text = (
                f"per layer (the measured increment): {f(act_inc)} {unit} of activations and "
                f"collective buffers, {per_token:.1f}h elements per local token, where the plan "
                f"stores {planned} and its no-recompute model (a_rep + a_sh) says "
                f"{no_recompute:g}h ({saved_by}); model state {f(state_inc)} {unit} per layer"
            )
            lines += _wrap(text, first="  - ")
            text = (
                f"derived from the measured graph (replacing the plan's fitted a_rep and c0): "
                f"stored activations {per_token:.2f}h per token per layer; layer-independent "
                f"activations and buffers (the depth-0 intercept: logits and loss, embedding "
                f"output, one layer's recomputed working set, K/V and weight shards in flight) "
                f"{f(fixed)} {unit}, where the plan has working set + K/V + logits "
                f"{f(plan_tsp.working_set + plan_tsp.kv_gathered + plan_tsp.logits)} plus the "
                f"fitted c0 {f(plan_tsp.overhead)}"
            )
        else:
            text = (
                f"per layer (the measured increment): {f(act_inc)} {unit} of activations (nothing "
                f"is stored under no_grad), model state {f(state_inc)} {unit}"
            )
        lines += _wrap(text, first="  - ")
    lines += _wrap(
        f"c0 {f(plan_tsp.overhead)} vs none: the plan's fitted constant for the runtime, "
        "allocator and communication buffers; fake tensors have no such overhead, and "
        "op-internal temporaries are not counted",
        first="  - ",
    )
    return lines


def matched_per_token(shape: Any, inputs: Any) -> float:
    """Stored activation elements per token per layer of the plan's selective policy, / h."""
    from tspc.tools.plan import memory_breakdown

    m = memory_breakdown(shape, inputs, "TSP", inputs.devices, inputs.devices)
    tokens = inputs.micro_batch * inputs.seq_len / inputs.devices
    return m.stored_activations / (shape.layers * tokens * inputs.act_bytes * shape.hidden)


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [headers, *rows]) for i in range(len(headers))]

    def line(cells: list[str]) -> str:
        return "    " + "  ".join(
            [cells[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(cells[1:], widths[1:])]
        )

    return [line(headers)] + [line(r) for r in rows]
