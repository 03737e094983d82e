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
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tspc.tools.fake_memory import CATEGORIES, CATEGORY_LABELS, FakeMemoryTracker  # noqa: F401
from tspc.tools.fake_run import (  # noqa: F401  (re-exported for callers of tspc.tools.measure)
    TORCH_DTYPES,
    LossModel,
    _default_dtype,
    _fake_group,
    _keep_fake_parameter_class,
    _local,
    is_matched_param,
    measured_step,
    ref_config_from_shape,
    reference_model,
    shards_of,
    warm_up,
)
from tspc.tools.measure_report import (  # noqa: F401  (re-exported)
    analytic_as_measured,
    format_measurement,
)

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
DATA_PARALLEL = ("replicate", "fsdp", "hsdp")
# the category of a block no state claims, by what made it (fake_memory._Block.kind)
_UNCLAIMED = {"comm": "communication", "eager_comm": "dp_gathered"}

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
    matched_moe: int = 0  # of matched_mlp, the MoE blocks run expert-parallel
    # what is live at the peak, summed by (category, the op that made it): the largest
    largest_at_peak: list[tuple[int, str, str]] = field(default_factory=list)


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
    dp: int = 1,
    data_parallel: str = "replicate",
    dp_shard: int | None = None,
) -> RankMeasurement:
    """Compile and run one step of the reference model as ``rank`` of ``world``, on fake
    tensors, and measure the step's peak live bytes (see the module doc).

    ``config`` is a ``samples.reference_model.RefConfig``. ``mode``: "train" (forward, loss,
    backward, AdamW step; two warm-up steps compile and create the optimizer state, the third
    is measured) or "forward" (the loss under ``torch.no_grad()``). ``dp`` > 1 with
    ``data_parallel`` "fsdp" or "hsdp" (shard groups of ``dp_shard`` ranks) runs the TSP axis
    as the first of ``dp`` replicas on a (dp, tsp) / (rep, shard, tsp) mesh of dp x ``world``
    fake ranks, ``rank`` its TSP rank; "replicate" is the one axis (its model state per rank
    does not depend on dp).
    """
    import tspc
    from tspc.runtime.compat import FakeTensorMode
    from tspc.tools.fake_moe import routed_buffers
    from tspc.tools.fake_run import model_of_config

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    torch.compiler.reset()  # a fresh model per rank: stale guards would recompile, then give up
    last_id = tspc.report.last_graph_id()
    with (
        _fake_group(rank, world * dp),
        _default_dtype(TORCH_DTYPES[dtype]),
        _keep_fake_parameter_class(),
        _data_parallel_mesh(world, dp, data_parallel, dp_shard) as mesh_options,
        FakeTensorMode(),
    ):
        t0 = time.perf_counter()
        model = LossModel(model_of_config(config))
        ids = torch.randint(0, config.vocab_size, (micro_batch, seq_len))
        targets = torch.randint(0, config.vocab_size, (micro_batch, seq_len))
        compiled = torch.compile(
            model,
            backend="tsp",
            # fake tensors: aot_eager (Inductor would generate and build kernels for them)
            options={"schedules": schedules, "recompute": recompute, "inner": "aot_eager"}
            | mesh_options,
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
        tracker = FakeMemoryTracker(transient=routed_buffers)
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
            cat = role.get(i) or _UNCLAIMED.get(blk.kind, "activations")
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
        layers=getattr(config, "num_layers", None) or config.num_hidden_layers,
        mode=mode,
        peak=peak,
        at_peak=at_peak,
        level=report.level if report else "?",
        matched_attention=sum(
            1 for e in (report.matched if report else []) if e.kind == "attention"
        ),
        matched_mlp=sum(1 for e in (report.matched if report else []) if e.kind == "mlp"),
        matched_moe=sum(
            1
            for e in (report.matched if report else [])
            if e.details.get("form") == "moe (expert parallel)"
        ),
        skipped=[f"{e.kind} {e.module}: {e.reason}" for e in (report.skipped if report else [])],
        gathers=[f"{g['value']} for {g['op']}" for g in (report.gathers if report else [])],
        compile_seconds=t1 - t0,
        step_seconds=t2 - t1,
        ops=tracker.ops,
        largest_at_peak=largest[:12],
    )


def _in_own_process(config: Any, **kwargs: Any) -> RankMeasurement:
    """``measure_rank`` in a fresh process. On a data-parallel mesh a second measurement in
    the same process finds a parameter of the first one's model (a DTensor on the destroyed
    fake group's mesh) in tspc's per-process state; a process per rank is the isolation."""
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(measure_rank, (config,), kwargs)


@contextlib.contextmanager
def _data_parallel_mesh(
    devices: int, dp: int, data_parallel: str, dp_shard: int | None
) -> Iterator[dict[str, Any]]:
    """The backend options that put the TSP axis of ``devices`` ranks on the data-parallel
    mesh of the fake group (this rank in the first replica: the TSP dim is the last), or none
    for one TSP axis (``replicate``: a rank holds what one axis holds; the buckets of the
    gradients' all-reduce over dp are not counted)."""
    if data_parallel not in DATA_PARALLEL:
        raise ValueError(f"data_parallel must be one of {DATA_PARALLEL}, got {data_parallel!r}")
    if dp == 1 or data_parallel == "replicate":
        yield {}
        return
    from torch.distributed.device_mesh import init_device_mesh

    if data_parallel == "fsdp":
        mesh = init_device_mesh("cpu", (dp, devices), mesh_dim_names=("dp", "tsp"))
    else:  # hsdp: dp / dp_shard replicas of a shard group of dp_shard ranks
        shard = dp_shard or dp
        if dp % shard:
            raise ValueError(f"dp_shard = {shard} does not divide dp = {dp}")
        mesh = init_device_mesh(
            "cpu", (dp // shard, shard, devices), mesh_dim_names=("rep", "shard", "tsp")
        )
    yield {"group": mesh, "mesh_dim": "tsp", "data_parallel": data_parallel}


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
    # the data-parallel mesh the TSP axis ran in ("replicate": one TSP axis alone)
    data_parallel: str = "replicate"
    dp: int = 1
    dp_shard: int | None = None

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
    dp: int = 1,
    data_parallel: str = "replicate",
    dp_shard: int | None = None,
) -> Measurement:
    """Measure ``ranks`` (default: all) of a D-rank TSP run of the model ``shape`` (a planner
    ``ModelShape``). ``layers=n`` with n + 1 below the model's depth measures n and n+1 layers
    and extrapolates linearly (module doc); otherwise, and with ``None``, the full depth.
    ``dp``, ``data_parallel``, ``dp_shard``: the data-parallel mesh around it (``measure_rank``)."""
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
            run = measure_rank if dp == 1 or data_parallel == "replicate" else _in_own_process
            res = run(
                config,
                seq_len=seq_len,
                micro_batch=micro_batch,
                dtype=dtype,
                rank=r,
                world=devices,
                mode=mode,
                schedules=schedules,
                recompute=recompute,
                dp=dp,
                data_parallel=data_parallel,
                dp_shard=dp_shard,
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
        data_parallel=data_parallel if dp > 1 else "replicate",
        dp=dp,
        dp_shard=dp_shard,
    )
