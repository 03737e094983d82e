"""Attention and MLP forms of libraries outside transformers (``tests/peer_forms.py``): fused
q/k/v with GQA, GQA repeated before RoPE, einsum attention and an einsum GLU chunked into gate
and up, values with their own head size, FlexAttention, nanoGPT's masked_fill causal mask.

Graph-level at D = 2 (fake process group): each is matched (level 'tsp', every census item
matched), FlexAttention's causal and sliding-window masks recognised, a FlexAttention with a
score_mod skipped with its reason. On gloo at D = 2: outputs and gradients equal one process,
at an even and an odd length (FlexAttention forward only: it has no backward on CPU).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import grad_error
from tests.peer_forms import VOCAB, PeerModel
from tspc.launch import spawn

MATCHED = (
    "fused_gqa",
    "fused_gqa_kv_first_bias",
    "tune_gqa",
    "tune_gqa_flatten",
    "einsum",
    "v_dim",
    "nanogpt",
    "nanogpt_finfo",
    "l2norm_qk",
)
FLEX = ("flex", "flex_window")  # no FlexAttention backward on CPU: compared forward only


def _compile_report(form: str, length: int = 16):
    from tspc.backend import COMPILED

    model = PeerModel(form)
    with torch.no_grad():
        torch.compile(model, backend="tsp", fullgraph=True)(torch.randint(0, VOCAB, (2, length)))
    return COMPILED[-1].report


@pytest.mark.parametrize("form", MATCHED + FLEX)
def test_peer_form_is_matched(form, fake_group):
    fake_group(0, 2)
    rep = _compile_report(form)
    assert rep.level == "tsp", rep.summary()
    got = sorted((e.kind, e.module, e.status) for e in rep.entries)
    want = sorted(
        (kind, f"layers.{i}.{short}", "matched")
        for i in (0, 1)
        for kind, short in (("attention", "attn"), ("mlp", "mlp"))
    )
    assert got == want, rep.summary()
    assert len(rep.census) == 4 and rep.unlisted() == [], rep.summary()
    # einsum's full(-inf).triu(1) and flex's BlockMasks: recognised, no S x S mask in the path
    assert all(m["recognised"] for m in rep.masks), rep.summary()


def test_flex_attention_masks_are_recognised(fake_group):
    """The causal and sliding-window BlockMasks become the zigzag kernel's forms."""
    fake_group(0, 2)
    rep = _compile_report("flex_window")
    assert [m["kind"] for m in rep.masks] == ["sliding_window"] * 2, rep.summary()
    assert all(m["window"] == 5 for m in rep.masks), rep.masks
    assert sum("FlexAttention" in n for n in rep.notes) == 2, rep.notes


def test_flex_attention_it_cannot_map_is_listed_with_the_reason(fake_group):
    """A score_mod (here a bias by distance) is not mapped: the attention is skipped and says
    why. No attention then shards the sequence, so every rank holds all the tokens: the MLPs
    are skipped too, with that reason (the ring would sum D equal weight gradients onto each
    owner: D times the true one; docs/models.md) and read their weights whole."""
    from torch.nn.attention.flex_attention import flex_attention

    from tests import peer_forms

    fake_group(0, 2)

    class Biased(peer_forms.FlexAttention):
        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = (
                w(x).view(b, s, peer_forms.HEADS, -1).transpose(1, 2)
                for w in (self.wq, self.wk, self.wv)
            )

            def bias(score, b_, h_, q_idx, kv_idx):
                return score - (q_idx - kv_idx).abs()

            out = flex_attention(q, k, v, score_mod=bias)
            return self.wo(out.transpose(1, 2).reshape(b, s, -1))

    peer_forms.ATTENTION["flex_biased"] = Biased
    try:
        rep = _compile_report("flex_biased")
    finally:
        del peer_forms.ATTENTION["flex_biased"]
    entries = {(e.kind, e.module): e for e in rep.entries}
    for i in (0, 1):
        attn = entries[("attention", f"layers.{i}.attn")]
        assert attn.status == "skipped" and "score_mod" in attn.reason, rep.summary()
        mlp = entries[("mlp", f"layers.{i}.mlp")]
        assert mlp.status == "skipped", rep.summary()
        assert "the sequence is not sharded in this graph" in mlp.reason, rep.summary()
    assert not rep.matched and "the sequence is not sharded" in " ".join(rep.notes), rep.notes
    assert rep.unlisted() == [], rep.summary()


def peer_worker(
    rank: int, world: int, forms: list, lengths: list[int], backward: bool = True
) -> list[dict]:
    import tspc

    out = []
    for form in forms:
        for length in lengths:
            torch.compiler.reset()
            ref, model = PeerModel(form), PeerModel(form)
            gen = torch.Generator().manual_seed(length)
            ids = torch.randint(0, VOCAB, (2, length), generator=gen)
            probe = torch.randn(2, length, VOCAB, generator=gen)
            with torch.set_grad_enabled(backward):
                expected = ref(ids)
                got = torch.compile(model, backend="tsp")(ids)
            err = 0.0
            if backward:
                (expected * probe).sum().backward()
                (got * probe).sum().backward()
                err, _ = grad_error(ref, model)
            rep = tspc.last_report()
            out.append(
                {
                    "form": form,
                    "length": length,
                    "level": rep.level,
                    "entries": [(e.kind, e.module, e.status, e.reason) for e in rep.entries],
                    "out_err": ((got - expected).abs().max() / expected.abs().max()).item(),
                    "grad_err": err,
                }
            )
    return out


# forms whose attention no cut by contiguous head groups runs exactly: skipped, the reason
SKIPPED = {
    # einops' ``(r h)`` repetition pairs query head i with KV head i mod n
    "tiled_gqa": "does not keep a group's heads together",
    # the projections' head groups reach the call as its head_dim
    "heads_innermost_in": "not the heads dim of [..., heads, seq, head_dim]",
    # a head group's output-projection columns are strided
    "heads_innermost_out": "heads not outermost in the features",
}


@pytest.mark.parametrize("form", list(SKIPPED))
def test_attention_no_head_group_cut_runs_is_skipped_with_the_reason(form, fake_group):
    """Each of these was matched and ran with other heads' values (or NaN) before the checks of
    ``check_heads_align`` / ``check_output_columns``; now the attention is skipped, the MLP runs."""
    fake_group(0, 2)
    rep = _compile_report(form)
    assert rep.level == "tsp", rep.summary()
    entries = {(e.kind, e.module): e for e in rep.entries}
    for i in (0, 1):
        att = entries[("attention", f"layers.{i}.attn")]
        assert att.status == "skipped" and SKIPPED[form] in att.reason, rep.summary()
        assert entries[("mlp", f"layers.{i}.mlp")].status == "matched", rep.summary()


@pytest.mark.slow
@pytest.mark.parametrize(
    "lengths",
    # the suite: the odd length (internal padding, the harder path); the even one in the
    # extended tier
    [pytest.param([13], id="13"), pytest.param([16], id="16", marks=pytest.mark.extended)],
)
def test_peer_forms_equal_one_process(lengths):
    # one model holding a block of each form: one compile per length
    runs = spawn(peer_worker, 2, [list(MATCHED)], lengths, timeout=900)
    runs += spawn(peer_worker, 2, [list(FLEX)], [13], False, timeout=900)
    # skipped attentions keep the model's answer (they ran with other heads' values before)
    skipped = spawn(peer_worker, 2, [list(SKIPPED)], [13], timeout=900)
    for r in (r for per_rank in skipped for r in per_rank):
        assert r["out_err"] < 1e-5 and r["grad_err"] < 1e-5, r
        assert [e[2] for e in r["entries"] if e[0] == "attention"] == ["skipped"] * 3, r
    for per_rank in runs:
        for r in per_rank:
            assert r["level"] == "tsp", r
            assert all(status == "matched" for _, _, status, _ in r["entries"]), r
            assert r["out_err"] < 1e-5 and r["grad_err"] < 1e-5, r
