"""The MLP ring on its own, on gloo: output and gradients against the dense gated MLP."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tspc.launch import spawn


def ring_worker(rank: int, world: int, bias: bool, act: str) -> dict:
    import torch.distributed as dist

    from tspc.runtime.counters import COUNTER
    from tspc.runtime.ring_mlp import _ACT, ring_mlp

    torch.manual_seed(0)
    h, f, n = 8, 16, 6
    wg, wu, wd = torch.randn(f, h), torch.randn(f, h), torch.randn(h, f)
    bg, bu = (torch.randn(f), torch.randn(f)) if bias else (None, None)
    x_all = torch.randn(world, 2, n, h)  # every rank has its own tokens
    go_all = torch.randn(world, 2, n, h)
    params = [p.requires_grad_() for p in (wg, wu, wd, bg, bu) if p is not None]
    xr = x_all.clone().requires_grad_()
    act_fn = _ACT[act][0]
    ref = F.linear(act_fn(F.linear(xr, wg, bg)) * F.linear(xr, wu, bu), wd)
    grads = torch.autograd.grad(ref, [xr, *params], go_all)
    c = f // world
    sl = slice(rank * c, (rank + 1) * c)
    shards = [
        t.detach()[idx].clone().requires_grad_() if t is not None else None
        for t, idx in ((wg, sl), (wu, sl), (wd, (slice(None), sl)), (bg, sl), (bu, sl))
    ]
    x = x_all[rank].clone().requires_grad_()
    COUNTER.reset()
    group = dist.group.WORLD.group_name if world > 1 else ""
    y = ring_mlp(x, *shards, act, rank, world, group, "mlp")
    y.backward(go_all[rank])
    errs = {
        "y": (y - ref[rank]).abs().max().item() / ref.abs().max().item(),
        "x": (x.grad - grads[0][rank]).abs().max().item() / grads[0].abs().max().item(),
    }
    full = [grads[1][sl], grads[2][sl], grads[3][:, sl]] + (
        [grads[4][sl], grads[5][sl]] if bias else []
    )
    for i, (s, g) in enumerate(zip([s for s in shards if s is not None], full)):
        errs[f"w{i}"] = (s.grad - g).abs().max().item() / g.abs().max().item()
    return {"errs": errs, "ring": COUNTER.snapshot()["by_kind"].get("ring", {"calls": 0})}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("bias,act", [(False, "silu"), (True, "gelu_tanh")])
def test_ring_matches_dense_mlp(world, bias, act):
    for r in spawn(ring_worker, world, bias, act, timeout=120):
        assert max(r["errs"].values()) < 1e-5, r["errs"]
        # D-1 hops forward, D-1 weight hops and D-1 gradient hops backward
        assert r["ring"]["calls"] == 3 * (world - 1)


def test_ring_world_one_is_the_plain_mlp():
    from tspc.runtime.ring_mlp import ring_mlp

    torch.manual_seed(0)
    x = torch.randn(3, 8, requires_grad=True)
    w = [
        torch.randn(16, 8, requires_grad=True),
        torch.randn(16, 8, requires_grad=True),
        torch.randn(8, 16, requires_grad=True),
    ]
    y = ring_mlp(x, *w, None, None, "silu", 0, 1, "", "mlp")
    ref = F.linear(F.silu(F.linear(x, w[0])) * F.linear(x, w[1]), w[2])
    torch.testing.assert_close(y, ref)
    g1 = torch.autograd.grad(y.sum(), [x, *w])
    g2 = torch.autograd.grad(ref.sum(), [x, *w])
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b)


def test_unsupported_activation_is_refused():
    from tspc.runtime.ring_mlp import ring_mlp

    with pytest.raises(ValueError, match="activation 'swish2'"):
        ring_mlp(torch.randn(2, 4), *(torch.randn(4, 4),) * 3, None, None, "swish2", 0, 1, "", "")
