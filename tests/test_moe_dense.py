"""MoE experts that run every expert on every token, input-scaled (Llama-4's form,
``passes/match_moe_dense.py``): matched by what the ops do, in more than one spelling, and
skipped with the reason where an unchosen expert would not add exactly zero.

The blocks here are written by hand, not by transformers (Llama-4 itself runs in
``tests/test_moe.py`` at D = 2 and 4 and in ``tests/test_generate_moe.py``). At D = 1 the
rewritten block (``moe_experts`` over each token's top-k pairs) is checked against the same
module run eagerly: outputs and every gradient.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import capture

E, K, H, F = 4, 2, 32, 24


class Experts(nn.Module):
    def __init__(self, bias_in_act: bool = False):
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(E, H, 2 * F) / H**0.5)
        self.down = nn.Parameter(torch.randn(E, F, H) / F**0.5)
        self.bias_in_act = bias_in_act

    def forward(self, rows):  # [E, N, h], expert-major
        gate, up = torch.bmm(rows, self.gate_up).chunk(2, dim=-1)
        act = nn.functional.silu(gate) * up
        if self.bias_in_act:
            act = act + 0.5  # an expert no longer maps 0 to 0
        return torch.bmm(act, self.down)


class EveryExpertMoE(nn.Module):
    """``y[n] = sum_e expert_e(x[n] * s[n, e])``, ``s`` the top-k scores written into a
    fill and mapped by ``g``; ``spelling`` picks how the scaled copies are written."""

    def __init__(self, fill=float("-inf"), g=torch.sigmoid, spelling="repeat", ids="topk", **kw):
        super().__init__()
        self.router = nn.Linear(H, E, bias=False)
        self.experts = Experts(**kw)
        self.fill, self.g, self.spelling, self.ids = fill, g, spelling, ids

    def forward(self, x):
        b, s, h = x.shape
        x = x.reshape(-1, h)
        logits = self.router(x)
        if self.ids == "topk":
            vals, idx = torch.topk(logits, K, dim=1)
        else:  # the same choice, not spelled as a top-k
            idx = torch.argsort(logits, dim=1, descending=True)[:, :K]
            vals = torch.gather(logits, 1, idx)
        scores = self.g(torch.full_like(logits, self.fill).scatter_(1, idx, vals))
        if self.spelling == "repeat":  # Llama-4's
            rows = x.repeat(E, 1) * scores.transpose(0, 1).reshape(-1, 1)
            rows = rows.view(E, -1, h)
        else:  # broadcast: x[None] * s.T[..., None]
            rows = x.unsqueeze(0).expand(E, -1, -1) * scores.t().unsqueeze(-1)
        out = self.experts(rows)
        return out.sum(dim=0).view(b, s, h)


class Block(nn.Module):
    """The MoE as a block of a model (its parameters under ``moe.``, as in a decoder layer)."""

    def __init__(self, **kw):
        super().__init__()
        self.moe = EveryExpertMoE(**kw)

    def forward(self, x):
        return x + self.moe(x)


def _match(model):
    from tspc.passes.analyse import analyse
    from tspc.passes.match_moe import match_moe

    gm, inputs = capture(model, torch.randn(2, 8, H))
    return match_moe(gm, analyse(gm, inputs), 2)


@pytest.mark.parametrize("spelling", ["repeat", "broadcast"])
def test_every_expert_block_is_matched_in_either_spelling(spelling):
    torch.manual_seed(0)
    matches, skips = _match(Block(spelling=spelling))
    assert not skips, skips
    (m,) = matches
    assert (m.form, m.experts, m.top_k, m.hidden, m.intermediate) == ("dense", E, K, H, F)


def test_zero_fill_and_no_map_is_matched():
    """Scores written into zeros (softmax-style weights, no sigmoid): also exact."""
    torch.manual_seed(0)
    matches, skips = _match(Block(fill=0.0, g=lambda t: t))
    assert not skips and matches[0].form == "dense", skips


@pytest.mark.parametrize(
    ("kwargs", "reason"),
    [
        # sigmoid(0) = 0.5: unchosen experts get half a token each
        ({"fill": 0.0}, "g(0.0) is not exactly 0"),
        ({"bias_in_act": True}, "maps a zero input to a nonzero output"),
        ({"ids": "argsort"}, "not a top-k's"),
    ],
)
def test_forms_an_unchosen_expert_would_change_are_skipped_with_the_reason(kwargs, reason):
    torch.manual_seed(0)
    matches, skips = _match(Block(**kwargs))
    assert not matches and len(skips) == 1, (matches, skips)
    assert "mixture of experts" in skips[0].reason and reason in skips[0].reason, skips[0]


@pytest.mark.parametrize("spelling", ["repeat", "broadcast"])
def test_rewritten_block_equals_the_model_outputs_and_gradients(spelling):
    """At D = 1 the block runs as ``moe_experts`` over each token's k choices: the same
    output and gradients (hidden state, router, both stacked weights) as every expert on
    every token, eagerly."""
    import tspc

    torch.manual_seed(0)
    ref = Block(spelling=spelling)
    model = Block(spelling=spelling)
    model.load_state_dict(ref.state_dict())
    x = torch.randn(2, 8, H, generator=torch.Generator().manual_seed(1))
    x_ref, x_got = x.clone().requires_grad_(), x.clone().requires_grad_()
    probe = torch.randn(2, 8, H, generator=torch.Generator().manual_seed(2))
    want = ref(x_ref)
    (want * probe).sum().backward()
    torch.compiler.reset()
    got = torch.compile(model, backend="tsp", options={"inner": "aot_eager"})(x_got)
    (got * probe).sum().backward()
    forms = [e.details.get("form") for e in tspc.last_report().entries if e.kind == "mlp"]
    assert forms == ["moe (expert parallel)"], tspc.last_report().summary()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x_got.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    for (name, p_ref), p in zip(ref.named_parameters(), model.parameters()):
        torch.testing.assert_close(p.grad, p_ref.grad, rtol=1e-5, atol=1e-6, msg=name)
