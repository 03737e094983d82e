"""Op costs (roofline, α–β) and the two-stream replay of a recorded step.

Roofline: a compute op takes ``max(FLOPs / rate, bytes / bandwidth) + overhead``, where the rate
is the peak FLOP/s for its dtype times its class's efficiency (GEMM, attention) or a measured
curve (GEMMs by FLOPs per call; attention forward and backward by head size), and the
bandwidth the memory bandwidth times its efficiency or a measured curve.
Views move nothing: they cost ``view_overhead`` (0 on the GPU presets; a CPU's dispatch time
when calibrated); metadata queries (ops that return no tensor) cost nothing. This is the roofline of ``torch.distributed._tools.runtime_estimator``
(``_roofline_estimate``: max of compute time from the FLOP counter and transfer time from the
bytes of inputs and outputs), with a per-class efficiency instead of its fixed factors.

Replay: one compute stream and one communication stream, as the graph orders the ops.

* a compute op starts when the compute stream is free (its inputs were produced before it in
  program order, or arrived through a wait that came before it);
* a start is issued when the compute stream reaches it (its inputs are ready then) and its
  transfer begins when the communication stream is also free (collectives of one group run in
  issue order, as on one NCCL communicator): ``begin = max(compute clock, comm clock)``;
* a wait blocks the compute stream until its transfer has ended; the blocked time is exposed
  communication;
* a sync collective is a start immediately followed by its wait.

The step time is when both streams are done. ``overlap`` < 1 (a CPU, where gloo's threads take
cores from the compute) slows compute that runs while a transfer is in flight: a fraction
``1 - overlap`` of the overlapped transfer time is added to the compute stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tspc.tools.timemodel.collectives import collective_time
from tspc.tools.timemodel.hardware import Hardware, interpolate
from tspc.tools.timemodel.trace import Op


def compute_time(hw: Hardware, op: Op) -> float:
    """Roofline seconds of one compute op on ``hw``."""
    if op.cls == "meta":
        return 0.0
    if op.cls == "view":
        return hw.view_overhead
    if op.cls == "gemm" and op.dtype in hw.gemm_curve:
        rate = interpolate(hw.gemm_curve[op.dtype], max(op.flops, 1.0))
    elif op.cls == "attention" and hw.attention_curve and op.head_dim:
        column = 2 if op.name.endswith("_backward") else 1
        curve = [[row[0], row[column]] for row in hw.attention_curve]
        rate = interpolate(curve, float(op.head_dim))
    elif op.cls == "attention":
        rate = hw.flops(op.dtype) * hw.attention_efficiency
    else:
        rate = hw.flops(op.dtype) * hw.gemm_efficiency
    if hw.memory_curve:
        bandwidth = interpolate(hw.memory_curve, max(op.nbytes, 1.0))
    else:
        bandwidth = hw.memory_bandwidth * hw.memory_efficiency
    flops = op.flops if op.cls in ("gemm", "attention") else 0.0
    return max(flops / rate, op.nbytes / bandwidth) + hw.op_overhead


def transfer_time(hw: Hardware, op: Op) -> float:
    return collective_time(hw, op.collective, op.nbytes, op.devices)


@dataclass
class Replay:
    """What a replay gives, in seconds."""

    step: float  # when both streams are done
    compute: float  # busy time of the compute stream (sum of compute ops)
    communication: float  # busy time of the communication stream
    exposed: float  # time the compute stream waited on transfers
    flops: float  # FLOPs of the GEMM and attention ops
    collectives: int

    def scaled(self, other: Replay, factor: float) -> Replay:
        """``self + factor * (other - self)``, field by field (linear extrapolation)."""
        f = {k: getattr(self, k) + factor * (getattr(other, k) - getattr(self, k)) for k in
             ("step", "compute", "communication", "exposed", "flops")}  # fmt: skip
        return Replay(**f, collectives=round(self.collectives + factor * (other.collectives -
                      self.collectives)))  # fmt: skip


def replay(ops: Sequence[Op], hw: Hardware) -> Replay:
    """The two-stream replay of ``ops`` on ``hw`` (module doc)."""
    return replay_timed(ops, [_cost(hw, op) for op in ops], hw.overlap)


def _cost(hw: Hardware, op: Op) -> float:
    if op.kind == "compute":
        return compute_time(hw, op)
    if op.kind in ("start", "sync"):
        return transfer_time(hw, op)
    return 0.0


def replay_timed(ops: Sequence[Op], costs: Sequence[float], overlap: float = 1.0) -> Replay:
    """The replay with each op's duration given (compute seconds, or transfer seconds for a
    start or sync). A wait whose start was never seen (a handle of -1) costs nothing."""
    compute_clock = comm_clock = 0.0
    busy_compute = busy_comm = exposed = flops = 0.0
    ends: dict[int, float] = {}
    count = 0
    for op, cost in zip(ops, costs):
        if op.kind == "compute":
            if overlap < 1.0 and comm_clock > compute_clock:
                # compute running while a transfer is in flight is slowed down by it
                shared = min(cost, comm_clock - compute_clock)
                cost += (1.0 - overlap) * shared
            compute_clock += cost
            busy_compute += cost
            if op.cls in ("gemm", "attention"):
                flops += op.flops
        elif op.kind in ("start", "sync"):
            count += 1
            begin = max(compute_clock, comm_clock)
            comm_clock = begin + cost
            busy_comm += cost
            if op.kind == "sync":
                exposed += comm_clock - compute_clock
                compute_clock = comm_clock
            else:
                ends[op.handle] = comm_clock
        elif op.kind == "wait":
            end = ends.pop(op.handle, None)
            if end is not None and end > compute_clock:
                exposed += end - compute_clock
                compute_clock = end
    return Replay(
        step=max(compute_clock, comm_clock),
        compute=busy_compute,
        communication=busy_comm,
        exposed=exposed,
        flops=flops,
        collectives=count,
    )
