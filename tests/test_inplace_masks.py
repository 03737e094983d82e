"""A mask the model builds in place (``zeros(S, S).masked_fill_(...)``, ``full(...).triu_(1)``).

Dynamo's graph hands the attention the factory node, which a later in-place call writes: read
as what it computes, it is a mask of zeros. ``passes/functionalize_created.py`` writes such
calls out of place; before it, both models below ran at D = 2 with no mask at all (0.24-0.27
relative error, silently). Pass level: the graph before and after computes the same; gloo:
logits and gradients against one process.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import capture, grad_err_vs
from tspc.launch import spawn
from tspc.passes.functionalize_created import functionalize_created_tensors


class InPlaceMask(nn.Module):
    def __init__(self, variant: str) -> None:
        super().__init__()
        self.variant = variant
        self.emb = nn.Embedding(128, 64)
        self.qkv = nn.Linear(64, 192)
        self.o = nn.Linear(64, 64)
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 64)
        self.head = nn.Linear(64, 128)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        b, s = ids.shape
        x = self.emb(ids)
        q, k, v = self.qkv(x).view(b, s, 3, 4, 16).permute(2, 0, 3, 1, 4)
        upper = torch.ones(s, s, dtype=torch.bool, device=ids.device).triu(1)
        if self.variant == "masked_fill_":
            mask = torch.zeros(s, s, device=ids.device)
            mask.masked_fill_(upper, float("-inf"))
        elif self.variant == "triu_":
            mask = torch.full((s, s), float("-inf"), device=ids.device)
            mask.triu_(1)
        elif self.variant == "chained":
            mask = torch.zeros(s, s, device=ids.device)
            mask.masked_fill_(upper, float("-inf")).add_(0.0)
        else:  # "read before": the zeros are read (added) before the write
            mask = torch.zeros(s, s, device=ids.device)
            x = x + mask[0, 0]
            mask.masked_fill_(upper, float("-inf"))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, 64))
        x = x + self.down(F.gelu(self.up(x)))
        return self.head(x)


def _ids(s: int = 16) -> torch.Tensor:
    return torch.randint(1, 128, (2, s), generator=torch.Generator().manual_seed(s))


@pytest.mark.parametrize(
    "variant, rewritten", [("masked_fill_", 1), ("triu_", 1), ("chained", 2), ("read before", 0)]
)
def test_in_place_writes_to_fresh_tensors_are_written_out_of_place(variant, rewritten):
    torch.manual_seed(0)
    gm, inputs = capture(InPlaceMask(variant), _ids())
    (before,) = gm(*inputs)
    done = functionalize_created_tensors(gm)
    (after,) = gm(*inputs)
    assert len(done) == rewritten, done
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    left = [n for n in gm.graph.nodes if n.op == "call_method" and n.target.endswith("_")]
    assert len(left) == (1 if variant == "read before" else 0), left


def inplace_worker(rank: int, world: int) -> list[dict]:
    import tspc

    rows = []
    for variant in ("masked_fill_", "triu_"):
        torch.compiler.reset()
        torch.manual_seed(0)
        ref = InPlaceMask(variant)
        model = copy.deepcopy(ref)
        compiled = torch.compile(model, backend="tsp")
        for s in (16, 13):
            for p in list(ref.parameters()) + list(model.parameters()):
                p.grad = None
            got, expected = compiled(_ids(s)), ref(_ids(s))
            probe = torch.randn(got.shape, generator=torch.Generator().manual_seed(1))
            (got * probe).sum().backward()
            (expected * probe).sum().backward()
            rep = tspc.last_report()
            rows.append(
                {
                    "case": (variant, s),
                    "err": ((got - expected).abs().max() / expected.abs().max()).item(),
                    "grad_err": grad_err_vs(ref, model),
                    "level": rep.level,
                    "masks": [m["kind"] for m in rep.masks],
                }
            )
    return rows


@pytest.mark.slow
def test_masks_built_in_place_equal_one_process():
    for r in spawn(inplace_worker, 2, timeout=600)[0]:
        assert r["err"] < 1e-5 and r["grad_err"] < 1e-5, r
        assert r["level"] == "tsp" and r["masks"] == ["causal"], r
