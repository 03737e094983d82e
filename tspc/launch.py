"""Start D local processes with a gloo process group and collect what each returns.

Used by the samples, the tests and the benchmarks, so that each of them is a plain function
``fn(rank, world_size, *args) -> picklable`` rather than a script under ``torchrun``.
A worker that raises makes ``spawn`` raise with that worker's traceback; a worker that hangs is
killed after ``timeout`` seconds, so a deadlock fails a test instead of stalling the suite.

With ``TSPC_SPAWN_POOL=1`` (the test suite sets it), the D processes of a world size are kept
for the next ``spawn`` of the same size: starting a worker (importing torch, Dynamo,
transformers) costs more than most tests' work. Before each function a pooled worker resets
what a fresh process would not have (Dynamo's caches, the default RNG seed, environment
variables); a function that fails or hangs on any rank retires the whole pool, and a call with
``env`` or ``fresh=True`` always starts new processes.
"""

from __future__ import annotations

import atexit
import os
import socket
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, fn, args, queue, env, timeout):
    import torch
    import torch.distributed as dist

    os.environ.update(env)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    # Two cores are shared by up to four processes: one intra-op thread each avoids thrashing.
    torch.set_num_threads(int(env.get("TSPC_THREADS", "1")))
    try:
        from datetime import timedelta

        dist.init_process_group(
            "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
        )
        result = fn(rank, world_size, *args)
        queue.put((rank, True, result))
    except BaseException:  # noqa: BLE001 - reported to the parent, which re-raises
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class WorkerError(RuntimeError):
    pass


def _exit_with_parent(parent_pid: int) -> None:
    """A pooled worker must not outlive the process that started it (pytest killed, a crash)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, daemon=True).start()


def _pool_worker(rank, world_size, port, tasks, queue, parent_pid, pg_timeout):
    import random

    import torch
    import torch.distributed as dist

    _exit_with_parent(parent_pid)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    torch.set_num_threads(1)
    from datetime import timedelta

    dist.init_process_group(
        "gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=pg_timeout)
    )
    seed = torch.initial_seed()  # a fresh process's default seed
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args = task
        environ = dict(os.environ)
        torch.compiler.reset()
        _forget_tspc_compiles()
        torch.manual_seed(seed)
        random.seed(seed)
        try:
            queue.put((rank, True, fn(rank, world_size, *args)))
        except BaseException:  # noqa: BLE001 - reported to the parent, which retires the pool
            queue.put((rank, False, traceback.format_exc()))
        finally:
            os.environ.clear()
            os.environ.update(environ)
    dist.destroy_process_group()


def _forget_tspc_compiles() -> None:
    """What a fresh process would not hold: compiles kept for reuse, reports, dumps' graphs."""
    import sys

    compiles = sys.modules.get("tspc.compiles")
    if compiles is not None:
        compiles.STATIC.clear()
    backend = sys.modules.get("tspc.backend")
    if backend is not None:
        backend.COMPILED.clear()
    report = sys.modules.get("tspc.report")
    if report is not None:
        report.REPORTS.clear()


class _Pool:
    """``world_size`` started workers in one gloo group, waiting for functions to run."""

    PG_TIMEOUT = 900.0

    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self.queue = ctx.SimpleQueue()
        self.tasks = [ctx.SimpleQueue() for _ in range(world_size)]
        port = free_port()
        self.procs = [
            ctx.Process(
                target=_pool_worker,
                args=(r, world_size, port, self.tasks[r], self.queue, os.getpid(), self.PG_TIMEOUT),
                daemon=False,
            )
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def submit(self, fn, args) -> None:
        for t in self.tasks:
            t.put((fn, args))

    def close(self, kill: bool = False) -> None:
        for p, t in zip(self.procs, self.tasks):
            if not kill and p.is_alive():
                t.put(None)
        for p in self.procs:
            p.join(timeout=0 if kill else 10)
            if p.is_alive():
                p.kill()
                p.join()


_POOLS: dict[int, _Pool] = {}


@atexit.register
def _close_pools() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close()


def _pooled() -> bool:
    return os.environ.get("TSPC_SPAWN_POOL") == "1"


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
    fresh: bool = False,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    ``fn`` must be importable by name (a module-level function), as with any spawn start method.
    ``fresh``: new processes even when pooling is on (a test that kills or stalls a rank).
    """
    if _pooled() and not env and not fresh:
        pool = _POOLS.get(world_size)
        if pool is None or not all(p.is_alive() for p in pool.procs):
            if pool is not None:
                pool.close(kill=True)
            pool = _POOLS[world_size] = _Pool(world_size)
        pool.submit(fn, args)
        try:
            return _collect(pool.queue, pool.procs, world_size, timeout, pooled=True)
        except BaseException:
            del _POOLS[world_size]  # a rank may be stuck in a collective: start afresh
            pool.close(kill=True)
            raise
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = free_port()
    env = dict(env or {})
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, fn, args, queue, env, timeout),
            daemon=False,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    try:
        return _collect(queue, procs, world_size, timeout)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()


def _collect(queue, procs, world_size: int, timeout: float, pooled: bool = False) -> list[Any]:
    """Every rank's result, or a WorkerError with every failed rank's traceback."""
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout + 30
    while len(results) + len(errors) < world_size:
        if time.monotonic() > deadline:
            if errors:
                break
            raise WorkerError(
                f"workers did not finish within {timeout:.0f}s (finished ranks: "
                f"{sorted(results) + sorted(errors)}); killed"
            )
        if queue.empty():
            if all(not p.is_alive() for p in procs):
                time.sleep(0.2)  # let the last messages through the pipe
                if queue.empty():
                    break
            elif pooled and any(not p.is_alive() for p in procs):
                # a pooled worker only exits by crashing: its peers wait in a collective
                deadline = min(deadline, time.monotonic() + 10)
            time.sleep(0.02)
            continue
        rank, ok, payload = queue.get()
        (results if ok else errors)[rank] = payload
        if not ok:
            # The other ranks are likely blocked in a collective with the failed one.
            deadline = min(deadline, time.monotonic() + 10)
    silent = [r for r in range(world_size) if r not in results and r not in errors]
    if errors or silent:
        # Every failed rank is shown: the first to report is often only the victim of a peer
        # that died (a closed connection), and the root cause is in another rank's traceback.
        text = "\n".join(f"--- rank {r} failed:\n{errors[r]}" for r in sorted(errors))
        for r in silent:
            text += f"\n--- rank {r} exited without reporting (exit code {procs[r].exitcode})"
        raise WorkerError(f"ranks {sorted(errors) + silent} failed\n{text}")
    return [results[r] for r in range(world_size)]
