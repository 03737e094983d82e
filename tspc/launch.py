"""Start D local processes with a gloo process group and collect what each returns.

Used by the samples, the tests and the benchmarks, so that each of them is a plain function
``fn(rank, world_size, *args) -> picklable`` rather than a script under ``torchrun``.
A worker that raises makes ``spawn`` raise with that worker's traceback; a worker that hangs is
killed after ``timeout`` seconds, so a deadlock fails a test instead of stalling the suite.
"""

from __future__ import annotations

import os
import socket
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


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 300.0,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results by rank.

    ``fn`` must be importable by name (a module-level function), as with any spawn start method.
    """
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
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    import time

    deadline = time.monotonic() + timeout + 30
    try:
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
                time.sleep(0.02)
                continue
            rank, ok, payload = queue.get()
            (results if ok else errors)[rank] = payload
            if not ok:
                # The other ranks are likely blocked in a collective with the failed one.
                deadline = min(deadline, time.monotonic() + 10)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join()
    silent = [r for r in range(world_size) if r not in results and r not in errors]
    if errors or silent:
        # Every failed rank is shown: the first to report is often only the victim of a peer
        # that died (a closed connection), and the root cause is in another rank's traceback.
        text = "\n".join(f"--- rank {r} failed:\n{errors[r]}" for r in sorted(errors))
        for r in silent:
            text += f"\n--- rank {r} exited without reporting (exit code {procs[r].exitcode})"
        raise WorkerError(f"ranks {sorted(errors) + silent} failed\n{text}")
    return [results[r] for r in range(world_size)]
