"""Measure this machine's constants with microbenchmarks only (``tspc plan --calibrate``).

Nothing here runs a model or a step: GEMMs of several sizes (FLOP/s by FLOPs per call), an
elementwise add of several sizes (bytes/s by bytes per call), a view (dispatch cost), one
causal SDPA (attention's fraction of the GEMM peak), and, in ``devices`` gloo processes, each
collective at several message sizes (α and bandwidth fitted per collective with the algorithm
formulas of ``collectives.py``) and one all-reduce run under a GEMM loop (how much a transfer
slows the compute it overlaps: ``overlap``). One intra-op thread per process, as
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
    """GEMM curve, memory curve, view cost and attention efficiency of this process."""
    torch.set_num_threads(1)
    dt = DTYPES[dtype]
    gemm = []
    for n in (32, 64, 128, 256, 512) if quick else (32, 64, 128, 256, 384, 512, 768):
        a, b = torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)
        s = _timed(lambda a=a, b=b: torch.mm(a, b))
        gemm.append([2.0 * n**3, 2.0 * n**3 / s])
    gemm.sort()
    memory = []
    for numel in (1e3, 1e4, 1e5, 1e6) if quick else (1e3, 1e4, 1e5, 1e6, 4e6):
        x, y = torch.randn(int(numel), dtype=dt), torch.randn(int(numel), dtype=dt)
        s = _timed(lambda x=x, y=y: torch.add(x, y))
        nbytes = 3 * numel * x.element_size()
        memory.append([nbytes, nbytes / s])
    x = torch.randn(64, 64, dtype=dt)
    view = _timed(lambda: x.view(4096))
    q = torch.randn(1, 4, 1024, 32, dtype=dt)
    s = _timed(lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True))
    attention_rate = 4.0 * 4 * 1024 * 1024 * 32 * 0.5 / s
    peak = max(r for _, r in gemm)
    return {
        "peak_flops": {dtype: peak},
        "gemm_curve": {dtype: gemm},
        "memory_curve": memory,
        "memory_bandwidth": max(r for _, r in memory),
        "view_overhead": view,
        "attention_efficiency": min(1.0, attention_rate / peak),
    }


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

    dist.barrier()
    tc = _timed(gemms, repeats=3)
    dist.barrier()
    tm = _timed(lambda: dist.all_reduce(y), repeats=3)
    dist.barrier()

    def both() -> None:
        work = dist.all_reduce(y, async_op=True)
        gemms()
        work.wait()

    tb = _timed(both, repeats=3)
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
        op_overhead=0.0,
        view_overhead=c["view_overhead"],
        gemm_curve=c["gemm_curve"],
        memory_curve=c["memory_curve"],
        collectives=comm["collectives"],
        overlap=comm["overlap"],
        source=f"tspc plan --calibrate: microbenchmarks, {dtype}, 1 thread, gloo over {devices}",
    )
