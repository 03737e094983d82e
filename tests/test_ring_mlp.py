"""The MLP ring on its own, on gloo: output and gradients against the dense MLP, for plain and
gated MLPs, Linear ([out, in]) and Conv1D ([in, out]) weights, with and without biases."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tspc.launch import spawn

ACTS = {
    "silu": F.silu,
    "gelu_tanh": lambda a: F.gelu(a, approximate="tanh"),
    "relu2": lambda a: F.relu(a).square(),
}


def dense(x, ws, bs, wd, gated, act, conv1d):
    """The MLP in one piece: ``down(act(gate(x)) * up(x))`` or ``down(act(up(x)))``."""
    ps = [
        x @ w + (b if b is not None else 0) if conv1d else F.linear(x, w, b) for w, b in zip(ws, bs)
    ]
    h = ACTS[act](ps[0]) * ps[1] if gated else ACTS[act](ps[0])
    return h @ wd if conv1d else F.linear(h, wd)


def ring_worker(
    rank: int,
    world: int,
    gated: bool,
    bias: bool,
    act: str,
    conv1d: bool,
    hop_chunks: int = 1,
    save_projections: bool = True,
    f: int = 16,
) -> dict:
    import torch.distributed as dist

    from tspc.runtime.counters import COUNTER
    from tspc.runtime.ring_mlp import ring_mlp

    torch.manual_seed(0)
    h, n, k = 8, 6, 2 if gated else 1
    ws = [torch.randn(f, h) for _ in range(k)]
    wd = torch.randn(h, f)
    if conv1d:  # stored [in, out]: F is dim 1 of the ups, dim 0 of down
        ws, wd = [w.t().contiguous() for w in ws], wd.t().contiguous()
    bs = [torch.randn(f) if bias else None for _ in range(k)]
    x_all = torch.randn(world, 2, n, h)  # every rank has its own tokens
    go_all = torch.randn(world, 2, n, h)
    params = [p.requires_grad_() for p in (*ws, wd, *bs) if p is not None]
    xr = x_all.clone().requires_grad_()
    ref = dense(xr, ws, bs, wd, gated, act, conv1d)
    grads = torch.autograd.grad(ref, [xr, *params], go_all)
    c = f // world
    sl = slice(rank * c, (rank + 1) * c)
    up_idx = (slice(None), sl) if conv1d else sl
    down_idx = sl if conv1d else (slice(None), sl)
    mine = [t.detach()[idx].clone().requires_grad_() for t, idx in [(w, up_idx) for w in ws]]
    mine_d = wd.detach()[down_idx].clone().requires_grad_()
    mine_b = [b.detach()[sl].clone().requires_grad_() if b is not None else None for b in bs]
    x = x_all[rank].clone().requires_grad_()
    COUNTER.reset()
    group = dist.group.WORLD.group_name if world > 1 else ""
    chain = f"{'gated' if gated else 'plain'}:{act}"
    orient = ("t" if conv1d else "n") * (k + 1)
    y = ring_mlp(
        x,
        mine,
        mine_b,
        mine_d,
        chain,
        orient,
        rank,
        world,
        group,
        "mlp",
        save_projections=save_projections,
        hop_chunks=hop_chunks,
    )
    y.backward(go_all[rank])
    errs = {
        "y": (y - ref[rank]).abs().max().item() / ref.abs().max().item(),
        "x": (x.grad - grads[0][rank]).abs().max().item() / grads[0].abs().max().item(),
    }
    full = [g[up_idx] for g in grads[1 : 1 + k]] + [grads[1 + k][down_idx]]
    full += [g[sl] for g in grads[2 + k :]]
    shards = [*mine, mine_d, *(b for b in mine_b if b is not None)]
    for i, (s, g) in enumerate(zip(shards, full, strict=True)):
        errs[f"w{i}"] = (s.grad - g).abs().max().item() / g.abs().max().item()
    return {"errs": errs, "ring": COUNTER.snapshot()["by_kind"].get("ring", {"calls": 0})}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize(
    "gated,bias,act,conv1d",
    [
        (True, False, "silu", False),
        (True, True, "gelu_tanh", False),
        (False, True, "gelu_tanh", False),
        (False, False, "relu2", True),
        (True, True, "silu", True),
    ],
)
def test_ring_matches_dense_mlp(world, gated, bias, act, conv1d):
    for r in spawn(ring_worker, world, gated, bias, act, conv1d, timeout=120):
        assert max(r["errs"].values()) < 1e-5, r["errs"]
        # D-1 hops forward, D-1 weight hops and D-1 gradient hops backward
        assert r["ring"]["calls"] == 3 * (world - 1)


# (gated, bias, act, conv1d, hop_chunks, save_projections, F): sub-shard hops with every
# weight layout, saved and rebuilt projections, and chunks that do not divide F / D evenly
CHUNKED_CASES = [
    (True, False, "silu", False, 2, True, 16),
    (True, True, "gelu_tanh", False, 3, False, 24),
    (False, True, "gelu_tanh", True, 4, True, 16),
    (True, True, "silu", True, 3, False, 20),
]


def chunked_ring_worker(rank: int, world: int) -> list[dict]:
    out = []
    for case in CHUNKED_CASES:
        if case[-1] % world:
            continue
        out.append({"case": case, **ring_worker(rank, world, *case)})
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ring_in_sub_shard_chunks_matches_dense_mlp(world):
    for results in spawn(chunked_ring_worker, world, timeout=180):
        assert results
        for r in results:
            gated, bias, act, conv1d, chunks, save, f = r["case"]
            assert max(r["errs"].values()) < 1e-5, r
            # every hop of the unchunked ring (3 (D - 1)) in `chunks` pieces (at most one
            # per column of F / D)
            assert r["ring"]["calls"] == 3 * (world - 1) * min(chunks, f // world), r


@pytest.mark.parametrize("gated", [False, True])
def test_ring_world_one_is_the_plain_mlp(gated):
    from tspc.runtime.ring_mlp import ring_mlp

    torch.manual_seed(0)
    k = 2 if gated else 1
    x = torch.randn(3, 8, requires_grad=True)
    ws = [torch.randn(16, 8, requires_grad=True) for _ in range(k)]
    bs = [torch.randn(16, requires_grad=True) for _ in range(k)]
    wd = torch.randn(8, 16, requires_grad=True)
    chain = "gated:silu" if gated else "plain:silu"
    y = ring_mlp(x, ws, bs, wd, chain, "n" * (k + 1), 0, 1, "", "mlp")
    ref = dense(x, ws, bs, wd, gated, "silu", False)
    torch.testing.assert_close(y, ref)
    g1 = torch.autograd.grad(y.sum(), [x, *ws, *bs, wd])
    g2 = torch.autograd.grad(ref.sum(), [x, *ws, *bs, wd])
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


def test_bad_hop_chunks_are_refused():
    from tspc.runtime.ring_mlp import ring_mlp

    w = torch.randn(4, 4)
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="hop_chunks must be an int >= 1"):
            ring_mlp(
                torch.randn(2, 4), [w], [None], w, "plain:silu", "nn", 0, 1, "", "", hop_chunks=bad
            )


def test_an_unregistered_chain_is_refused():
    from tspc.runtime.ring_mlp import ring_mlp

    w = torch.randn(4, 4)
    with pytest.raises(ValueError, match="chain 'plain:swish2' is not registered"):
        ring_mlp(torch.randn(2, 4), [w], [None], w, "plain:swish2", "nn", 0, 1, "", "")
