"""Eager attention whose causal mask is applied with ``masked_fill`` (nanoGPT, minGPT, einsum
research code) is attention: canonicalised into one SDPA call whose mask ``classify_mask``
recognises as causal, so nothing S x S is left on the TSP path.

Graph-only, no process group: Dynamo's own graph of the attention, checked against the same
module run eagerly (the rewritten graph must give its outputs and gradients), and a fill value
that an additive mask would not reproduce (``-1e9``: a row masked at every key is uniform under
``masked_fill``) left as it is, with the reason.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import capture
from tests.peer_forms import NanoGPTAttention
from tspc.passes.canonicalize_attention import canonicalize_eager_attention
from tspc.passes.classify_mask import classify
from tspc.passes.graph_utils import op_name
from tspc.passes.match_attention import sdpa_args


def _fill_attention(value: float):
    def attend(q, k, v):
        s = q.shape[-2]
        att = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
        att = att.masked_fill(torch.tril(torch.ones(s, s)) == 0, value)
        return att.softmax(-1) @ v

    return attend


@pytest.mark.parametrize("fill", [False, True], ids=["ones_eq_0_neg_inf", "not_tril_finfo_min"])
def test_masked_fill_attention_becomes_sdpa_with_a_causal_mask(fill):
    torch.manual_seed(0)
    module = NanoGPTAttention(fill=fill)
    x = torch.randn(2, 10, 64)
    gm, inputs = capture(module, x)
    found = canonicalize_eager_attention(gm)
    assert [f.replaced for f in found] == [True], [f.reason for f in found]
    (sdpa,) = [n for n in gm.graph.nodes if op_name(n) == "sdpa"]
    assert not any(op_name(n) in ("masked_fill", "softmax") for n in gm.graph.nodes)
    a = sdpa_args(sdpa)
    meaning = classify(a["attn_mask"], 10, 10)
    assert not isinstance(meaning, str), meaning
    assert meaning.kind == "causal" and meaning.key_valid is None and meaning.window is None

    # the rewritten graph computes what the module computes, forward and backward
    xs = [x.clone().requires_grad_(), x.clone().requires_grad_()]
    probe = torch.randn(2, 10, 64)
    (gm(*[xs[0] if t is x else t for t in inputs])[0] * probe).sum().backward()
    (module(xs[1]) * probe).sum().backward()
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-5, atol=1e-6)


def test_a_fill_value_no_additive_mask_reproduces_is_left_with_the_reason():
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    gm, _ = capture(_fill_attention(-1e9), q, k, v)
    found = canonicalize_eager_attention(gm)
    assert [f.replaced for f in found] == [False]
    assert "masked_fill with -1000000000.0" in found[0].reason, found[0].reason
    assert "float('-inf')" in found[0].reason
    assert any(op_name(n) == "softmax" for n in gm.graph.nodes)  # left as it was

    gm, _ = capture(_fill_attention(float("-inf")), q, k, v)
    assert [f.replaced for f in canonicalize_eager_attention(gm)] == [True]
    torch.testing.assert_close(gm(q, k, v)[0], _fill_attention(float("-inf"))(q, k, v))
