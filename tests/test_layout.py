"""Pure shape arithmetic of the sharding propagation (passes/layout.py)."""

from tspc.passes.layout import (
    Sharded,
    map_broadcast,
    map_getitem,
    map_permute,
    map_reduce,
    map_transpose,
    map_view,
    rewrite_sizes,
)

S = Sharded(dim=1, n=16, n_local=8)


def test_view_split_hidden_keeps_sequence_dim():
    assert map_view([2, 16, 64], [2, 16, 4, 16], S) == S


def test_view_merge_batch_and_sequence_records_outer():
    out = map_view([2, 16, 128], [32, 128], S)
    assert out == Sharded(0, 16, 8, outer=2, inner=1)
    assert out.local_size(32) == 16
    assert map_view([32, 128], [2, 16, 128], out) == S


def test_view_merge_sequence_and_hidden_records_inner():
    assert map_view([2, 16, 64], [2, 1024], S) == Sharded(1, 16, 8, outer=1, inner=64)


def test_view_that_cuts_the_factor_is_refused():
    assert map_view([2, 16], [2, 8, 2], S) is None


def test_gqa_repeat_merge_of_head_dims():
    heads = Sharded(1, 2, 1)
    assert map_view([2, 2, 3, 16, 8], [2, 6, 16, 8], heads) == Sharded(1, 2, 1, inner=3)


def test_permute_transpose_broadcast():
    assert map_transpose(4, 1, 2, Sharded(2, 16, 8)) == Sharded(1, 16, 8)
    assert map_permute([0, 2, 1, 3], Sharded(1, 16, 8)) == Sharded(2, 16, 8)
    assert map_broadcast(3, 4, S) == Sharded(2, 16, 8)


def test_getitem():
    assert map_getitem([2, 4, 16, 8], (Ellipsis, slice(None, 4)), Sharded(2, 16, 8)) == Sharded(
        2, 16, 8
    )
    assert map_getitem([2, 16], (slice(None), slice(1, None)), S) is None  # shift by one
    assert map_getitem([2, 16, 8], (slice(None), None, slice(0, None)), S) == Sharded(2, 16, 8)
    assert map_getitem([2, 16, 8], (0,), S) == Sharded(0, 16, 8)
    assert map_getitem([2, 16], (slice(None), -1), S) is None  # last token


def test_reduce():
    assert map_reduce(3, -1, True, S) == S
    assert map_reduce(3, [0], False, S) == Sharded(0, 16, 8)
    assert map_reduce(3, None, False, S) is None
    assert map_reduce(3, 1, False, S) is None


def test_rewrite_sizes():
    assert rewrite_sizes([2, 16, 4, 16], 1, 16, 8) == [2, 8, 4, 16]
    assert rewrite_sizes([2, -1, 4, 16], 1, 16, 8) == [2, -1, 4, 16]
    assert rewrite_sizes([2, 15, 4, 16], 1, 16, 8) is None
