"""Measure this machine's constants with microbenchmarks only (``tspc plan --calibrate``).

Nothing here runs a model or a step: GEMMs of several sizes, square and tall-skinny, with
transposed operands as a backward has them (FLOP/s by FLOPs per call), an elementwise add of
several sizes (bytes/s by bytes per call), one op on one element (the cost of an op call,
``op_overhead``), a view (dispatch cost), causal SDPA forward and backward at several head
sizes (FLOP/s by head size), and, in ``devices`` gloo processes, each collective at several
message sizes (α and bandwidth fitted per collective with the algorithm formulas of
``collectives.py``) and one all-reduce run under a GEMM loop (how much a transfer slows the
compute it overlaps: ``overlap``). One intra-op thread per process, as
``tspc.launch`` and ``bench/throughput.py`` run.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from tspc.tools.timemodel.collectives import fit_link
from tspc.tools.timemodel.hardware import Hardware, Link

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _timed(fn: Callable[[], Any], repeats: int = 5, min_s: float = 0.02) -> float:
    """Median seconds of one call (each sample loops until ``min_s`` has passed)."""
    fn()
    samples = []
    for _ in range(repeats):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= min_s:
                break
        samples.append(elapsed / n)
    return statistics.median(samples)


def compute_constants(dtype: str = "fp32", quick: bool = False) -> dict[str, Any]:
    """GEMM curve, memory curve, per-op and view cost and attention efficiency of this process.

    Every op is called as an aot_eager graph's code calls it (``torch.ops.aten.<op>.<overload>``:
    an ``OpOverload`` call costs several microseconds of Python and dispatch, several times a
    ``torch.add`` call's). ``op_overhead`` is that cost on one-element tensors; the curves are the
    rates of the work above it (``time - op_overhead``), so ``op_overhead + work / rate`` gives
    back each measured time and extends below the smallest size measured."""
    torch.set_num_threads(1)
    dt = DTYPES[dtype]
    aten = torch.ops.aten
    one = torch.ones(1, dtype=dt)
    floor = _timed(lambda: aten.add.Tensor(one, one))

    def rate(work: float, seconds: float, calls: int = 1) -> float:
        # (a size at the floor's noise: its work at no less than a tenth of the call)
        return work / max(seconds - calls * floor, 0.1 * seconds)

    gemm = []
    for n in (32, 64, 128, 256, 512) if quick else (32, 64, 128, 256, 384, 512, 768):
        flops, seconds = gemm_mix(n, dt)
        gemm.append([flops / 9, rate(flops, seconds, calls=9)])
    gemm.sort()
    memory = []
    for numel in (1e3, 1e4, 1e5, 1e6) if quick else (1e3, 1e4, 1e5, 1e6, 4e6):
        x, y = torch.randn(int(numel), dtype=dt), torch.randn(int(numel), dtype=dt)
        s = _timed(lambda x=x, y=y: aten.add.Tensor(x, y))
        nbytes = 3 * numel * x.element_size()
        memory.append([nbytes, rate(nbytes, s)])
    x = torch.randn(64, 64, dtype=dt)
    view = _timed(lambda: aten.view.default(x, [4096]))
    attention = [attention_rates(d, dt, rate) for d in ((16, 64) if quick else (16, 32, 64, 128))]
    peak = max(r for _, r in gemm)
    return {
        "peak_flops": {dtype: peak},
        "gemm_curve": {dtype: gemm},
        "memory_curve": memory,
        "memory_bandwidth": max(r for _, r in memory),
        "op_overhead": floor,
        "view_overhead": view,
        "attention_efficiency": min(1.0, max(r[1] for r in attention) / peak),
        "attention_curve": attention,
    }


def gemm_mix(n: int, dt: torch.dtype) -> tuple[float, float]:
    """FLOPs and seconds of nine GEMMs of about ``2 n^3`` FLOPs each, as a training step runs
    them: square and tall-skinny ([4n, n/2] x [n/2, n], [4n, n] x [n, n/2]: tokens x features),
    each with plain, transposed-right (forward ``x W^T``) and transposed-left (a weight's
    gradient ``dY^T X``) operands."""
    aten = torch.ops.aten
    flops = seconds = 0.0
    for m, k, p in ((n, n, n), (4 * n, n // 2, n), (4 * n, n, n // 2)):
        a, b = torch.randn(m, k, dtype=dt), torch.randn(k, p, dtype=dt)
        bt, at = torch.randn(p, k, dtype=dt).t(), torch.randn(k, m, dtype=dt).t()
        for x, y in ((a, b), (a, bt), (at, b)):
            seconds += _timed(lambda x=x, y=y: aten.mm.default(x, y))
            flops += 2.0 * m * k * p
    return flops, seconds


def attention_rates(
    head_dim: int, dt: torch.dtype, rate: Callable[[float, float], float], seq: int = 1024
) -> list[float]:
    """[head_dim, forward FLOP/s, backward FLOP/s] of causal SDPA (8 heads, ``seq`` tokens),
    FLOPs counted as the trace counts them (``trace.attention_flops``)."""
    q, k, v = (torch.randn(1, 8, seq, head_dim, dtype=dt, requires_grad=True) for _ in range(3))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    grad = torch.randn(1, 8, seq, head_dim, dtype=dt)
    flops = 4.0 * 8 * seq * seq * head_dim * 0.5
    with torch.no_grad():
        forward = _timed(lambda: sdpa(q, k, v, is_causal=True))

    def both() -> None:
        out = sdpa(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), grad)

    backward = max(_timed(both) - forward, 0.1 * forward)
    return [float(head_dim), rate(flops, forward), rate(2.5 * flops, backward)]


COLLECTIVES = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "reduce", "p2p")


def _collective_ops(
    x: torch.Tensor,
    big: torch.Tensor,
    part: torch.Tensor,
    recv: torch.Tensor,
    rank: int,
    world: int,
) -> dict[str, Callable[[], Any]]:
    """One call of each collective on ``x`` (``big``: gathered, ``part``: scattered)."""
    import torch.distributed as dist

    def p2p() -> None:
        ops = [
            dist.P2POp(dist.isend, x, (rank + 1) % world),
            dist.P2POp(dist.irecv, recv, (rank - 1) % world),
        ]
        for work in dist.batch_isend_irecv(ops):
            work.wait()

    return {
        "all_gather": lambda: dist.all_gather_into_tensor(big, x),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(part, x),
        "all_reduce": lambda: dist.all_reduce(x),
        "broadcast": lambda: dist.broadcast(x, 0),
        "reduce": lambda: dist.reduce(x, 0),
        "p2p": p2p,
    }


def _collective_worker(rank: int, world: int, port: int, quick: bool, queue: Any) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    sizes = (2**14, 2**18, 2**22) if quick else (2**12, 2**16, 2**20, 2**22, 2**24)
    out: dict[str, list[tuple[float, float]]] = {k: [] for k in COLLECTIVES}
    for nbytes in sizes:
        n = nbytes // 4
        x = torch.randn(n)
        big = torch.empty(n * world)
        part = torch.empty(n // world)
        ops = _collective_ops(x, big, part, x.new_empty(n), rank, world)
        payload = {"all_gather": nbytes * world}
        for kind, fn in ops.items():
            dist.barrier()
            samples = []
            for _ in range(3 if quick else 5):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(3):
                    fn()
                samples.append((time.perf_counter() - t0) / 3)
            out[kind].append((float(payload.get(kind, nbytes)), statistics.median(samples)))
    # overlap: a GEMM loop alone, an all-reduce alone, both at once
    a = torch.randn(256, 256)
    y = torch.randn(2**20)

    def gemms() -> None:
        for _ in range(40):
            torch.mm(a, a)

    def lockstep(fn: Callable[[], Any], calls: int = 5) -> float:
        # the same number of calls on every rank: ``_timed`` loops for a time, and ranks that
        # run a collective a different number of times wait on each other for ever
        dist.barrier()
        fn()
        samples = []
        for _ in range(3):
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            samples.append((time.perf_counter() - t0) / calls)
        return statistics.median(samples)

    def both() -> None:
        work = dist.all_reduce(y, async_op=True)
        gemms()
        work.wait()

    tc = lockstep(gemms)
    tm = lockstep(lambda: dist.all_reduce(y))
    tb = lockstep(both)
    # A rank whose last all-reduce finished first must not close the group under the other's
    # wait (gloo: "Connection closed by peer").
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        overlap = 1.0 - (tb - max(tc, tm)) / min(tc, tm)
        queue.put({"points": out, "overlap": min(1.0, max(0.05, overlap))})


def collective_constants(devices: int = 2, quick: bool = False) -> dict[str, Any]:
    """Fitted α/bandwidth per collective over ``devices`` gloo processes, and ``overlap``."""
    import multiprocessing as mp
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [
        ctx.Process(target=_collective_worker, args=(r, devices, port, quick, queue))
        for r in range(devices)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(600)
    if queue.empty():
        raise RuntimeError("the gloo microbenchmark processes failed (see their output above)")
    res = queue.get()
    links = {k: fit_link(k, devices, pts) for k, pts in res["points"].items()}
    return {"collectives": links, "overlap": res["overlap"], "points": res["points"]}


def calibrate(devices: int = 2, dtype: str = "fp32", quick: bool = False) -> Hardware:
    """This machine as a :class:`Hardware` (measured; see the module doc)."""
    c = compute_constants(dtype, quick)
    comm = collective_constants(devices, quick)
    p2p = comm["collectives"]["p2p"]
    return Hardware(
        name="this machine (calibrated)",
        peak_flops=c["peak_flops"],
        memory_bandwidth=c["memory_bandwidth"],
        links={"intra": Link(p2p.alpha, p2p.bandwidth)},
        devices_per_node=os.cpu_count() or 1,
        gemm_efficiency=1.0,
        attention_efficiency=c["attention_efficiency"],
        memory_efficiency=1.0,
        op_overhead=c["op_overhead"],
        view_overhead=c["view_overhead"],
        gemm_curve=c["gemm_curve"],
        memory_curve=c["memory_curve"],
        attention_curve=c["attention_curve"],
        collectives=comm["collectives"],
        overlap=comm["overlap"],
        source=f"tspc plan --calibrate: microbenchmarks, {dtype}, 1 thread, gloo over {devices}",
    )
