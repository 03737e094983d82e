"""The expert-parallel exchange: pipelined (``runtime/moe_exchange.py``) against dispatch
all-to-all, experts, combine all-to-all — one MoE layer's experts, forward and backward.

    python bench/moe_overlap.py            # D = 2 and 4, two shapes (~2 min on 2 cores)
    python bench/moe_overlap.py --quick    # tiny shapes, seconds

Each row calls ``tspc::moe_experts`` (what the MoE rewrite puts in the graph) on gloo ranks:
every rank routes its own N tokens to k of E experts at random (top-k of uniform scores), runs
the experts it owns on the rows it receives (``silu``, two stacked weights ``[E/D, F, h]`` and
``[E/D, h, F]``), and takes the gradient of the inputs and of its expert shards. The two
schedules take turns step by step (a barrier before each step); a step's time is the slowest
rank's, a row's figure the median. ``exchange`` is the same exchange with the experts replaced
by a copy: the communication there is to hide. Both schedules give the same results bit for
bit (``tests/test_moe_exchange.py``); the last column checks it on the bench's own tensors.

Two shapes per D: ``compute`` (F = 4h: the experts' GEMMs dwarf the transfers) and ``comm``
(F = h/4: about as much time moving rows as multiplying them on this machine).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

from tspc.launch import spawn


def _step(x, ids, w1, w2, experts, rank, world, group, tag) -> tuple[torch.Tensor, ...]:
    """One layer's experts forward and backward: the outputs and the three gradients."""
    from tspc.runtime.moe import moe_experts

    xs, a, b = (t.detach().requires_grad_() for t in (x, w1, w2))
    out = moe_experts(xs, ids, a, b, "plain:silu", "tt", experts, x.dtype, rank, world, group, tag)
    out.square().sum().backward()
    return out.detach(), xs.grad, a.grad, b.grad


def _exchange_only(x, ids, experts, rank, world, group) -> None:
    """The transfers of ``_step`` with the experts replaced by a copy: the dispatch and combine
    of the forward and of the backward (which sends the rows again, and their gradients)."""
    from tspc.runtime.group import process_group
    from tspc.runtime.moe import _Plan
    from tspc.runtime.moe_exchange import exchange_then_compute

    pg = process_group(group)
    plan = _Plan(ids, experts, world, rank, pg, "exchange")
    src = x[plan.order // (ids.numel() // x.shape[0])]
    for sent in ([src], [src, src]):
        exchange_then_compute(
            sent, plan.routing, lambda parts, s: parts[0].clone(), *x.shape[1:], x.dtype
        )


MODES = ("all_to_all", "pipelined", "exchange")


class _Blocked:
    """Seconds this rank spends blocked on the exchange's communication: inside a (blocking)
    ``all_to_all_single`` or waiting for point-to-point transfers — the exposed part."""

    def __init__(self):
        import torch.distributed as dist

        from tspc.runtime import moe_exchange

        self.seconds = 0.0
        for owner, name in ((dist, "all_to_all_single"), (moe_exchange, "wait_works")):
            setattr(owner, name, self._timed(getattr(owner, name)))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed


def bench_worker(rank: int, world: int, shapes: list[tuple], iters: int) -> list[dict]:
    import torch.distributed as dist

    from tspc.runtime import moe_exchange
    from tspc.runtime.group import resolve_group

    group = resolve_group().name
    torch.set_num_threads(1)
    blocked = _Blocked()
    rows = []
    for name, n, h, f, experts, k in shapes:
        gen = torch.Generator().manual_seed(1 + rank)
        x = torch.randn(n, h, generator=gen)
        ids = torch.rand(n, experts, generator=gen).topk(k, dim=1).indices.reshape(-1)
        c = -(-experts // world)
        shared = torch.Generator().manual_seed(0)  # the same experts on every rank
        w1 = torch.randn(experts, f, h, generator=shared)[rank * c : (rank + 1) * c] / h**0.5
        w2 = torch.randn(experts, h, f, generator=shared)[rank * c : (rank + 1) * c] / f**0.5
        times: dict[str, list[float]] = {m: [] for m in MODES}
        waits: dict[str, list[float]] = {m: [] for m in MODES}
        results = {}
        for it in range(iters + 1):  # the first round is a warm-up
            for mode in MODES:
                moe_exchange.SETTINGS.pipelined = mode == "pipelined"
                dist.barrier()
                blocked.seconds = 0.0
                t0 = time.perf_counter()
                if mode == "exchange":
                    _exchange_only(x, ids, experts, rank, world, group)
                else:
                    results[mode] = _step(x, ids, w1, w2, experts, rank, world, group, name)
                took = torch.tensor([time.perf_counter() - t0, blocked.seconds])
                dist.all_reduce(took, op=dist.ReduceOp.MAX)
                if it:
                    times[mode].append(float(took[0]))
                    waits[mode].append(float(took[1]))
        moe_exchange.SETTINGS.pipelined = True
        same = all(map(torch.equal, results["all_to_all"], results["pipelined"]))
        same_t = torch.tensor([int(same)])
        dist.all_reduce(same_t, op=dist.ReduceOp.MIN)
        medians = {m: statistics.median(v) * 1e3 for m, v in times.items()}
        medians.update({f"{m}_blocked": statistics.median(waits[m]) * 1e3 for m in MODES[:2]})
        rows.append({"D": world, "shape": name, "n": n, "h": h, "f": f, "E": experts, "k": k})
        rows[-1].update(medians, same=bool(same_t))
    return rows


def shapes_for(quick: bool) -> list[tuple]:
    """(name, tokens per rank, h, F, E, k)."""
    if quick:
        return [("compute", 64, 32, 128, 4, 2), ("comm", 64, 32, 8, 4, 2)]
    return [("compute", 1024, 256, 1024, 8, 2), ("comm", 1024, 512, 128, 8, 2)]


def format_table(rows: list[dict]) -> str:
    head = (
        "| D | shape | N/rank | h | F | E | k | exchange alone ms | all-to-all ms (blocked) "
        "| pipelined ms (blocked) | speed-up | equal |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        lines.append(
            f"| {r['D']} | {r['shape']} | {r['n']} | {r['h']} | {r['f']} | {r['E']} | {r['k']} "
            f"| {r['exchange']:.1f} | {r['all_to_all']:.1f} ({r['all_to_all_blocked']:.1f}) "
            f"| {r['pipelined']:.1f} ({r['pipelined_blocked']:.1f}) "
            f"| {r['all_to_all'] / r['pipelined']:.2f}x | {'yes' if r['same'] else 'NO'} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny shapes (a smoke run)")
    p.add_argument("--iters", type=int, default=None, help="timed steps per schedule")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    args = p.parse_args(argv)
    iters = args.iters or (3 if args.quick else 15)
    rows = []
    for world in args.worlds:
        rows += spawn(bench_worker, world, shapes_for(args.quick), iters, timeout=1800)[0]
    print(format_table(rows))
    return 0 if all(r["same"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
