"""The zigzag causal kernel against dense causal attention, every rank simulated in-process."""

import pytest
import torch

from tests.helpers import zigzag_against_dense
from tspc.ops.zigzag_attention import zigzag_causal_attention


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("padding", [False, True])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_matches_dense_causal_forward_and_backward(world, padding, kv_heads):
    zigzag_against_dense(world, 32, kv_heads, padding)


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


@pytest.mark.parametrize("layout", ["heads_innermost", "kv_heads_expanded", "seq_major"])
def test_any_strides_match_dense_causal_forward_and_backward(layout):
    """q/k/v as models hand them over, not only contiguous: heads innermost in memory
    (``view(b, s, d, h).permute(0, 3, 1, 2)``, einops' '(d h)'), one KV head expanded to every
    query head (stride 0), and [b, s, h, d] memory read as [b, h, s, d]. torch's CPU flash
    kernel called directly reads a head dim that is not innermost wrongly (it returned 1e22 here),
    so the kernel copies such operands; checked against dense SDPA, every rank of D = 2."""
    from tspc.runtime.zigzag import zigzag_indices

    torch.manual_seed(0)
    b, s, h, d, world = 2, 16, 4, 8, 2

    def operand():
        if layout == "heads_innermost":
            return torch.randn(b, s, d, h).permute(0, 3, 1, 2)
        if layout == "kv_heads_expanded":
            return torch.randn(b, 1, s, d).expand(b, h, s, d)
        return torch.randn(b, s, h, d).transpose(1, 2)

    q, k, v = (operand().requires_grad_() for _ in range(3))
    dense = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    grad = torch.randn_like(dense)
    want = torch.autograd.grad(dense, (q, k, v), grad)
    got = [torch.zeros_like(t) for t in (q, k, v)]
    for rank in range(world):
        idx = zigzag_indices(s, rank, world)
        out, _ = zigzag_causal_attention(q[:, :, idx], k, v, rank, world, d**-0.5)
        torch.testing.assert_close(out, dense[:, :, idx], rtol=1e-5, atol=1e-6)
        for acc, g in zip(got, torch.autograd.grad(out, (q, k, v), grad[:, :, idx])):
            acc += g
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
