"""The model called inside a compiled function, as plain ``torch.compile`` allows.

Found by probing (stop 41): ``torch.compile(loss_fn, backend="tsp")`` with ``loss_fn(model, x)``
calling the model, and ``torch.compile(train_step, backend="tsp")`` with the backward and
``opt.step()`` inside, crashed at their second call where a plain ``torch.compile`` runs —
the first with ``ReleasedParameterError`` (the model's modules held DTensors, and no module
call on the stack swapped the stand-ins in: tspc only knew the compiled module as its entry),
the second already at the optimizer step's graph, refused as "a model already sharded"
(its inputs are tspc's own DTensor parameters, gradients and AdamW state). Now the module the
function was handed takes the entry's role (``runtime/release.stack_root``), and a graph
over tspc's own DTensors compiles plainly (``tspc/fallback.compile_over_own_parameters``).
Checked against the same steps in one process without tspc.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from tspc.launch import spawn


def _loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def loss_fn(model, ids):
    return _loss(model(ids), ids)


def train_step(model, opt, ids):
    loss = _loss(model(ids), ids)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


def functions_worker(rank: int, world: int) -> dict:
    from torch.distributed.tensor import DTensor

    import tspc
    from samples.reference_model import build_reference_model
    from tests.helpers import grad_err_vs
    from tspc.report import REPORTS

    gen = torch.Generator().manual_seed(5)
    data = [torch.randint(0, 256, (2, 16), generator=gen) for _ in range(3)]
    out = {}

    # a compiled loss function handed the model: three calls, gradients accumulated
    torch.compiler.reset()
    ref = build_reference_model(seed=0, num_layers=2)
    model = copy.deepcopy(ref)
    compiled = torch.compile(loss_fn, backend="tsp")
    losses = []
    for ids in data:
        want, got = loss_fn(ref, ids), compiled(model, ids)
        want.backward()
        got.backward()
        losses.append(abs(want.item() - got.item()))
    out["loss_fn"] = {
        "loss_err": max(losses),
        "grad_err": grad_err_vs(ref, model),
        "level": tspc.last_report().level,
        "sharded": sum(isinstance(p, DTensor) for p in model.parameters()),
    }

    # the whole training step compiled, backward and AdamW step inside
    torch.compiler.reset()
    ref = build_reference_model(seed=0, num_layers=2)
    model = copy.deepcopy(ref)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    compiled = torch.compile(train_step, backend="tsp")
    losses = []
    for ids in data:
        want, got = train_step(ref, opt_ref, ids), compiled(model, opt, ids)
        losses.append(abs(want.item() - got.item()))
    full = tspc.state_dict(model)
    out["train_step"] = {
        "loss_err": max(losses),
        "param_err": max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items()),
        # the model's graph (the last report is of the graph after it: the loss)
        "matched": max(len(rep.matched) for rep in REPORTS),
        "sharded": sum(isinstance(p, DTensor) for p in model.parameters()),
    }
    return out


@pytest.mark.slow
def test_a_model_called_inside_a_compiled_function_trains_like_one_process():
    for r in spawn(functions_worker, 2, timeout=600):
        f, s = r["loss_fn"], r["train_step"]
        assert f["loss_err"] < 1e-5 and f["grad_err"] < 1e-5, f
        assert f["level"] == "tsp" and f["sharded"] > 0, f
        assert s["loss_err"] < 1e-5 and s["param_err"] < 1e-5, s
        assert s["matched"] == 4 and s["sharded"] > 0, s  # 2 layers: attention and MLP
