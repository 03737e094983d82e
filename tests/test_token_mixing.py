"""Ops that mix tokens, in models nobody on the team wrote: each against one process.

Every op below reads other tokens than its own — a running sum, a shift, a causal convolution
(Mamba's short conv), a roll, a sort or top-k over the sequence, a gather or scatter along it,
a token-by-token product — and sits twice in a small causal model (before the attention and
after it). The sequence pass must either keep it token-wise with the right halo or gather what
it reads; either way logits and every gradient equal one process, at a length that splits into
2D chunks (16) and one that is padded (13), at D = 2 (the extended tier: the suite runs the one
below).

Found here: with a convolution in the graph, Inductor's layout optimisation stored a saved
activation channels-last while the backward read it as contiguous — the second compile (a
symbolic length) crashed where a plain ``torch.compile`` runs (fixed in ``tspc/inner.py``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import TinyLM, against_one_process, compiled_copy
from tspc.launch import spawn


def _arange(x: torch.Tensor, *args) -> torch.Tensor:
    return torch.arange(*args, device=x.device)


MIXES = {
    "cumsum": lambda m, x: x.cumsum(1) / _arange(x, 1, x.shape[1] + 1).view(1, -1, 1),
    "flip": lambda m, x: x.flip(1),
    "roll": lambda m, x: torch.roll(x, 1, dims=1),
    "causal conv": lambda m, x: F.conv1d(
        F.pad(x.transpose(1, 2), (2, 0)), m.conv, groups=x.shape[-1]
    ).transpose(1, 2),
    "shift by cat": lambda m, x: torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1),
    "shift by pad": lambda m, x: F.pad(x, (0, 0, 1, 0))[:, :-1],
    "mean": lambda m, x: x.mean(1, keepdim=True),
    "top-k": lambda m, x: x.topk(3, dim=1).values.mean(1, keepdim=True),
    "gather": lambda m, x: torch.gather(x, 1, x.argmax(1, keepdim=True)),
    "stride": lambda m, x: x[:, ::2].repeat_interleave(2, dim=1)[:, : x.shape[1]],
    "unfold": lambda m, x: F.pad(x, (0, 0, 1, 0)).unfold(1, 2, 1).mean(-1),
    "reverse index": lambda m, x: x.index_select(1, _arange(x, x.shape[1] - 1, -1, -1)),
    "diff": lambda m, x: torch.diff(x, dim=1, prepend=x[:, :1]),
    "last token": lambda m, x: x[:, -1:],
    "cummax": lambda m, x: x.cummax(1).values,
    "positions": lambda m, x: m.pos(_arange(x, x.shape[1])),
    "sort": lambda m, x: x.sort(1).values,
    "token product": lambda m, x: torch.softmax(x @ x.transpose(1, 2) / 8, -1) @ x,
    "logcumsumexp": lambda m, x: torch.logcumsumexp(x, 1),
    "first token": lambda m, x: x[:, :1].expand_as(x),
    "scatter_add": lambda m, x: torch.zeros_like(x).scatter_add(
        1, (_arange(x, x.shape[1]) // 2).view(1, -1, 1).expand_as(x), x
    ),
}


class TokenMixer(TinyLM):
    def __init__(self, mix: str) -> None:
        super().__init__()
        self.mix = mix
        if mix == "positions":
            self.pos = nn.Embedding(64, 64)
        if mix == "causal conv":
            self.conv = nn.Parameter(torch.randn(64, 1, 3) * 0.3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        x = x + MIXES[self.mix](self, x)
        x = x + self.attention(x, is_causal=True)
        x = x + MIXES[self.mix](self, x)
        x = x + self.mlp(x)
        return self.head(x)


def mixing_worker(rank: int, world: int, cases: dict) -> list[dict]:
    import tspc

    rows = []
    for mix, lengths in cases.items():
        # the suite's inner compiler is aot_eager (conftest); the conv runs under Inductor,
        # as users get it by default
        options = {"inner": "inductor"} if mix == "causal conv" else {}
        ref, model, compiled = compiled_copy(TokenMixer, mix, options=options)
        for s in lengths:
            ids = torch.randint(1, 128, (2, s), generator=torch.Generator().manual_seed(s))
            err, grad_err = against_one_process(ref, model, compiled, ids)
            rows.append(
                {
                    "case": (mix, s),
                    "err": err,
                    "grad_err": grad_err,
                    "level": tspc.last_report().level,
                }
            )
    return rows


def _check(rows: list[dict]) -> None:
    for r in rows:
        assert r["err"] < 1e-5 and r["grad_err"] < 1e-5, r
        assert r["level"] == "tsp", r


@pytest.mark.slow
def test_causal_conv_under_inductor_at_a_second_length():
    # the recompile with a symbolic length (the crash above; D = 1 crashed as D = 2 did)
    _check(spawn(mixing_worker, 1, {"causal conv": (16, 12)}, timeout=900)[0])


@pytest.mark.extended
def test_every_token_mixing_op_equals_one_process():
    _check(spawn(mixing_worker, 2, {m: (16, 13) for m in MIXES}, timeout=1800)[0])
