"""The census (``passes/census.py``): every attention- and MLP-like computation of a graph is in
the compile report, matched or skipped with a reason, whether or not a matcher knows its form.

The graphs are fed in forms the census must count — SDPA, eager softmax, einsum attention, a
GLU written as one einsum projection chunked into gate and up, and attention written with
``bmm`` over flattened heads (a form no matcher knows) — and each test fails if the report
leaves one out. Counts are what the hand-written modules contain, not what the code finds.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import capture
from tests.peer_forms import HEADS, VOCAB, EinsumAttention, EinsumGLU, GatedMLP, H

D_HEAD = H // HEADS


class SdpaAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(H, 3 * H, bias=False)
        self.o = nn.Linear(H, H, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, HEADS, D_HEAD).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        return self.o(
            F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, H)
        )


class EagerAttention(SdpaAttention):
    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (t.view(b, s, HEADS, D_HEAD).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        mask = torch.full((s, s), float("-inf")).triu(1)
        probs = torch.softmax(q @ k.transpose(-2, -1) * D_HEAD**-0.5 + mask, dim=-1)
        return self.o((probs @ v).transpose(1, 2).reshape(b, s, H))


class BmmAttention(SdpaAttention):
    """Heads flattened into the batch and multiplied with ``bmm``: no matcher reads it."""

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = (
            t.view(b, s, HEADS, D_HEAD).transpose(1, 2).reshape(b * HEADS, s, D_HEAD)
            for t in self.qkv(x).chunk(3, -1)
        )
        probs = torch.softmax(torch.bmm(q, k.transpose(1, 2)) * D_HEAD**-0.5, dim=-1)
        out = torch.bmm(probs, v).view(b, HEADS, s, D_HEAD)
        return self.o(out.transpose(1, 2).reshape(b, s, H))


ATTENTION = {
    "sdpa": SdpaAttention,
    "eager": EagerAttention,
    "einsum": EinsumAttention,
    "bmm": BmmAttention,
}


class Model(nn.Module):
    """One block per attention form; MLPs alternate between a gated MLP and the einsum GLU."""

    def __init__(self, forms):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, H)
        self.attn = nn.ModuleList(ATTENTION[f]() for f in forms)
        self.mlp = nn.ModuleList(EinsumGLU() if i % 2 else GatedMLP() for i in range(len(forms)))

    def forward(self, ids):
        x = self.embed(ids)
        for attn, mlp in zip(self.attn, self.mlp):
            x = x + attn(x)
            x = x + mlp(x)
        return x


def test_the_census_counts_each_attention_form_and_both_mlp_forms():
    from tspc.passes.analyse import analyse
    from tspc.passes.census import census

    forms = list(ATTENTION)
    gm, inputs = capture(Model(forms), torch.randint(0, VOCAB, (2, 8)))
    items = census(gm, analyse(gm, inputs).params)
    got = sorted((i.kind, i.module) for i in items)
    want = [("attention", f"attn.{i}") for i in range(len(forms))]
    want += [("mlp", f"mlp.{i}") for i in range(len(forms))]
    assert got == want, [(i.kind, i.module, i.form) for i in items]


def test_the_census_counts_torch_nn_multihead_attention():
    """``nn.MultiheadAttention`` reaches the backend as one ``F.multi_head_attention_forward``
    call (Dynamo keeps it whole): the census lists that call as attention (what it is, where a
    call the pass leaves stays), and, once ``canonicalize_mha`` wrote it out, the SDPA call in
    its place — the same module, where the report used to say "no self-attention found"."""
    from tspc.passes.analyse import analyse, propagate_shapes
    from tspc.passes.canonicalize_mha import canonicalize_mha
    from tspc.passes.census import census

    class Mha(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, H)
            self.attn = nn.MultiheadAttention(H, HEADS, batch_first=True)

        def forward(self, ids):
            x = self.embed(ids)
            mask = torch.ones(8, 8, dtype=torch.bool).triu(1)
            return x + self.attn(x, x, x, attn_mask=mask, need_weights=False)[0]

    gm, inputs = capture(Mha().train(), torch.randint(0, VOCAB, (2, 8)))
    items = census(gm, analyse(gm, inputs).params)
    assert [(i.kind, i.module) for i in items] == [("attention", "attn")], items
    assert "MultiheadAttention's fused call" in items[0].form
    assert [c.replaced for c in canonicalize_mha(gm)] == [True]
    propagate_shapes(gm, inputs)  # the new nodes' values, as the pipeline does
    items = census(gm, analyse(gm, inputs).params)
    assert [(i.kind, i.module, i.form) for i in items] == [("attention", "attn", "sdpa call")], (
        items
    )


def test_the_census_does_not_count_a_residual_between_two_projections():
    """``head(norm(x + w2(h)))`` projects back from the model width after an elementwise sum:
    no activation of one value lies between, so it is no MLP."""
    from tspc.passes.analyse import analyse
    from tspc.passes.census import census

    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.w2, self.head = nn.Linear(2 * H, H), nn.Linear(H, 2 * H)

        def forward(self, x, h):
            return self.head(x + self.w2(h))

    gm, inputs = capture(Residual(), torch.randn(2, 8, H), torch.randn(2, 8, 2 * H))
    assert census(gm, analyse(gm, inputs).params) == []


@pytest.mark.slow
def test_the_report_lists_every_census_item_matched_or_skipped():
    """All four attention forms in one model, compiled (one process): every attention and MLP
    the model holds is an entry of the report, the bmm one skipped with the reason."""
    import tspc

    forms = list(ATTENTION)
    model = Model(forms)
    ids = torch.randint(0, VOCAB, (2, 8))
    with torch.no_grad():
        want = model(ids)
        got = torch.compile(model, backend="tsp")(ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    rep = tspc.last_report()
    entries = {(e.kind, e.module): e for e in rep.entries}
    for i in range(len(forms)):
        assert ("attention", f"attn.{i}") in entries, rep.summary()
        assert ("mlp", f"mlp.{i}") in entries, rep.summary()
    assert rep.unlisted() == [], rep.summary()
    assert len(rep.census) == 2 * len(forms), rep.census
    bmm = entries[("attention", f"attn.{forms.index('bmm')}")]
    assert bmm.status == "skipped" and "not recognised by the attention matcher" in bmm.reason
    for i, form in enumerate(forms):
        if form != "bmm":
            assert entries[("attention", f"attn.{i}")].status == "matched", rep.summary()
        assert entries[("mlp", f"mlp.{i}")].status == "matched", rep.summary()


def test_an_einsum_projection_over_a_3d_weight_is_not_a_mixture_of_experts():
    """The einsum decoder's output projection ``bhse,hed->bsd`` (weight ``[heads, head_dim,
    dim]``, both leading indices contracted) and its fused q/k/v ``bsd,thed->tbhse`` hold no
    expert per leading index: the MoE matcher must not read their blocks as experts (it once
    reported "1 stacked parameters ... expert parallelism takes two" under the block's name)."""
    from tests.einsum_model import EinsumDecoder
    from tspc.passes.analyse import analyse
    from tspc.passes.match_moe import stacked_pairs

    torch.manual_seed(0)
    gm, inputs = capture(EinsumDecoder(), torch.randint(0, VOCAB, (2, 8)))
    assert stacked_pairs(gm, analyse(gm, inputs).params) == {}
