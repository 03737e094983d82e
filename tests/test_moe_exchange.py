"""The pipelined expert-parallel exchange (``runtime/moe_exchange.py``) on gloo ranks.

Each rank sends rows to every rank (counts drawn at random, zeros included: a rank that sends
nothing, one that receives nothing, everything to one owner); the owner runs a function that
depends on its own rank and on the source, so each result says where it was computed and for
whom. Checked against what the rank can compute alone (``rows * (owner + 1) + source``), and
bit for bit against the unpipelined all-to-all version; the counted bytes against the counts.
A point-to-point message of another size on tag 0 (what a ring hop of the MLP is) stays in
flight across the exchange and arrives intact: the exchange's messages carry their own tags.
"""

from __future__ import annotations

import pytest
import torch

from tspc.launch import spawn


def _counts(world: int, case: int, gen: torch.Generator) -> list[list[int]]:
    """``counts[s][q]``: rows rank s sends rank q."""
    if case == 0:  # random, zeros likely
        return torch.randint(0, 4, (world, world), generator=gen).tolist()
    if case == 1:  # everything to the last rank
        return [[0] * (world - 1) + [5] for _ in range(world)]
    if case == 2:  # rank 0 sends nothing, and nobody sends rank 1 anything
        c = torch.randint(1, 4, (world, world), generator=gen)
        c[0] = 0
        c[:, 1 % world] = 0
        return c.tolist()
    return [[0] * world for _ in range(world)]  # an empty call


def exchange_worker(rank: int, world: int) -> list[str]:
    import torch.distributed as dist

    from tspc.runtime.counters import COUNTER
    from tspc.runtime.moe_exchange import SETTINGS, Routing, exchange_and_compute

    group = dist.group.WORLD
    problems: list[str] = []
    shared = torch.Generator().manual_seed(7)  # the counts: the same on every rank
    gen = torch.Generator().manual_seed(rank)
    for case in range(4):
        for dtype in (torch.float32, torch.float64):
            counts = _counts(world, case, shared)
            send = counts[rank]
            recv = [counts[s][rank] for s in range(world)]
            n = sum(send)
            rows = torch.randn(n, 5, generator=gen, dtype=dtype) + rank
            extra = torch.randn(n, 3, generator=gen, dtype=dtype)

            def compute(parts, source):
                a, b = parts
                return a * (rank + 1) + source + b.sum(1, keepdim=True)

            # a ring hop's message (tag 0, another size) in flight across the exchange
            peer_to, peer_from = (rank + 1) % world, (rank - 1) % world
            hop = torch.full((7,), float(rank))
            hop_in = torch.empty(7)
            hop_works = []
            if world > 1:
                hop_works = dist.batch_isend_irecv(
                    [
                        dist.P2POp(dist.isend, hop, group=group, group_peer=peer_to),
                        dist.P2POp(dist.irecv, hop_in, group=group, group_peer=peer_from),
                    ]
                )
            outs = {}
            for pipelined in (True, False):
                SETTINGS.pipelined = pipelined
                COUNTER.reset()
                route = Routing(send, recv, rank, group, f"t{case}")
                outs[pipelined] = exchange_and_compute([rows, extra], route, compute, 5, dtype)
                got = COUNTER.total_recv()
                # the rows (5 + 3 values) others send this rank, and its own rows' results
                want = 0
                if world > 1:
                    want = (sum(recv) - recv[rank]) * 8 + (n - send[rank]) * 5
                if got != want * dtype.itemsize:
                    problems.append(f"case {case} {dtype}: bytes {got} != {want}")
            SETTINGS.pipelined = True
            for w in hop_works:
                w.wait()
            if world > 1 and not torch.equal(hop_in, torch.full((7,), float(peer_from))):
                problems.append(f"case {case}: the tag-0 message was taken or changed")
            # what each owner q computes for this rank's rows (they are grouped by owner)
            owner = torch.repeat_interleave(torch.arange(world), torch.tensor(send))
            want = rows * (owner[:, None] + 1).to(dtype) + rank + extra.sum(1, keepdim=True)
            if not torch.equal(outs[True], want):
                problems.append(f"case {case} {dtype}: pipelined result wrong")
            if not torch.equal(outs[True], outs[False]):
                problems.append(f"case {case} {dtype}: pipelined != all-to-all")
            if outs[True].dtype != dtype:
                problems.append(f"case {case}: dtype {outs[True].dtype}")
    return problems


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_pipelined_exchange_equals_all_to_all_and_what_owners_compute(world):
    assert spawn(exchange_worker, world, timeout=300) == [[]] * world
