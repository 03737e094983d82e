"""Mixture-of-experts experts on the TSP axis: expert parallelism by all-to-all, exact.

Each rank holds 1/D of the tokens (the sequence is sharded) and ``experts_per_rank(E, D)``
experts: rank r owns experts ``[r c, min((r + 1) c, E))`` with ``c = ceil(E / D)`` — the chunks
``torch.chunk`` cuts, so the stacked expert weights are a ``Shard(0)`` DTensor (uneven when D
does not divide E: the last ranks own fewer experts, possibly none).

``moe_experts(x, ids, w1, w2, ...)`` returns, for each (token, choice) pair of this rank's
tokens (``ids`` is the flat ``[N k]`` expert id of every pair, token-major), the output of the
chosen expert on that token: ``[N k, h]``. The graph combines it with the router weights itself
(``(out * weights[:, None]).view(N, k, h).sum(1)``), so the router weights' gradient is
autograd's. Per call:

1. the pairs are sorted by expert (so by owner), and every rank sends every other the number
   of its pairs per expert that rank owns (an all-to-all of ``c`` int64 per rank);
2. each pair's hidden state goes to the expert's owner;
3. the owner runs each of its experts on the rows it received for it:
   ``w2_e(chain(w1_e(x)))`` (``chain``: the activation the model applies between the two
   stacked matmuls, copied from its graph);
4. the results go back and are put back into pair order.

Steps 2-4 are one exchange pipelined with the experts, peer by peer
(``moe_exchange.exchange_and_compute``): the bytes of a dispatch and a combine all-to-all,
with the experts running while the other peers' rows and results travel.

No pair is dropped or capped, so the result equals one process. Backward sends each pair's
hidden state and output gradient to the owner again (two all-to-alls: nothing of data-dependent
size is saved between forward and backward), the owner takes the gradient of its experts
(``torch.func.vjp``; weight gradients land on its own expert shards only), and the inputs'
gradients come back — the same pipelined exchange.

Bytes: every all-to-all is counted in ``COUNTER`` under the layer's tag as ``all_to_all``, by the
bytes each rank really receives from and sends to the others (``moe_bytes`` is the formula the
tests hold it against). ``LOAD[tag]`` keeps the rows this rank computed in the last call, for
the load-imbalance report.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import accumulate

import torch
import torch.distributed as dist

from .counters import COUNTER
from .group import process_group
from .moe_exchange import Routing, exchange_and_compute
from .ring_mlp import chain_of

LOAD: dict[str, int] = {}
"""tag -> the (token, choice) rows this rank ran through its experts in the layer's last
forward (``moe_load`` gathers it over the ranks: the load imbalance, ``max / mean``)."""
_LOAD_GROUP: dict[str, str] = {}  # tag -> the TSP group's name the layer ran on


def experts_per_rank(experts: int, world: int) -> int:
    """``c``: the experts rank r owns are ``[r c, min((r + 1) c, E))``."""
    return -(-experts // world)


def owned_experts(experts: int, world: int, rank: int) -> range:
    c = experts_per_rank(experts, world)
    return range(min(rank * c, experts), min((rank + 1) * c, experts))


def _project(x: torch.Tensor, w: torch.Tensor, transposed: bool) -> torch.Tensor:
    """``x @ w^T`` for a weight stored ``[out, in]`` (``transposed``, as ``F.linear``), else
    ``x @ w``."""
    return x @ w.t() if transposed else x @ w


def _expert_forward(chain: Callable, orient: str, x, w1, w2) -> torch.Tensor:
    return _project(chain(_project(x.to(w1.dtype), w1, orient[0] == "t")), w2, orient[1] == "t")


class _Plan:
    """Where this rank's pairs go, and how many rows each rank sends to each other."""

    def __init__(self, ids: torch.Tensor, experts: int, world: int, rank: int, group, tag: str):
        c = experts_per_rank(experts, world)
        ids = ids.reshape(-1).long()
        self.order = torch.argsort(ids, stable=True)  # pairs grouped by expert, so by owner
        per_expert = torch.bincount(ids, minlength=world * c)  # padded to D c experts
        self.send_counts = per_expert.view(world, c).sum(1).tolist()
        recv = per_expert.clone()
        if world > 1:
            dist.all_to_all_single(recv, per_expert, group=group)
            # c int64 counts from each of the D - 1 others (D = 2 hid a count of one peer's)
            _count_counts(tag, (world - 1) * c * 8)
        self.recv_per_expert = recv.view(world, c)  # [source rank, my local expert]
        self.recv_counts = self.recv_per_expert.sum(1).tolist()
        self._recv_at = [0, *accumulate(self.recv_counts)]
        # the local expert of every received row: rows come by source rank, then by expert
        self.local_expert = torch.repeat_interleave(
            torch.arange(c, device=ids.device).repeat(world), self.recv_per_expert.reshape(-1)
        )
        self.owned = len(owned_experts(experts, world, rank))
        self.routing = Routing(self.send_counts, self.recv_counts, rank, group, tag)

    def experts_of(self, source: int) -> torch.Tensor:
        """The local expert of each row rank ``source`` sends this rank, in its order."""
        return self.local_expert[self._recv_at[source] : self._recv_at[source + 1]]


def _count_counts(tag: str, nbytes: int) -> None:
    """The counts exchange, as many bytes each way (the rows' exchange counts itself:
    ``moe_exchange``)."""
    COUNTER.record("all_to_all", tag, recv=nbytes, sent=nbytes)


def rows_by_expert(local_expert: torch.Tensor, owned: int):
    """(expert, the indices of its rows) for each local expert that has rows."""
    for e in range(owned):
        sel = (local_expert == e).nonzero().squeeze(1)
        if sel.numel():
            yield e, sel


@torch.library.custom_op("tspc::moe_experts", mutates_args=())
def moe_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    chain: str,
    orient: str,
    experts: int,
    out_dtype: torch.dtype,
    rank: int,
    world: int,
    group: str,
    tag: str,
) -> torch.Tensor:
    """Every pair's expert output, ``[N k, h]`` in pair order (module docstring)."""
    fn = chain_of(chain)
    pg = process_group(group) if world > 1 else None
    plan = _Plan(ids, experts, world, rank, pg, tag)
    LOAD[tag] = int(sum(plan.recv_counts))
    _LOAD_GROUP[tag] = group
    k = ids.numel() // max(x.shape[0], 1)
    src = x.reshape(x.shape[0], -1)[plan.order // k]
    h = x.shape[-1]

    def run(parts: list[torch.Tensor], source: int) -> torch.Tensor:
        rows = parts[0]
        done = rows.new_zeros((rows.shape[0], h), dtype=out_dtype)
        for e, sel in rows_by_expert(plan.experts_of(source), plan.owned):
            done[sel] = _expert_forward(fn, orient, rows[sel], w1[e], w2[e]).to(out_dtype)
        return done

    back = exchange_and_compute([src], plan.routing, run, h, out_dtype)
    out = torch.empty_like(back)
    out[plan.order] = back
    return out


@moe_experts.register_fake
def _(x, ids, w1, w2, chain, orient, experts, out_dtype, rank, world, group, tag):
    return x.new_empty((ids.numel(), x.shape[-1]), dtype=out_dtype)


@torch.library.custom_op("tspc::moe_experts_backward", mutates_args=())
def moe_experts_backward(
    grad: torch.Tensor,
    x: torch.Tensor,
    ids: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    chain: str,
    orient: str,
    experts: int,
    rank: int,
    world: int,
    group: str,
    tag: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of ``x``, ``w1`` and ``w2`` (this rank's experts) for ``grad``, the
    gradient of ``moe_experts``' output."""
    fn = chain_of(chain)
    pg = process_group(group) if world > 1 else None
    plan = _Plan(ids, experts, world, rank, pg, tag)
    k = ids.numel() // max(x.shape[0], 1)
    n, h = x.shape[0], x.shape[-1]
    gw1, gw2 = torch.zeros_like(w1), torch.zeros_like(w2)

    def run(parts: list[torch.Tensor], source: int) -> torch.Tensor:
        rows, g_rows = parts
        g_in = rows.new_zeros(rows.shape, dtype=x.dtype)
        for e, sel in rows_by_expert(plan.experts_of(source), plan.owned):
            # torch.func's vjp: autograd's own dispatch is off inside a custom op's kernel
            y, vjp = torch.func.vjp(
                lambda xe, a, b: _expert_forward(fn, orient, xe, a, b), rows[sel], w1[e], w2[e]
            )
            gx, ga, gb = vjp(g_rows[sel].to(y.dtype))
            g_in[sel] = gx.to(x.dtype)
            gw1[e] += ga
            gw2[e] += gb
        return g_in

    sent = [x.reshape(n, -1)[plan.order // k], grad[plan.order]]
    back = exchange_and_compute(sent, plan.routing, run, h, x.dtype)
    gx_out = torch.zeros((n, h), dtype=x.dtype, device=x.device)
    gx_out.index_add_(0, plan.order // k, back)
    return gx_out.reshape(x.shape), gw1, gw2


@moe_experts_backward.register_fake
def _(grad, x, ids, w1, w2, chain, orient, experts, rank, world, group, tag):
    return torch.empty_like(x), torch.empty_like(w1), torch.empty_like(w2)


def _setup(ctx, inputs, output):
    x, ids, w1, w2, chain, orient, experts, _dtype, rank, world, group, tag = inputs
    ctx.save_for_backward(x, ids, w1, w2)
    ctx.args = (chain, orient, experts, rank, world, group, tag)


def _backward(ctx, grad):
    x, ids, w1, w2 = ctx.saved_tensors
    gx, gw1, gw2 = moe_experts_backward(grad, x, ids, w1, w2, *ctx.args)
    return gx, None, gw1, gw2, None, None, None, None, None, None, None, None


torch.library.register_autograd("tspc::moe_experts", _backward, setup_context=_setup)


def moe_bytes(
    pairs_to: list[list[int]], rank: int, elem: int, hidden: int, experts: int, backward: bool
) -> int:
    """Bytes rank ``rank`` receives in one forward (and, with ``backward``, its backward) of
    one MoE layer: ``pairs_to[s][q]`` is the number of rank s's (token, choice) pairs whose
    expert rank q owns. Forward: the count exchange ((D-1) c int64), the rows others send it
    (``sum_s!=p pairs_to[s][p]`` hidden states) and the results of its own pairs computed
    elsewhere (``sum_q!=p pairs_to[p][q]``). Backward: the count exchange again, the hidden
    states and their output gradients again, and its pairs' input gradients."""
    world = len(pairs_to)
    if world == 1:
        return 0
    c = experts_per_rank(experts, world)
    counts = (world - 1) * c * 8
    inbound = sum(pairs_to[s][rank] for s in range(world) if s != rank) * hidden * elem
    outbound = sum(pairs_to[rank][q] for q in range(world) if q != rank) * hidden * elem
    fwd = counts + inbound + outbound
    return fwd + (counts + 2 * inbound + outbound if backward else 0)


def moe_load(report=None) -> dict[str, dict]:
    """Per expert-parallel MoE layer (tag), the (token, choice) pairs each rank's experts ran in
    the layer's last forward: ``{"pairs_per_rank", "max", "mean", "imbalance"}`` (``max /
    mean``). A collective over each layer's group: every rank calls it, after the same
    forwards. With ``report`` (``tspc.last_report()``), also written into its MoE entries
    (``details["load"]``, shown by its ``summary()``)."""
    out: dict[str, dict] = {}
    for tag in sorted(LOAD):
        world, group = 1, None
        if _LOAD_GROUP.get(tag) and dist.is_initialized():
            group = process_group(_LOAD_GROUP[tag])
            world = dist.get_world_size(group)
        mine = torch.tensor([LOAD[tag]], dtype=torch.int64)
        parts = [torch.zeros_like(mine) for _ in range(world)]
        if world > 1:
            dist.all_gather(parts, mine, group=group)
        else:
            parts = [mine]
        per_rank = [int(p.item()) for p in parts]
        mean = sum(per_rank) / len(per_rank)
        out[tag] = {
            "pairs_per_rank": per_rank,
            "max": max(per_rank),
            "mean": mean,
            "imbalance": max(per_rank) / mean if mean else 1.0,
        }
    for e in report.entries if report is not None else []:
        if e.module in out and e.details.get("form") == "moe (expert parallel)":
            e.details["load"] = out[e.module]
    return out
