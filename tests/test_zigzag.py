import pytest
import torch

from tspc.runtime.zigzag import (
    check_divisible,
    zigzag_indices,
    zigzag_slice,
    zigzag_stack_parts,
    zigzag_unshard,
)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_indices_cover_sequence_once_and_balance_causal_work(world):
    s = 8 * world
    parts = [zigzag_indices(s, r, world) for r in range(world)]
    assert torch.equal(torch.sort(torch.cat(parts)).values, torch.arange(s))
    # causal work of a token = its position + 1; every rank gets the same total
    work = {int((p + 1).sum()) for p in parts}
    assert len(work) == 1


def test_rank_holds_chunks_p_and_2d_minus_1_minus_p():
    assert zigzag_indices(16, 1, 4).tolist() == [2, 3, 12, 13]


LAYOUTS = [
    ((2, 16, 3), 1, 1, 1),
    ((2, 16, 3), -2, 1, 1),
    ((32, 3), 0, 2, 1),
    ((2, 48), 1, 1, 3),
    ((16,), 0, 1, 1),
    ((2, 3, 24, 5), 2, 1, 1),
]


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("shape,dim,outer,inner", LAYOUTS)
def test_slice_unshard_roundtrip(world, shape, dim, outer, inner):
    x = torch.randn(shape)
    parts = [zigzag_slice(x, dim, r, world, outer, inner) for r in range(world)]
    assert torch.equal(zigzag_unshard(torch.stack(parts), dim, world, outer, inner), x)
    assert torch.equal(zigzag_stack_parts(x, dim, world, outer, inner), torch.stack(parts))


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("shape,dim,outer,inner", LAYOUTS)
def test_unshard_gradient_is_every_ranks_part_of_the_gradient(world, shape, dim, outer, inner):
    # the adjoint of putting the gathered parts in true order: each rank's part of the
    # gradient, as zigzag_slice cuts it (the K/V gathers' backward relies on it)
    seq = 2 * world * outer * inner * 3  # 3 tokens in each of the 2D chunks (D = 3 included)
    shape = tuple(seq if i == dim % len(shape) else n for i, n in enumerate(shape))
    x = torch.randn(shape)
    parts = torch.stack([zigzag_slice(x, dim, r, world, outer, inner) for r in range(world)])
    parts.requires_grad_()
    out = zigzag_unshard(parts, dim, world, outer, inner)
    grad = torch.randn_like(out)
    out.backward(grad)
    want = torch.stack([zigzag_slice(grad, dim, r, world, outer, inner) for r in range(world)])
    assert torch.equal(parts.grad, want)


def test_merged_dim_slices_the_sequence_factor():
    x = torch.arange(2 * 16).view(2, 16)
    merged = zigzag_slice(x.reshape(32), 0, 1, 2, outer=2)
    assert torch.equal(merged, zigzag_slice(x, 1, 1, 2).reshape(-1))


def test_check_divisible_names_length_world_and_fix():
    with pytest.raises(ValueError, match=r"sequence length 30 .* 2\*D = 8 .*Pad"):
        check_divisible(30, 4)
