"""Ways of taking gradients that plain ``torch.compile`` supports, against one process (D = 2,
gloo): each crashed or was silently wrong under tspc until probing found it.

* gradient hooks put on parameters before the first call (``register_hook``,
  ``register_post_accumulate_grad_hook``): they were left on the replaced originals and never
  ran (``runtime/compat.copy_grad_hooks``);
* ``backward(retain_graph=True)`` then ``backward()``: aot_autograd refused the backward that
  tspc compiles with the forward, for the buffers it donated to it
  (``runtime/compat.donate_no_saved_buffers``);
* a penalty over ``model.parameters()`` added to the loss the graph returns (``loss + λ Σ
  p²``): the sum over tspc's DTensor parameters is a DTensor, whose gradient aot_autograd's
  backward refused at the graph's output (``runtime/autograd_glue.plain_tangents``). Added to a
  loss computed after the graph, the penalty must be made whole first (``.full_tensor()``), as
  with any DTensor parameters (FSDP2's too): autograd hands plain code a DTensor gradient;
* the first call under ``torch.inference_mode()``: the DTensor parameters were made as inference
  tensors, and the training that followed fell back and its optimizer step raised;
* ``copy.deepcopy(model)`` after the first call (``AveragedModel``, EMA copies): both ranks
  crashed copying a sharded weight's storage-less stand-in (``runtime/tsp_params._Records``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.distributed.tensor import DTensor

import tspc
from samples.reference_model import build_reference_model
from tests.helpers import error_message, grad_err_vs
from tests.test_training import WithLoss
from tspc.launch import spawn


def _loss(model, ids):
    return model(ids).pow(2).mean()


def _pair():
    torch.compiler.reset()
    ref = build_reference_model(seed=0, num_layers=2)
    model = copy.deepcopy(ref)
    return ref, model, torch.compile(model, backend="tsp")


def forms_worker(rank: int, world: int) -> dict:
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    out = {}

    # hooks registered before the first call, on a sharded and a replicated weight
    ref, model, compiled = _pair()
    calls = {"ref": 0, "tsp": 0}
    for key, m in (("ref", ref), ("tsp", model)):
        m.layers[0].mlp.down_proj.weight.register_hook(lambda g: g * 0.25)
        m.norm.weight.register_hook(lambda g: g * 4.0)
        for p in m.parameters():
            p.register_post_accumulate_grad_hook(
                lambda p, key=key: calls.__setitem__(key, calls[key] + 1)
            )
    for _ in range(2):
        _loss(ref, ids).backward()
        _loss(compiled, ids).backward()
    out["hooks"] = grad_err_vs(ref, model)
    out["post_accumulate_calls"] = (calls["ref"], calls["tsp"])
    # a deep copy of the model after its first call (AveragedModel, an EMA copy): the same
    # weights (it crashed both ranks, copying a sharded weight's storage-less stand-in)
    twin = copy.deepcopy(model)
    out["deepcopy"] = max(
        (a.full_tensor() - b.full_tensor()).abs().max().item()
        for a, b in zip(model.parameters(), twin.parameters())
    )
    out["deepcopy_called"] = error_message(lambda: twin(ids))  # tspc's error, not DTensor's

    # the first call under inference_mode (a check before training), then a training step:
    # the DTensor parameters were inference tensors, the next compile fell back, AdamW raised
    ref, model, compiled = _pair()
    with torch.inference_mode():
        compiled(ids)
    _loss(ref, ids).backward()
    _loss(compiled, ids).backward()
    out["after_inference_mode"] = grad_err_vs(ref, model)
    for m in (ref, model):
        torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-4).step()
    out["after_inference_mode_level"] = tspc.last_report().level

    # two backwards through one graph
    ref, model, compiled = _pair()
    for m in (ref, compiled):
        loss = _loss(m, ids)
        loss.backward(retain_graph=True)
        loss.backward()
    out["retain_graph"] = grad_err_vs(ref, model)

    # a penalty over the parameters (DTensors under tspc) added to a loss the graph returns,
    # and to one computed after the graph (the penalty made whole first, as with any DTensor
    # parameters: autograd cannot hand a DTensor gradient to plain code); AdamW on both
    for where in ("in_graph", "after_graph"):
        ref, model, _ = _pair()
        runs = [ref, model] if where == "after_graph" else [WithLoss(ref), WithLoss(model)]
        runs[1] = torch.compile(runs[1], backend="tsp")
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-4) for m in (ref, model)]
        errs = []
        for _ in range(2):
            for m, run, opt in zip((ref, model), runs, opts):
                opt.zero_grad()
                loss = _loss(run, ids) if where == "after_graph" else run(ids, ids)
                penalty = sum(p.pow(2).sum() for p in m.parameters())
                if where == "after_graph" and isinstance(penalty, DTensor):
                    penalty = penalty.full_tensor()
                (loss + 1e-2 * penalty).backward()
            errs.append(grad_err_vs(ref, model))
            for opt in opts:
                opt.step()
        out[f"penalty_{where}"] = max(errs)
    return out


@pytest.mark.slow
def test_hooks_retain_graph_and_parameter_penalties_equal_one_process():
    for r in spawn(forms_worker, 2, timeout=600):
        assert r["post_accumulate_calls"][0] == r["post_accumulate_calls"][1], r
        assert "eagerly" in r["deepcopy_called"], r
        assert r["deepcopy"] == 0.0 and r["after_inference_mode_level"] == "tsp", r
        for key in (
            "hooks",
            "after_inference_mode",
            "retain_graph",
            "penalty_in_graph",
            "penalty_after_graph",
        ):
            assert r[key] < 1e-5, (key, r)
