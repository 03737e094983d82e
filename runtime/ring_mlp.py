"""The gated MLP as a ring of weight shards: D steps, D-1 point-to-point hops, no all-reduce.

Rank p starts with shard p of the intermediate dimension: rows of W_gate and W_up (and their
biases) and columns of W_down, packed into one flat buffer so a hop is a single transfer. At
step t it holds shard (p - t) mod D and accumulates

    y += (act(x W_gate^s + b_gate^s) * (x W_up^s + b_up^s)) W_down^s

while the hop for step t+1 (send the shard to p+1, receive the next from p-1) is already in
flight. The tokens never move and every rank ends with its own tokens' full output.

Backward runs the ring the other way (send to p-1, receive from p+1), re-streaming the weights
instead of keeping the D-1 received shards alive from the forward: at backward step k rank p
handles shard p+1+k; it receives that shard's weights and the gradient accumulated so far by the
ranks that handled it before, adds its own tokens' contribution, and passes both on. After D
steps every accumulator has visited every rank and sits at its owner. Hops: D-1 for weights
(the last step uses the local shard) and D-1 for gradients, the
(D-1)/D * (beta + beta_grad) * P_mlp of PAPER_NOTES.

This is one ``autograd.Function`` (its forward and backward are fixed algorithms), written with
explicit ``tspc::ring_start``/``ring_wait`` ops and plain tensor compute, so aot_autograd traces
both directions into graphs where every hop is a visible node and the compute can be compiled.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .comm import ring_hop
from .packing import pack, unpack

# Activations the ring supports, with their derivative (grad, pre-activation) -> grad.
_ACT = {
    "silu": (F.silu, lambda g, a: torch.ops.aten.silu_backward(g, a)),
    "gelu": (F.gelu, lambda g, a: torch.ops.aten.gelu_backward(g, a)),
    "gelu_tanh": (
        lambda a: F.gelu(a, approximate="tanh"),
        lambda g, a: torch.ops.aten.gelu_backward(g, a, approximate="tanh"),
    ),
    "relu": (F.relu, lambda g, a: torch.ops.aten.threshold_backward(g, a, 0)),
    "sigmoid": (torch.sigmoid, lambda g, a: g * torch.sigmoid(a) * (1 - torch.sigmoid(a))),
    "tanh": (torch.tanh, lambda g, a: g * (1 - torch.tanh(a) ** 2)),
}
SUPPORTED_ACTIVATIONS = tuple(_ACT)


def _step_forward(x, w_gate, w_up, w_down, b_gate, b_up, act):
    a = F.linear(x, w_gate, b_gate)
    u = F.linear(x, w_up, b_up)
    return a, u, F.linear(_ACT[act][0](a) * u, w_down)


class RingMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, b_gate, b_up, act, rank, world, group, tag):
        has_bias = b_gate is not None
        shards = [w_gate, w_up, w_down] + ([b_gate, b_up] if has_bias else [])
        shapes = [t.shape for t in shards]
        own = pack(shards) if world > 1 else None
        cur = own
        y = None
        saved = []
        for t in range(world):
            nxt = None
            if t < world - 1:
                # Issue the next hop before this step's compute: it travels while we compute.
                nxt = torch.ops.tspc.ring_start(cur, 1, group, world, tag)
            if world > 1:
                ws = unpack(cur, shapes)
                wg, wu, wd = ws[:3]
                bg, bu = (ws[3], ws[4]) if has_bias else (None, None)
            else:
                wg, wu, wd, bg, bu = w_gate, w_up, w_down, b_gate, b_up
            a, u, part = _step_forward(x, wg, wu, wd, bg, bu, act)
            saved += [a, u]
            y = part if y is None else y + part
            if nxt is not None:
                cur = torch.ops.tspc.ring_wait(nxt, cur, 1, group, world, tag)
        ctx.save_for_backward(x, *shards, *saved)
        ctx.meta = (len(shards), shapes, has_bias, act, rank, world, group, tag)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        n_shards, shapes, has_bias, act, rank, world, group, tag = ctx.meta
        x, *rest = ctx.saved_tensors
        shards, saved = rest[:n_shards], rest[n_shards:]
        act_fn, act_grad = _ACT[act]
        x2 = x.reshape(-1, x.shape[-1])
        g2 = grad_y.reshape(-1, grad_y.shape[-1])
        own = pack(shards) if world > 1 else None
        # Backward step k handles forward step t = D-1-k, i.e. shard p+1+k. Its weights come
        # from p+1 (shift -1); the last step's shard is our own.
        if world > 1:
            w_cur = torch.ops.tspc.ring_wait(
                torch.ops.tspc.ring_start(own, -1, group, world, tag), own, -1, group, world, tag
            )
        acc_in = None  # handle of the accumulator arriving from p+1
        acc_out = None
        dx = None
        grad_own = None
        for k in range(world):
            t = world - 1 - k
            last = k == world - 1
            w_next = None
            if world > 1 and k < world - 2:
                w_next = torch.ops.tspc.ring_start(w_cur, -1, group, world, tag)
            # The last step's shard is our own: read the saved shards themselves, so the packed
            # copy ``own`` dies once its first hop has gone (not at the end of the ring).
            ws = unpack(w_cur, shapes) if world > 1 and not last else list(shards)
            wg, wu, wd = ws[:3]
            a, u = saved[2 * t], saved[2 * t + 1]
            a2 = a.reshape(-1, a.shape[-1])
            u2 = u.reshape(-1, u.shape[-1])
            act_a = act_fn(a2)
            h = act_a * u2
            # This step's weight gradients, each added to the accumulator arriving from p+1 as
            # soon as it is computed: the received buffer and each piece die at once, so at
            # most one packed gradient exists besides the one in flight (computing all pieces
            # first would also hold them, the received accumulator and the one being sent).
            # Accumulators travel in fp32 when the weights are 16-bit: a shard's gradient is a
            # sum over every rank's tokens and would round at each hop otherwise.
            received = None
            if acc_in is not None:
                wait = torch.ops.tspc.ring_wait(acc_in, acc_out, -1, group, world, tag)
                received = unpack(wait, shapes)

            def accumulate(i: int, g: torch.Tensor, received=received) -> torch.Tensor:
                if world == 1:
                    return g
                return g.float() if received is None else g.float() + received[i]

            dh = g2 @ wd  # [N, F/D]
            d_wd = accumulate(2, g2.t() @ h)  # [h, F/D]
            da = act_grad(dh * u2, a2)
            du = dh * act_a
            d_wg = accumulate(0, da.t() @ x2)
            d_wu = accumulate(1, du.t() @ x2)
            step_dx = da @ wg + du @ wu
            dx = step_dx if dx is None else dx + step_dx
            grads = [d_wg, d_wu, d_wd]
            if has_bias:
                grads += [accumulate(3, da.sum(0)), accumulate(4, du.sum(0))]
            if world == 1:
                grad_own = grads
                break
            local = pack(grads)
            if last:
                grad_own = [g.to(sh.dtype) for g, sh in zip(unpack(local, shapes), shards)]
            else:
                acc_out = local
                acc_in = torch.ops.tspc.ring_start(acc_out, -1, group, world, tag)
            if w_next is not None:
                w_cur = torch.ops.tspc.ring_wait(w_next, w_cur, -1, group, world, tag)
        dx = dx.reshape(x.shape)
        g = list(grad_own)
        b_grads = (g[3], g[4]) if has_bias else (None, None)
        return dx, g[0], g[1], g[2], *b_grads, None, None, None, None, None


def ring_mlp(
    x: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    b_gate: torch.Tensor | None,
    b_up: torch.Tensor | None,
    act: str,
    rank: int,
    world: int,
    group: str,
    tag: str,
) -> torch.Tensor:
    """``down(act(gate(x)) * up(x))`` over the ring; the shards are this rank's own."""
    if act not in _ACT:
        raise ValueError(f"activation {act!r} is not supported by the MLP ring")
    return RingMLP.apply(x, w_gate, w_up, w_down, b_gate, b_up, act, rank, world, group, tag)


__all__ = ["ring_mlp", "RingMLP", "SUPPORTED_ACTIVATIONS", "ring_hop"]
