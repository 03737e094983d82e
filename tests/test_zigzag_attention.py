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
