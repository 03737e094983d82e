"""The MLP as a ring of weight shards: D steps, D-1 point-to-point hops, no all-reduce.

An MLP here is ``down(act(up_1(x), ..., up_k(x)))``: k projections of the same ``x`` into the
intermediate dimension F (k = 1 plain, k = 2 gated), an *elementwise* function ``act`` of them
(the activation chain, e.g. ``gelu(u)`` or ``silu(g) * u``), and a projection back. Because
``act`` is elementwise over F, the MLP is a sum over any partition of F:

    y = sum_s act(x W_1^s + b_1^s, ..., x W_k^s + b_k^s) W_down^s

Rank p starts with shard p of F: its slices of every up weight (and bias) and of W_down, packed
into one flat buffer so a hop is a single transfer. At step t it holds shard (p - t) mod D and
accumulates that shard's term while the hop for step t+1 (send the shard to p+1, receive the next
from p-1) is already in flight. The tokens never move and every rank ends with its own tokens'
full output.

Weights are Linear-shaped (``[out, in]``, ``F.linear``) or Conv1D-shaped (``[in, out]``, GPT-2's
``addmm(b, x, W)``); ``orient`` says which, one letter per up weight then down (``n`` / ``t``).

The activation chain is a callable registered under a key (``register_chain``): the rewrite
extracts it from the model's graph and the ring calls it on each shard's projections. Its
derivative is autograd's, taken locally per shard in backward (``torch.autograd.grad`` on the
saved projections), so any elementwise chain the matcher accepts is differentiated exactly.

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

import weakref
from collections.abc import Callable

import torch
import torch.nn.functional as F

from .comm import ring_hop
from .packing import pack, unpack
from .precision import upcast

_BUILTIN_CHAINS: dict[str, Callable[..., torch.Tensor]] = {}
# Chains the rewrites extract from a model's graph, held by the compiled graphs that call them
# (each one's ``RuntimeContext.chains``): an entry goes when the last graph holding it does.
_CHAINS: weakref.WeakValueDictionary[str, Callable[..., torch.Tensor]] = (
    weakref.WeakValueDictionary()
)


def register_chain(
    key: str, fn: Callable[..., torch.Tensor], owner: dict[str, Callable] | None = None
) -> str:
    """Make the elementwise function ``fn`` (of the k projections) callable by the ring as
    ``key``. The graph names the chain by key (a string) rather than holding the callable, so
    it stays printable and hashable; keys are derived from the chain's code, so a key names one
    function wherever it is registered. With ``owner`` (a compiled graph's
    ``RuntimeContext.chains``), the registration lasts as long as some owner holds it, and
    ``owner`` gets the function registered under ``key`` (the first one registered); without,
    it lasts as long as the process (hand-written schedules)."""
    if owner is None:
        _BUILTIN_CHAINS.setdefault(key, fn)
        return key
    registered = _registered(key)
    if registered is None:
        _CHAINS[key] = registered = fn
    owner[key] = registered
    return key


def _builtin(name: str, act: Callable[[torch.Tensor], torch.Tensor]) -> None:
    register_chain(f"plain:{name}", act)
    register_chain(f"gated:{name}", lambda g, u: act(g) * u)


# The common activations by name, for direct calls (tests, hand-written schedules).
for _name, _fn in {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_tanh": lambda a: F.gelu(a, approximate="tanh"),
    "relu": F.relu,
    "relu2": lambda a: F.relu(a).square(),
    "sigmoid": torch.sigmoid,
    "tanh": torch.tanh,
}.items():
    _builtin(_name, _fn)


def _registered(key: str) -> Callable[..., torch.Tensor] | None:
    fn = _BUILTIN_CHAINS.get(key)
    return fn if fn is not None else _CHAINS.get(key)


def chain_of(key: str) -> Callable[..., torch.Tensor]:
    fn = _registered(key)
    if fn is None:
        raise ValueError(f"activation chain {key!r} is not registered with the MLP ring")
    return fn


def _project(x2: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, t: bool) -> torch.Tensor:
    """``x2`` ([N, in]) through one up weight: ``[in, out]`` (t) or ``[out, in]``."""
    if t:
        return torch.addmm(b, x2, w) if b is not None else x2 @ w
    return F.linear(x2, w, b)


def _down(h: torch.Tensor, w: torch.Tensor, t: bool) -> torch.Tensor:
    return h @ w if t else F.linear(h, w)


class RingMLP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w_down, spec, rank, world, group, tag, *ins):
        shards = [*ins[: len(spec[2])], w_down, *ins[len(spec[2]) :]]  # ups, down, up biases
        y, saved = _ring_forward(x, shards, spec, world, group, tag)
        ctx.save_for_backward(x, *shards, *saved)
        ctx.meta = (len(shards), spec, world, group, tag)
        return y

    @staticmethod
    def backward(ctx, grad_y):
        n_shards, spec, world, group, tag = ctx.meta
        k = len(spec[2])
        x, *rest = ctx.saved_tensors
        shards, saved = rest[:n_shards], rest[n_shards:]
        x2 = x.reshape(-1, x.shape[-1])
        g2 = grad_y.reshape(-1, grad_y.shape[-1])
        dx, g = _ring_backward(x2, g2, shards, saved, spec, world, group, tag)
        return dx.reshape(x.shape), g[k], None, None, None, None, None, *g[:k], *g[k + 1 :]


# --------------------------------------------------------------------------- the hop loop
# Each shard travels as c chunks of its slice of F (each weight's and bias's F-columns j of c,
# packed per chunk; c = 1 by default: the whole shard in one hop). The MLP is a sum over any
# partition of F, so a chunk is computed on its own, and each chunk's hop is issued before that
# chunk's compute and waited right after it. With c > 1 (``hop_chunks``, sub-shard hops) the
# hops are ``ring_chunk_start``/``ring_chunk_wait``, which the overlap scheduler leaves in place,
# and a rank holds the chunks of the current shard not yet used plus the chunks of the next
# shard already received: about one shard and one chunk per stream (weights; in backward also
# the gradient accumulators) instead of two shards. Same bytes, c times the hops.


def _f_dims(orient: str, has_bias: tuple[bool, ...]) -> list[int]:
    """The F dimension of each shard tensor, in the ring's order (ups, down, up biases)."""
    k = len(has_bias)
    ups = [1 if orient[i] == "t" else 0 for i in range(k)]
    return [*ups, 0 if orient[k] == "t" else 1, *(0 for b in has_bias if b)]


def _chunk_bounds(shards, orient, has_bias, chunks: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` of each chunk of this rank's F-slice (the same on every rank: every shard
    has F/D columns). At most one chunk per column."""
    f = shards[len(has_bias)].shape[_f_dims(orient, has_bias)[len(has_bias)]]
    c = max(1, min(int(chunks), f))
    cuts = [f * j // c for j in range(c + 1)]
    return [(cuts[j], cuts[j + 1]) for j in range(c)]


def _chunk(tensors, dims, lo: int, hi: int, whole: bool) -> list[torch.Tensor]:
    if whole:  # the only chunk: the tensors themselves
        return list(tensors)
    return [t.narrow(d, lo, hi - lo) for t, d in zip(tensors, dims)]


class _Hops:
    """The chunks of this rank's shards and their hops in one direction (``shift``): whole
    shards through ``ring_start``/``ring_wait``, sub-shard chunks through the chunk ops."""

    def __init__(self, shards, spec, world: int, group: str, tag: str, shift: int):
        _, orient, has_bias, _, hop_chunks = spec
        self.dims = _f_dims(orient, has_bias)
        self.bounds = _chunk_bounds(shards, orient, has_bias, hop_chunks if world > 1 else 1)
        self.whole = len(self.bounds) == 1
        self.shards = shards
        self.shapes = [[t.shape for t in self.own(j)] for j in range(len(self.bounds))]
        ring = torch.ops.tspc
        self._start, self._wait = (
            (ring.ring_start, ring.ring_wait)
            if self.whole
            else (ring.ring_chunk_start, ring.ring_chunk_wait)
        )
        self.args = (shift, group, world, tag)

    def own(self, j: int) -> list[torch.Tensor]:
        """Chunk j of this rank's own shards (views)."""
        return _chunk(self.shards, self.dims, *self.bounds[j], self.whole)

    def unpack(self, buf: torch.Tensor, j: int) -> list[torch.Tensor]:
        return unpack(buf, self.shapes[j])

    def start(self, buf: torch.Tensor):
        return self._start(buf, *self.args), buf

    def land(self, pending) -> torch.Tensor:
        handle, buf = pending
        return self._wait(handle, buf, *self.args)


def _ring_forward(x2, shards, spec, world, group, tag):
    """Forward step t holds shard p - t; chunk j of it travels on to p+1 while it is used."""
    chain_key, orient, has_bias, save_projections, _ = spec
    chain = chain_of(chain_key)
    hops = _Hops(shards, spec, world, group, tag, 1)
    cur: list[torch.Tensor | None] = [None] * len(hops.bounds)  # this step's chunks, received
    y = None
    saved: list[torch.Tensor] = []
    for t in range(world):
        nxt: list[torch.Tensor | None] = [None] * len(hops.bounds)
        for j in range(len(hops.bounds)):
            if t == 0:  # our own shard: compute on its views, send a packed copy of the chunk
                ws = hops.own(j)
                buf = pack(ws) if world > 1 else None
            else:
                buf = cur[j]
                ws = hops.unpack(buf, j)
            # Issue the next hop before this chunk's compute: it travels while we compute.
            hop = hops.start(buf) if t < world - 1 else None
            part = _shard_output(
                x2, ws, chain, has_bias, orient, saved if save_projections else None
            )
            y = part if y is None else y + part
            if hop is not None:
                nxt[j] = hops.land(hop)
        cur = nxt
    return y, saved


def _ring_backward(x2, g2, shards, saved, spec, world, group, tag):
    """The ring the other way (send to p-1, receive from p+1), re-streaming the weights: at
    step s, chunk j, rank p forwards chunk j of shard p+1+s's weights (received at step s-1) to
    p-1 while it computes with it, then adds its contribution to that chunk's gradient
    accumulator (received from p+1) and sends it on to p-1. Each accumulator hop is waited when
    the next one is issued (one chunk of compute later; whole shards: before the next step's
    compute), each weight hop after its chunk's compute. The last step's shard is our own."""
    chain_key, orient, has_bias, save_projections, _ = spec
    k = len(has_bias)
    n_shards = len(shards)
    chain = chain_of(chain_key)
    hops = _Hops(shards, spec, world, group, tag, -1)
    n_chunks = len(hops.bounds)
    down_t = orient[k] == "t"
    # The first step's weights (shard p+1) come from p+1, a chunk at a time, one ahead.
    first = [None] * n_chunks
    if world > 1:
        first[0] = hops.start(pack(hops.own(0)))
    w_cur: list[torch.Tensor | None] = [None] * n_chunks
    acc: dict[tuple[int, int], torch.Tensor] = {}  # (step, chunk) -> accumulator received
    acc_pending = None  # (step, chunk, (handle, buffer)) of the accumulator hop in flight
    own: list[list[torch.Tensor]] = [[] for _ in range(n_shards)]  # final gradient chunks
    dx = None
    for step in range(world):
        t = world - 1 - step  # backward step s handles forward step t's shard
        last = step == world - 1
        w_next: list[torch.Tensor | None] = [None] * n_chunks
        for j in range(n_chunks):
            if step == 0 and world > 1:
                if j + 1 < n_chunks:
                    first[j + 1] = hops.start(pack(hops.own(j + 1)))
                w_cur[j] = hops.land(first[j])
                first[j] = None
            if last:  # our own shard: its views, so the packed copies die after their hops
                ws = hops.own(j)
                w_hop = None
            else:
                ws = list(hops.unpack(w_cur[j], j))
                w_hop = hops.start(w_cur[j]) if step < world - 2 else None
            # The chain's derivative: autograd's, on this shard's saved projections.
            if save_projections:
                at = k * (t * n_chunks + j)
                ps = saved[at : at + k]
            else:  # rebuilt from the weights this step received (the forward's shard t)
                ps = _projections(x2, ws, has_bias, orient)
            h, dps = _chain_backward(chain, ps, g2, ws[k], down_t)
            # This step's weight gradients, each added to the accumulator arriving from p+1 as
            # soon as it is computed: the received buffer and each piece die at once, so at
            # most one packed gradient exists besides the one in flight. Accumulators travel
            # in fp32 when the weights are 16-bit: a shard's gradient is a sum over every
            # rank's tokens and would round at each hop otherwise.
            received = None
            if step > 0:
                if (step, j) not in acc:  # the hop in flight is this chunk's: land it now
                    s_, j_, pending = acc_pending
                    acc[(s_, j_)] = hops.land(pending)
                    acc_pending = None
                received = hops.unpack(acc.pop((step, j)), j)

            def accumulate(i: int, g: torch.Tensor, received=received) -> torch.Tensor:
                if world == 1:
                    return g
                return upcast(g) if received is None else upcast(g) + received[i]

            grads, dx = _weight_grads(
                h, g2, x2, dps, ws, orient, has_bias, n_shards, accumulate, dx
            )
            if last:  # the pieces are the gradients: no packed copy
                for i, (g, sh) in enumerate(zip(grads, shards)):
                    own[i].append(g if world == 1 else g.to(sh.dtype))
            else:
                out = pack(grads)
                if acc_pending is not None:  # the previous chunk's hop: done travelling by now
                    s_, j_, pending = acc_pending
                    acc[(s_, j_)] = hops.land(pending)
                acc_pending = (step + 1, j, hops.start(out))
            if w_hop is not None:
                w_next[j] = hops.land(w_hop)
        w_cur = w_next
    grads = [
        pieces[0] if n_chunks == 1 else torch.cat(pieces, dim=d)
        for pieces, d in zip(own, hops.dims)
    ]
    return dx, grads


def _projections(x2, ws, has_bias, orient) -> list[torch.Tensor]:
    """The k up projections of ``x2`` with one shard's weights ``ws`` (ups, down, biases)."""
    k = len(has_bias)
    biases = iter(ws[k + 1 :])
    return [
        _project(x2, ws[i], next(biases) if has_bias[i] else None, orient[i] == "t")
        for i in range(k)
    ]


def _chain_backward(chain, ps, g2, w_down, down_t: bool):
    """The activation chain's output ``h`` on the projections ``ps`` and the chain's
    derivative: autograd's, for the gradient ``g2`` arriving through the down projection."""
    with torch.enable_grad():
        ps = [p.detach().requires_grad_() for p in ps]
        h = chain(*ps)
    dh = g2 @ w_down.t() if down_t else g2 @ w_down  # [N, F/D]
    dps = torch.autograd.grad(h, ps, dh, allow_unused=True)
    dps = [torch.zeros_like(p) if d is None else d for p, d in zip(ps, dps)]
    return h.detach(), dps


def _weight_grads(h, g2, x2, dps, ws, orient, has_bias, n_shards, accumulate, dx):
    """One ring step's gradients of a shard's weights (and biases), in the shard's packing
    order, each passed through ``accumulate`` as soon as it is computed; and ``dx`` plus this
    step's input gradient."""
    k = len(dps)
    grads: list[torch.Tensor | None] = [None] * n_shards
    grads[k] = accumulate(k, h.t() @ g2 if orient[k] == "t" else g2.t() @ h)
    bias_slot = k + 1
    for i, dp in enumerate(dps):
        up_t = orient[i] == "t"
        grads[i] = accumulate(i, x2.t() @ dp if up_t else dp.t() @ x2)
        step_dx = dp @ ws[i].t() if up_t else dp @ ws[i]
        dx = step_dx if dx is None else dx + step_dx
        if has_bias[i]:
            grads[bias_slot] = accumulate(bias_slot, dp.sum(0))
            bias_slot += 1
    return grads, dx


def _shard_output(x2, ws, chain, has_bias, orient, saved: list | None) -> torch.Tensor:
    """One shard's contribution to the MLP's output: ``down(chain(up_1(x), ...))`` with its
    weights ``ws``; its projections are appended to ``saved`` when that is a list (kept for
    the backward)."""
    k = len(has_bias)
    ps = _projections(x2, ws, has_bias, orient)
    if saved is not None:
        saved += ps
    return _down(chain(*ps), ws[k], orient[k] == "t")


def ring_mlp(
    x: torch.Tensor,
    w_in: list[torch.Tensor],
    b_in: list[torch.Tensor | None],
    w_down: torch.Tensor,
    chain: str,
    orient: str,
    rank: int,
    world: int,
    group: str,
    tag: str,
    *,
    save_projections: bool = True,
    hop_chunks: int = 1,
) -> torch.Tensor:
    """``down(chain(up_1(x), ..., up_k(x)))`` over the ring; the shards are this rank's own.

    ``w_in``/``b_in``: this rank's slices of the up weights and biases (a bias may be None);
    ``chain``: a key of ``register_chain`` (``"gated:silu"``, ``"plain:gelu"``, or one the
    rewrite registered); ``orient``: ``n`` (Linear, ``[out, in]``) or ``t`` (Conv1D,
    ``[in, out]``) per up weight, then for the down weight. ``hop_chunks``: each shard
    travels in this many chunks of its F-columns (sub-shard hops: about one shard and one
    chunk in flight per stream instead of two shards; the same bytes in more hops)."""
    chain_of(chain)  # a clear error now, not inside the ring
    if len(b_in) != len(w_in) or len(orient) != len(w_in) + 1 or set(orient) - {"n", "t"}:
        raise ValueError(f"ring_mlp: {len(w_in)} up weights, {len(b_in)} biases, orient {orient!r}")
    has_bias = tuple(b is not None for b in b_in)
    if isinstance(hop_chunks, bool) or not isinstance(hop_chunks, int) or hop_chunks < 1:
        raise ValueError(f"ring_mlp: hop_chunks must be an int >= 1, got {hop_chunks!r}")
    spec = (chain, orient, has_bias, bool(save_projections), hop_chunks)
    ins = [*w_in, *(b for b in b_in if b is not None)]
    # the Function sees rows ([tokens, features]) and returns its own tensor, not a view: the
    # model may add into the output in place (Llama-4's shared expert), which autograd forbids
    # on a view made inside a Function; the reshapes here are ordinary autograd views
    y = RingMLP.apply(x.reshape(-1, x.shape[-1]), w_down, spec, rank, world, group, tag, *ins)
    return y.reshape(*x.shape[:-1], y.shape[-1])


__all__ = ["ring_mlp", "RingMLP", "register_chain", "chain_of", "ring_hop"]
