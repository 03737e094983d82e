"""The zigzag causal kernel against dense causal attention, every rank simulated in-process."""

import pytest
import torch
import torch.nn.functional as F

from tspc.ops.zigzag_attention import zigzag_causal_attention
from tspc.runtime.zigzag import zigzag_slice


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_matches_dense_causal_forward_and_backward(world, padding, kv_heads):
    torch.manual_seed(0)
    b, hq, s, d = 2, 4, 32, 8
    q = torch.randn(b, hq, s, d, requires_grad=True)
    k = torch.randn(b, kv_heads, s, d, requires_grad=True)
    v = torch.randn(b, kv_heads, s, d, requires_grad=True)
    mask = torch.ones(s, s, dtype=torch.bool).tril()[None, None].expand(b, 1, s, s)
    valid = None
    if padding:
        valid = torch.ones(b, s, dtype=torch.bool)
        valid[0, :5] = False  # left padding: rows that see no key at all
        valid[1, -3:] = False
        mask = mask & valid[:, None, None, :]
    rep = hq // kv_heads
    ref = F.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask
    )
    go = torch.randn_like(ref)
    gq, gk, gv = torch.autograd.grad(ref, (q, k, v), go)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)
    for r in range(world):
        ql = zigzag_slice(q.detach(), 2, r, world).requires_grad_()
        kk = k.detach().requires_grad_()
        vv = v.detach().requires_grad_()
        out, _ = zigzag_causal_attention(ql, kk, vv, r, world, d**-0.5, valid)
        torch.testing.assert_close(out, zigzag_slice(ref, 2, r, world), atol=2e-6, rtol=1e-5)
        a, bk, bv = torch.autograd.grad(out, (ql, kk, vv), zigzag_slice(go, 2, r, world))
        torch.testing.assert_close(a, zigzag_slice(gq, 2, r, world), atol=5e-6, rtol=1e-5)
        dk += bk
        dv += bv
    torch.testing.assert_close(dk, gk, atol=5e-6, rtol=1e-5)
    torch.testing.assert_close(dv, gv, atol=5e-6, rtol=1e-5)


def test_no_sequence_sized_mask_is_built():
    """The kernel's memory does not grow with c x S: only a [B,1,1,L] padding row at most."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Biggest(TorchDispatchMode):
        biggest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple) else (out,):
                if isinstance(t, torch.Tensor):
                    Biggest.biggest = max(Biggest.biggest, t.numel())
            return out

    s, world, d = 4096, 2, 8
    q = torch.randn(1, 1, s // world, d)
    k = torch.randn(1, 1, s, d)
    with Biggest():
        zigzag_causal_attention(q, k, k, 0, world, d**-0.5, None)
    assert Biggest.biggest <= s * d  # no c x S (here 2048 x 4096) tensor
