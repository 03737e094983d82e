"""Attention and MLP forms of libraries outside transformers (``tests/peer_forms.py``): fused
q/k/v with GQA, GQA repeated before RoPE, einsum attention and an einsum GLU chunked into gate
and up, values with their own head size, FlexAttention.

Graph-level at D = 2 (fake process group): each is matched (level 'tsp', every census item
matched), FlexAttention skipped with its reason. On gloo at D = 2: outputs and gradients equal
one process, at an even and an odd length.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import grad_error
from tests.peer_forms import VOCAB, PeerModel
from tspc.launch import spawn

MATCHED = ("fused_gqa", "tune_gqa", "einsum", "v_dim")


def _compile_report(form: str, length: int = 16):
    from tspc.backend import COMPILED

    model = PeerModel(form)
    with torch.no_grad():
        torch.compile(model, backend="tsp", fullgraph=True)(torch.randint(0, VOCAB, (2, length)))
    return COMPILED[-1].report


@pytest.mark.parametrize("form", MATCHED)
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


def test_flex_attention_is_listed_with_its_reason(fake_group):
    fake_group(0, 2)
    rep = _compile_report("flex")
    entries = {(e.kind, e.module): e for e in rep.entries}
    for i in (0, 1):
        attn = entries[("attention", f"layers.{i}.attn")]
        assert attn.status == "skipped" and "flex_attention" in attn.reason, rep.summary()
        assert entries[("mlp", f"layers.{i}.mlp")].status == "matched", rep.summary()
    assert rep.unlisted() == [], rep.summary()


def peer_worker(rank: int, world: int, forms: list, lengths: list[int]) -> list[dict]:
    import tspc

    out = []
    for form in forms:
        for length in lengths:
            torch._dynamo.reset()
            ref, model = PeerModel(form), PeerModel(form)
            gen = torch.Generator().manual_seed(length)
            ids = torch.randint(0, VOCAB, (2, length), generator=gen)
            probe = torch.randn(2, length, VOCAB, generator=gen)
            expected = ref(ids)
            (expected * probe).sum().backward()
            got = torch.compile(model, backend="tsp")(ids)
            (got * probe).sum().backward()
            rep = tspc.last_report()
            err, _ = grad_error(ref, model)
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


@pytest.mark.slow
def test_peer_forms_equal_one_process():
    # one model holding a block of each form: two compiles (an even and an odd length)
    for per_rank in spawn(peer_worker, 2, [list(MATCHED)], [16, 13], timeout=900):
        for r in per_rank:
            assert r["level"] == "tsp", r
            assert all(status == "matched" for _, _, status, _ in r["entries"]), r
            assert r["out_err"] < 1e-5 and r["grad_err"] < 1e-5, r
