"""``torch.nn.MultiheadAttention`` (and the encoder layers built on it) under TSP.

``passes/canonicalize_mha.py`` writes torch's fused ``F.multi_head_attention_forward`` call out
as projections around SDPA. The pass-level tests run Dynamo's graph of a model before and after
the pass on the same inputs: torch's own call is the reference for every mask rule (the
``is_causal`` hint, float / bool / per-head masks, a key padding mask, ``need_weights``,
sequence-first layout). The gloo run checks logits and every gradient against one process.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import capture, compiled_copy, grad_err_vs
from tspc.launch import spawn
from tspc.passes.canonicalize_mha import canonicalize_mha


class Encoder(nn.Module):
    """``nn.TransformerEncoder`` as a language model: embedding, encoder layers, a head."""

    def __init__(
        self,
        layers: int = 1,
        batch_first: bool = True,
        norm_first: bool = True,
        mask: str = "float",  # "float" (generate_square_subsequent_mask), "bool", "heads", "none"
        is_causal: bool = True,
        padding: bool = False,
    ) -> None:
        super().__init__()
        self.emb = nn.Embedding(128, 64)
        layer = nn.TransformerEncoderLayer(
            64, 4, 128, dropout=0.0, batch_first=batch_first, norm_first=norm_first
        )
        self.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(64, 128)
        self.batch_first, self.mask, self.is_causal, self.padding = (
            batch_first,
            mask,
            is_causal,
            padding,
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        x = self.emb(ids)
        if not self.batch_first:
            x = x.transpose(0, 1)
        upper = torch.ones(s, s, dtype=torch.bool, device=ids.device).triu(1)
        mask = {
            "float": nn.Transformer.generate_square_subsequent_mask(s, device=ids.device),
            "bool": upper,
            "heads": upper.expand(b * 4, s, s),  # [B*H, L, S]
            "none": None,
        }[self.mask]
        pad = (ids == 0) if self.padding else None
        y = self.enc(x, mask=mask, is_causal=self.is_causal, src_key_padding_mask=pad)
        if not self.batch_first:
            y = y.transpose(0, 1)
        return self.head(y)


class DirectMha(nn.Module):
    """``nn.MultiheadAttention`` called as ``attn(x, x, x)``: ``need_weights=True`` (its
    default), the weights dropped; or variants the pass leaves as they are."""

    def __init__(self, variant: str = "plain") -> None:
        super().__init__()
        self.variant = variant
        self.emb = nn.Embedding(128, 64)
        kw = {"add_bias_kv": True} if variant == "bias_kv" else {}
        if variant == "dropout":
            kw["dropout"] = 0.1
        self.attn = nn.MultiheadAttention(64, 4, batch_first=True, **kw)
        self.mlp = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
        self.head = nn.Linear(64, 128)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        s = ids.shape[1]
        x = self.emb(ids)
        mask = torch.ones(s, s, dtype=torch.bool, device=ids.device).triu(1)
        kv = x * 2 if self.variant == "cross" else x
        a, w = self.attn(x, kv, kv, attn_mask=mask)
        if self.variant == "weights":
            a = a + w.sum(-1, keepdim=True)
        x = x + a
        return self.head(x + self.mlp(x))


class DirectCall(nn.Module):
    """``F.multi_head_attention_forward`` called directly, as a model may: the mask rules the
    modules never reach (they hand it float masks). The mask is random, not causal, so that
    whether the ``is_causal`` hint replaced it shows in the output."""

    def __init__(self, mask: str, padding: bool, is_causal: bool, need_weights: bool) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(64, 4)
        self.emb = nn.Embedding(128, 64)
        hidden = torch.rand(16, 16, generator=torch.Generator().manual_seed(0)) < 0.3
        self.register_buffer("hidden", hidden.fill_diagonal_(False))  # every query sees a key
        self.mask, self.padding, self.is_causal, self.need_weights = (
            mask,
            padding,
            is_causal,
            need_weights,
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        x = self.emb(ids).transpose(0, 1)  # [L, B, E]
        hidden = self.hidden[:s, :s]
        mask = hidden if self.mask == "bool" else torch.zeros(s, s).masked_fill(hidden, -1e4)
        pad = ids == 0
        if self.mask == "float" and self.padding:
            pad = torch.zeros(b, s).masked_fill(pad, float("-inf"))
        a = self.attn
        out, _ = torch.nn.functional.multi_head_attention_forward(
            x, x, x, 64, 4, a.in_proj_weight, a.in_proj_bias, None, None, False, 0.0,
            a.out_proj.weight, a.out_proj.bias, training=self.training,
            key_padding_mask=pad if self.padding else None, need_weights=self.need_weights,
            attn_mask=mask, is_causal=self.is_causal,
        )  # fmt: skip
        return out


def _ids(s: int = 16, padding: bool = False) -> torch.Tensor:
    ids = torch.randint(1, 128, (2, s), generator=torch.Generator().manual_seed(s))
    if padding:
        ids[1, :3] = 0
    return ids


def _before_and_after(model: nn.Module, ids: torch.Tensor):
    torch.manual_seed(0)
    gm, inputs = capture(model, ids)
    before = gm(*inputs)
    calls = canonicalize_mha(gm)
    after = gm(*inputs)
    return calls, before, after, gm


WRITTEN_OUT = {
    "causal hint": dict(),
    "sequence first, post-norm": dict(batch_first=False, norm_first=False),
    "float mask, no hint": dict(is_causal=False),
    "bool mask": dict(mask="bool", is_causal=False),
    "per-head mask": dict(mask="heads", is_causal=False),
    "key padding": dict(mask="bool", padding=True),
    "no mask": dict(mask="none", is_causal=False),
}


@pytest.mark.parametrize("name", list(WRITTEN_OUT))
def test_the_call_written_out_computes_what_torchs_call_does(name):
    torch.manual_seed(0)
    model = Encoder(layers=2, **WRITTEN_OUT[name]).eval()
    padding = WRITTEN_OUT[name].get("padding", False)
    calls, before, after, gm = _before_and_after(model, _ids(padding=padding))
    assert [c.replaced for c in calls] == [True, True], calls
    assert not any("multi_head_attention_forward" in str(n.target) for n in gm.graph.nodes)
    sdpa = [n for n in gm.graph.nodes if "scaled_dot_product_attention" in str(n.target)]
    assert len(sdpa) == 2
    (before,), (after,) = before, after
    both = torch.isfinite(before)  # a query row the key padding hides from every key
    assert torch.equal(both, torch.isfinite(after))
    assert (before[both] - after[both]).abs().max() <= 1e-5 * before[both].abs().max()


@pytest.mark.parametrize("mask", ["bool", "float"])
@pytest.mark.parametrize(
    "padding, is_causal, need_weights",
    [(False, False, False), (False, True, False), (True, True, False), (False, True, True)],
)
def test_direct_calls_follow_torchs_mask_rules(mask, padding, is_causal, need_weights):
    # the hint replaces the mask only without key padding and weights; a bool mask hides True
    model = DirectCall(mask, padding, is_causal, need_weights)
    calls, before, after, _ = _before_and_after(model, _ids(padding=padding))
    assert [c.replaced for c in calls] == [True], calls
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)


def test_need_weights_with_the_weights_unused_is_written_out():
    calls, before, after, gm = _before_and_after(DirectMha().train(), _ids())
    assert [(c.module, c.replaced) for c in calls] == [("attn", True)]
    (sdpa,) = [n for n in gm.graph.nodes if "scaled_dot_product_attention" in str(n.target)]
    assert sdpa.meta["tspc_canonical"] == "eager_attention"  # torch's explicit softmax
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "variant, reason",
    [
        ("cross", "cross-attention"),
        ("bias_kv", "bias_k/bias_v"),
        ("dropout", "dropout on the attention weights while training"),
        ("weights", "its attention weights are used"),
    ],
)
def test_what_it_cannot_write_out_is_left_with_the_reason(variant, reason):
    calls, before, after, gm = _before_and_after(DirectMha(variant).train(), _ids())
    assert len(calls) == 1 and not calls[0].replaced and reason in calls[0].reason, calls
    assert any("multi_head_attention_forward" in str(n.target) for n in gm.graph.nodes)


# --------------------------------------------------------------------------- gloo, D = 2

CASES = {
    "encoder, causal hint": (dict(layers=2), (16, 13)),
    "encoder, key padding": (dict(mask="bool", padding=True), (16,)),
    "nn.MultiheadAttention, need_weights": (None, (13,)),
}


def mha_worker(rank: int, world: int) -> list[dict]:
    import tspc

    rows = []
    for name, (kw, lengths) in CASES.items():
        ref, model, compiled = (
            compiled_copy(Encoder, **kw) if kw is not None else compiled_copy(DirectMha)
        )
        for s in lengths:
            ids = _ids(s, padding=bool(kw and kw.get("padding")))
            for p in list(ref.parameters()) + list(model.parameters()):
                p.grad = None
            got, expected = compiled(ids), ref(ids)
            probe = torch.randn(got.shape, generator=torch.Generator().manual_seed(1))
            real = torch.isfinite(expected)
            (got[real] * probe[real]).sum().backward()
            (expected[real] * probe[real]).sum().backward()
            rep = tspc.last_report()
            rows.append(
                {
                    "case": (name, s),
                    "same_rows": torch.equal(real, torch.isfinite(got)),
                    "err": ((got - expected)[real].abs().max() / expected[real].abs().max()).item(),
                    "grad_err": grad_err_vs(ref, model),
                    "level": rep.level,
                    "entries": [(e.kind, e.module, e.status) for e in rep.entries],
                    "masks": [(m["kind"], m["recognised"], m["detail"]) for m in rep.masks],
                }
            )
    return rows


@pytest.mark.slow
def test_torch_encoder_layers_run_tsp_and_equal_one_process():
    for r in spawn(mha_worker, 2, timeout=600)[0]:
        assert r["same_rows"] and r["err"] < 1e-5 and r["grad_err"] < 1e-5, r
        assert r["level"] == "tsp", r
        attention = [e for e in r["entries"] if e[0] == "attention"]
        assert attention and all(e[2] == "matched" for e in r["entries"]), r
        if r["case"][0] == "encoder, key padding":
            # torch adds the causal mask and the key padding mask (both -inf where masked):
            # read as one causal + key padding mask, so the zigzag kernel runs it (no S x S)
            assert all(m[1] and "key padding" in m[2] for m in r["masks"]), r
