"""The expert-parallel exchange, pipelined: each peer's rows run through the experts as they
arrive, and their results leave as soon as they are done.

A dispatch all-to-all, then the experts, then a combine all-to-all leaves the network idle
while the experts run and the experts idle while the network runs. Here the same transfers
are cut by peer into D - 1 steps of a ring shift (the pairwise exchange): at step j rank p
sends its rows for rank ``p + j`` and receives those of rank ``p - j``, and later sends rank
``p - j`` its results and receives its own rows' results from ``p + j``. On rank p:

1. every step's dispatch is posted at once (the counts exchanged before say how many rows
   each message has), and while they travel p runs its experts on its *own* rows for its own
   experts, which need no transfer;
2. step by step (j = 1 .. D-1), p waits for the rows of rank ``p - j``, runs them, and posts
   their results back together with the receive of its own rows' results from ``p + j``
   (who runs them at the same step) — so later steps' rows keep arriving, and earlier steps'
   results keep leaving, while p computes;
3. last, it waits for its results.

Each step's sends and receives are one ``batch_isend_irecv``: a send and a receive between the
same two ranks in one batch is what NCCL needs not to deadlock (its point-to-point calls block
their stream until the peer's matching call). The messages carry their own tags, so that a
ring hop in flight on the same group (tag 0) never takes one of them (gloo matches by tag;
NCCL by the order of calls, which is the same program order on every rank). Only the first
step's arrival and the last step's results are exposed; the bytes are those of the two
all-to-alls, counted the same way (``moe.moe_bytes``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch
import torch.distributed as dist

from .comm import wait_works
from .counters import COUNTER

# Tags of the exchange's messages: the dispatch of each row tensor (base + its index), then
# the results. Far from 0, the tag of the ring hops.
_DISPATCH_TAG = 0x4D4F0
_COMBINE_TAG = 0x4D4EF


@dataclass
class _Settings:
    # False: the unpipelined reference (``exchange_then_compute``), for benchmarks and tests.
    pipelined: bool = True


SETTINGS = _Settings()


def _bounds(counts: list[int]) -> list[int]:
    return [0, *accumulate(counts)]


def _row_bytes(t: torch.Tensor) -> int:
    """Bytes of one row, also of a tensor with no rows (where ``numel() / rows`` is 0)."""
    return t.shape[1:].numel() * t.element_size()


@dataclass(frozen=True)
class Routing:
    """Who sends whom how many rows in one exchange, on which group, counted under ``tag``."""

    send: list[int]  # send[q]: rows this rank sends rank q (its rows are grouped by q)
    recv: list[int]  # recv[s]: rows rank s sends this rank
    rank: int
    group: Any  # the c10d ProcessGroup (None with one rank)
    tag: str


Compute = Callable[[list[torch.Tensor], int], torch.Tensor]


def exchange_and_compute(
    rows: list[torch.Tensor], route: Routing, compute: Compute, width: int, dtype: torch.dtype
) -> torch.Tensor:
    """Send each rank's rows to it, run ``compute`` on what arrives, send the results back
    (pipelined, as the module docstring says; ``SETTINGS.pipelined = False``: as
    ``exchange_then_compute``).

    ``rows``: tensors with the same number of rows, grouped by destination (``route.send[q]``
    rows for rank q, rank order). ``compute(parts, s)`` returns the results ``[recv[s],
    width]`` of ``dtype`` for ``parts`` (each tensor's rows from rank s). Returns the results
    of this rank's rows, in the order of ``rows``."""
    send, recv, rank, group, tag = route.send, route.recv, route.rank, route.group, route.tag
    world = len(send)
    if world > 1 and not SETTINGS.pipelined:
        return exchange_then_compute(rows, route, compute, width, dtype)
    send_at = _bounds(send)
    out = rows[0].new_empty((send_at[-1], width), dtype=dtype)

    def mine(t: torch.Tensor, q: int) -> torch.Tensor:
        return t[send_at[q] : send_at[q + 1]]

    on_cpu = out.device.type == "cpu"
    steps = range(1, world)
    inbox: dict[int, list[torch.Tensor]] = {}
    arrivals: dict[int, list] = {}
    keep: list[torch.Tensor] = []  # what is being sent, alive until its send is waited
    sends: list = []
    for j in steps:
        to, frm = (rank + j) % world, (rank - j) % world
        ops = []
        for i, t in enumerate(rows):
            if send[to]:
                keep.append(mine(t, to).contiguous())
                ops.append(
                    dist.P2POp(
                        dist.isend, keep[-1], group=group, group_peer=to, tag=_DISPATCH_TAG + i
                    )
                )
            if recv[frm]:
                inbox.setdefault(frm, []).append(t.new_empty((recv[frm], *t.shape[1:])))
                ops.append(
                    dist.P2POp(
                        dist.irecv,
                        inbox[frm][-1],
                        group=group,
                        group_peer=frm,
                        tag=_DISPATCH_TAG + i,
                    )
                )
        works = dist.batch_isend_irecv(ops) if ops else []
        arrivals[frm] = [w for w, op in zip(works, ops) if op.op is dist.irecv]
        sends += [w for w, op in zip(works, ops) if op.op is dist.isend]

    if send[rank]:  # this rank's own rows for its own experts: no transfer
        out[send_at[rank] : send_at[rank + 1]] = compute([mine(t, rank) for t in rows], rank)

    results: list = []
    for j in steps:
        to, frm = (rank - j) % world, (rank + j) % world  # results go back the other way
        ops = []
        if recv[to]:
            wait_works(arrivals[to], "all_to_all", tag, on_cpu)
            keep.append(compute(inbox.pop(to), to).to(dtype).contiguous())
            ops.append(
                dist.P2POp(dist.isend, keep[-1], group=group, group_peer=to, tag=_COMBINE_TAG)
            )
        if send[frm]:
            ops.append(
                dist.P2POp(
                    dist.irecv, mine(out, frm), group=group, group_peer=frm, tag=_COMBINE_TAG
                )
            )
        results += dist.batch_isend_irecv(ops) if ops else []
    wait_works(results + sends, "all_to_all", tag, on_cpu)

    if world > 1:
        _count(rows, out, route)
    return out


def exchange_then_compute(
    rows: list[torch.Tensor], route: Routing, compute: Compute, width: int, dtype: torch.dtype
) -> torch.Tensor:
    """``exchange_and_compute`` unpipelined: one all-to-all per row tensor, ``compute`` per
    source, one all-to-all back. The same results, bit for bit (``compute`` sees the same
    parts in the same order of sources, so sums over them round alike); the baseline that
    ``bench/moe_overlap.py`` times the pipeline against."""
    send, recv, rank, group = route.send, route.recv, route.rank, route.group
    send_at, recv_at = _bounds(send), _bounds(recv)
    arrived = []
    for t in rows:
        buf = t.new_empty((recv_at[-1], *t.shape[1:]))
        dist.all_to_all_single(buf, t.contiguous(), recv, send, group=group)
        arrived.append(buf)
    done = arrived[0].new_empty((recv_at[-1], width), dtype=dtype)
    world = len(send)
    for s in [rank, *((rank - j) % world for j in range(1, world))]:  # the pipeline's order
        if recv[s]:
            part = [a[recv_at[s] : recv_at[s + 1]] for a in arrived]
            done[recv_at[s] : recv_at[s + 1]] = compute(part, s)
    out = done.new_empty((send_at[-1], width))
    dist.all_to_all_single(out, done, send, recv, group=group)
    _count(rows, out, route)
    return out


def _count(rows: list[torch.Tensor], out: torch.Tensor, route: Routing) -> None:
    """One ``all_to_all`` record per row tensor sent and one for the results, by the bytes
    that leave and reach this rank (its own rows never travel)."""
    send, recv, rank, tag = route.send, route.recv, route.rank, route.tag
    others_sent = sum(send) - send[rank]
    others_recv = sum(recv) - recv[rank]
    for t in rows:
        row = _row_bytes(t)
        COUNTER.record("all_to_all", tag, recv=others_recv * row, sent=others_sent * row)
    row = _row_bytes(out)
    COUNTER.record("all_to_all", tag, recv=others_sent * row, sent=others_recv * row)
