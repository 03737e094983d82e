"""Two-operand ``einsum`` calls lowered to ``matmul`` (``passes/canonicalize_einsum.py``): the
lowered graph computes what ``torch.einsum`` computes, and what cannot be one matmul is left as it
is. Graph-only: Dynamo's graph of one call, no process group."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import capture
from tspc.passes.canonicalize_einsum import canonicalize_einsum
from tspc.passes.graph_utils import op_name

# index -> size: queries (i, q) and keys (j, k) of other lengths, so a transposition shows
SIZES = {"b": 2, "h": 3, "i": 5, "q": 5, "j": 4, "k": 4, "d": 6, "e": 6, "r": 2}

LOWERED = [
    "bhqd,bhkd->bhqk",  # scores
    "bhqk,bhkd->bhqd",  # the value product
    "bqhd,bkhd->bhqk",  # heads after the sequence
    "bhid,bjd->bhij",  # multi-query scores: keys without a heads index (x-transformers, PaLM)
    "bhij,bjd->bhid",  # multi-query value product
    "bid,bhjd->bhij",  # the other operand without heads
    "bhid,bjd->bihj",  # the output in another order
    "rbhid,bjd->bhrij",  # two indices the keys broadcast over
]
LEFT = [
    "bhid,bhid->bhi",  # a vector product per row: no free index on either side
    "bhid,bhjd->bhj",  # a free index summed away
    "bhid,bhje->bhijde",  # an outer product: no contracted index
]


def _operands(equation: str):
    lhs = equation.split("->")[0].split(",")
    gen = torch.Generator().manual_seed(0)
    return [torch.randn([SIZES[c] for c in spec], generator=gen) for spec in lhs]


def _lowered(equation: str):
    def f(a, b):
        return torch.einsum(equation, a, b)

    a, b = _operands(equation)
    gm, inputs = capture(f, a, b)
    lowered = canonicalize_einsum(gm, {})
    return gm, lowered, f(a, b), gm(*inputs)


@pytest.mark.parametrize("equation", LOWERED)
def test_products_become_one_matmul_with_the_same_values(equation):
    gm, lowered, want, got = _lowered(equation)
    assert lowered == 1
    names = [op_name(n) for n in gm.graph.nodes]
    assert "einsum" not in names and names.count("matmul") == 1, names
    got = got[0] if isinstance(got, (tuple, list)) else got
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("equation", LEFT)
def test_what_is_no_single_matmul_is_left_as_it_is(equation):
    gm, lowered, _, _ = _lowered(equation)
    assert lowered == 0
    assert "einsum" in [op_name(n) for n in gm.graph.nodes]


def test_a_parameters_einsum_with_several_free_indices_is_left_whole():
    """``bsd,thed->tbhse`` over a fused q/k/v weight: as a broadcast matmul it would copy the
    input once per weight slice and still be no projection a matcher reads, so it stays."""

    def f(x, w):
        return torch.einsum("bsd,thed->tbhse", x, w)

    x, w = torch.randn(2, 5, 6), torch.randn(3, 2, 4, 6)
    gm, _ = capture(f, x, w)
    weight = [n for n in gm.graph.nodes if n.op == "placeholder"][1]
    assert canonicalize_einsum(gm, {weight: None}) == 0
    gm, _ = capture(f, x, w)
    assert canonicalize_einsum(gm, {}) == 1  # two activations: lowered
