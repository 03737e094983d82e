"""Data parallelism on top of TSP: average gradients over the data-parallel axis of the mesh.

Every data-parallel replica runs the same TSP graphs on its own batch, so the gradients a rank
holds (its shards, and the replicated parameters, already summed over the TSP axis in-graph)
are exact for its replica's loss; averaging them over the dp axis gives the gradient of the
mean loss over the global batch, as DDP does.

As in DDP, gradients are averaged in buckets while the backward runs: a post-accumulate-grad
hook puts each gradient, as it becomes ready, into the current bucket of its dtype; a full
bucket (``BUCKET_BYTES``) is flattened and all-reduced asynchronously, so the transfer overlaps
the rest of the backward; at the end of the backward (an autograd engine callback) the last
partial buckets go out, every transfer is waited for, and the averages are copied back.

With gradient accumulation each backward averages the whole accumulated gradient again. That
is exact (the part from earlier micro-batches is already equal on every dp rank, and an average
of equal values is that value) but moves the bytes once per micro-batch, like DDP without
``no_sync``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .compat import queue_backward_callback
from .dp_shard import is_dp_sharded
from .group import process_group

BUCKET_BYTES = 25 * 1024 * 1024  # DDP's default bucket_cap_mb

# An attribute on the tensor marks a hooked parameter and holds its averager: a weak reference
# to a DTensor parameter would make ``model.to()`` fail (``torch.utils.swap_tensors`` refuses
# weakly referenced tensors).
_FLAG = "_tspc_dp_averaged"


@dataclass
class _Bucket:
    grads: list[torch.Tensor] = field(default_factory=list)
    nbytes: int = 0


class GradAverager:
    """Bucketed, overlapped averaging of gradients over one data-parallel group."""

    def __init__(self, group_name: str, size: int, bucket_bytes: int = BUCKET_BYTES):
        self.group_name = group_name
        self.size = size
        self.bucket_bytes = bucket_bytes
        self.open: dict[tuple[torch.dtype, torch.device], _Bucket] = {}
        self.in_flight: list[tuple[dist.Work, torch.Tensor, list[torch.Tensor]]] = []
        self.callback_queued = False
        self.launched = 0  # all-reduces issued (for tests and the bench)

    def add(self, param: torch.Tensor) -> None:
        g = param.grad
        if g is None or is_dp_sharded(param):
            # split over dp (data_parallel="fsdp"/"hsdp"): its reduce-scatter averaged it
            # already, and the dp ranks hold different parts, which an all-reduce would mix
            return
        if isinstance(g, DTensor):  # a DTensor parameter's gradient: its local part
            g = g.to_local()
        if not self.callback_queued:
            queue_backward_callback(self.finish)
            self.callback_queued = True
        key = (g.dtype, g.device)
        bucket = self.open.setdefault(key, _Bucket())
        bucket.grads.append(g)
        bucket.nbytes += g.numel() * g.element_size()
        if bucket.nbytes >= self.bucket_bytes:
            self._launch(self.open.pop(key))

    def _launch(self, bucket: _Bucket) -> None:
        flat = torch.cat([g.reshape(-1) for g in bucket.grads])
        work = dist.all_reduce(flat, group=process_group(self.group_name), async_op=True)
        self.in_flight.append((work, flat, bucket.grads))
        self.launched += 1

    def finish(self) -> None:
        """End of the backward: send what is left, wait for everything, write the averages."""
        for key in list(self.open):
            self._launch(self.open.pop(key))
        for work, flat, grads in self.in_flight:
            work.wait()
            flat.div_(self.size)
            offset = 0
            for g in grads:
                n = g.numel()
                g.copy_(flat[offset : offset + n].view_as(g))
                offset += n
        self.in_flight.clear()
        self.callback_queued = False


_AVERAGERS: dict[tuple[str, int], GradAverager] = {}


def averager_for(group_name: str, size: int) -> GradAverager:
    key = (group_name, size)
    if key not in _AVERAGERS:
        _AVERAGERS[key] = GradAverager(group_name, size)
    return _AVERAGERS[key]


def average_grads_over(params, group_name: str, size: int) -> int:
    """Install (once per parameter) the hook that averages its gradient over ``group_name``."""
    averager = averager_for(group_name, size)
    installed = 0
    for p in params:
        if not isinstance(p, torch.Tensor) or not p.requires_grad or getattr(p, _FLAG, False):
            continue
        p.register_post_accumulate_grad_hook(averager.add)
        setattr(p, _FLAG, averager)
        installed += 1
    return installed


def is_averaging_hook(hook) -> bool:
    """Whether ``hook`` is a ``GradAverager``'s (installed by tspc, not the user)."""
    return isinstance(getattr(hook, "__self__", None), GradAverager)


def grad_written(p: torch.Tensor) -> None:
    """``p.grad`` was written outside autograd's accumulation, which alone fires the hook (a
    gradient moved onto ``p`` during the backward): average it as the hook would. Averaging
    again what the hook averaged already is exact: that part is equal on every dp rank."""
    averager = getattr(p, _FLAG, None)
    if isinstance(averager, GradAverager):
        averager.add(p)
