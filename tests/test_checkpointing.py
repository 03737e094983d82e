"""Activation checkpointing where the model asks for it: the regions are inlined for the
matchers and stay tagged for recompute; gradients equal one process."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from samples.reference_model import RefModel, build_reference_model
from tests.helpers import grad_error
from tspc.launch import spawn


class CheckpointedRefModel(RefModel):
    """The reference model with every decoder block under torch.utils.checkpoint."""

    def __init__(self, cfg):
        super().__init__(cfg)
        for layer in self.layers:
            forward = layer.forward
            layer.forward = lambda *a, f=forward: checkpoint(f, *a, use_reentrant=False)


def ac_worker(rank: int, world: int) -> dict:
    import tspc
    from tspc.backend import COMPILED

    ref = build_reference_model(seed=0, num_layers=2)
    model = CheckpointedRefModel(ref.cfg)
    model.load_state_dict(ref.state_dict())
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(model, backend="tsp")
    loss = compiled(ids).float().pow(2).mean()
    loss.backward()
    ref(ids).float().pow(2).mean().backward()
    rep = tspc.last_report()
    fwd = COMPILED[-1].aot.forward_gms[0]
    tagged = sum(1 for n in COMPILED[-1].pipeline.gm.graph.nodes if "recompute" in n.meta)
    err, _ = grad_error(ref, model)
    saved = len([a for a in next(n for n in fwd.graph.nodes if n.op == "output").args[0]])
    return {
        "matched": sorted(e.module for e in rep.matched),
        "notes": rep.notes,
        "tagged": tagged,
        "err": err,
        "saved": saved,
    }


@pytest.mark.slow
def test_checkpointed_blocks_are_matched_and_gradients_equal_one_process():
    for r in spawn(ac_worker, 2, timeout=600):
        assert len(r["matched"]) == 4, r
        assert any("activation-checkpoint" in n for n in r["notes"]), r["notes"]
        assert r["tagged"] > 0
        assert r["err"] < 1e-5, r
