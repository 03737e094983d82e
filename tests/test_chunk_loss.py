"""The head + cross-entropy in token chunks (``passes/chunk_loss.py``, ``runtime/chunked_loss.py``).

Checked against torch without tspc: ``F.cross_entropy(F.linear(x, W, b).float(), t)`` and its
autograd gradients (one process), and the same model run in one process against a D = 2 gloo
run whose loss the pass chunked (loss and every gradient).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import grad_error
from tspc.launch import spawn
from tspc.runtime.chunked_loss import ChunkedLinearCrossEntropy


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_chunked_function_equals_cross_entropy(dtype):
    torch.manual_seed(0)
    n, h, v = 11, 8, 13
    x = torch.randn(n, h, dtype=dtype, requires_grad=True)
    w = torch.randn(v, h, dtype=dtype, requires_grad=True)
    b = torch.randn(v, dtype=dtype, requires_grad=True)
    t = torch.randint(0, v, (n,))
    t[[2, 7]] = -100  # ignored tokens count for nothing
    ldt = torch.float64 if dtype == torch.float64 else torch.float32  # bf16 logits upcast
    ref = F.cross_entropy(F.linear(x, w, b).to(ldt), t, ignore_index=-100, reduction="sum")
    (ref * 3).backward()
    want = [p.grad.clone() for p in (x, w, b)]
    for p in (x, w, b):
        p.grad = None
    got = ChunkedLinearCrossEntropy.apply(x, w, b, t, -100, ldt, 4)  # 3 chunks
    (got * 3).backward()
    tol = 1e-9 if dtype == torch.float64 else 3e-2
    assert abs(got.item() - ref.item()) <= tol * max(1.0, abs(ref.item()))
    for g, r in zip((x.grad, w.grad, b.grad), want):
        assert g.dtype == dtype
        assert (g.float() - r.float()).abs().max() <= tol * r.float().abs().max().clamp_min(1)
    with torch.no_grad():  # evaluation: the loss only
        assert abs(ChunkedLinearCrossEntropy.apply(x, w, b, t, -100, ldt, 4).item()
                   - ref.item()) <= tol * max(1.0, abs(ref.item()))  # fmt: skip


class HeadLoss(torch.nn.Module):
    """transformers' spelling: logits upcast, labels shifted with a pad, ``reduction`` sum / n."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, labels):
        logits = self.model(ids).float()
        labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
        loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), labels.reshape(-1),
                               ignore_index=-100, reduction="sum")  # fmt: skip
        return loss / (labels != -100).sum()


class NllLoss(torch.nn.Module):
    """``log_softmax`` then ``nll_loss``, mean over the tokens."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, labels):
        logp = F.log_softmax(self.model(ids).float(), dim=-1)
        return F.nll_loss(logp.flatten(0, 1), labels.flatten())


def chunk_worker(rank: int, world: int) -> dict:
    import tspc
    from samples.reference_model import build_reference_model
    from tspc.backend import COMPILED

    out = {}
    for wrap, recompute in ((HeadLoss, "none"), (HeadLoss, "full"), (NllLoss, "none")):
        torch.compiler.reset()
        COMPILED.clear()
        ref = build_reference_model(seed=0, num_layers=1)
        model = build_reference_model(seed=0, num_layers=1)
        torch.manual_seed(5)
        ids = torch.randint(0, 256, (2, 30))  # 60 tokens: padded to 64, 32 a rank
        labels = ids.clone()
        labels[0, :5] = -100
        run = torch.compile(wrap(model), backend="tsp",
                            options={"loss_chunk": 7, "recompute": recompute})  # fmt: skip
        loss_ref, loss = wrap(ref)(ids, labels), run(ids, labels)
        loss_ref.backward()
        loss.backward()
        notes = [n for r in tspc.report.reports_after(-1) for n in r.notes]
        out[f"{wrap.__name__} {recompute}"] = {
            "loss_err": abs(loss.item() - loss_ref.item()),
            "grad_err": grad_error(ref, model)[0],
            "chunked": [n for n in notes if "cross-entropy in" in n],
        }
    return out


@pytest.mark.slow
def test_chunked_loss_equals_one_process_d2():
    for res in spawn(chunk_worker, 2):
        for case, r in res.items():
            assert r["chunked"] and "5 chunk(s) of 7 tokens" in r["chunked"][-1], (case, r)
            assert r["loss_err"] < 1e-5, (case, r)
            assert r["grad_err"] < 1e-4, (case, r)
