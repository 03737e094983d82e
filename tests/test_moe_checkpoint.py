"""A mixture-of-experts model checkpoints like a dense one (issue 27): DCP save at D = 2, load at
D = 4 and in one plain process, with the optimizer state, and the third step equals uninterrupted
training in one process without tspc. Mixtral with E = 3 experts, uneven at D = 2 and D = 4. The stacked experts are ``Shard(0)`` DTensors on the TSP
axis, so DCP reshards them by itself. The weights' live storages per rank at D = 2 are measured
against one process's.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests.test_moe import build as build_moe
from tests.test_training_idioms import (
    _same_third_step,
    _step,
    _third_step,
    adamw,
    batches,
    resume_third_step,
    train_and_save,
)
from tspc.launch import spawn

# E = 3: uneven on both meshes (torch.chunk: 2 + 1 experts at D = 2, 1 + 1 + 1 + 0 at D = 4)
MOE = {"num_local_experts": 3}


def _logits(m, ids):
    return m(input_ids=ids).logits


def moe_save_worker(rank: int, world: int, root: str) -> dict:
    from tspc.tools.memory import state_bytes

    warnings.filterwarnings("ignore")
    torch.compiler.reset()
    data = batches(3, seq=16)
    model = build_moe("mixtral", **MOE)
    one_process = state_bytes(build_moe("mixtral", **MOE))["parameters"]
    compiled, opt = train_and_save(model, _logits, f"{root}/mixtral")
    import tspc

    mlp = [e.status for e in tspc.last_report().entries if e.kind == "mlp"]
    return {
        "weights_ratio": state_bytes(model)["parameters"] / one_process,
        "mlp": mlp,
        **_third_step(compiled, _logits, opt, data[2]),
    }


def moe_load_worker(rank: int, world: int, args: tuple[str, str]) -> dict:
    """As ``test_training_idioms.load_worker``: ``when="before"`` loads into the plain model
    before the first call, ``"after"`` into the DTensors."""
    warnings.filterwarnings("ignore")
    root, when = args
    torch.compiler.reset()
    model = build_moe("mixtral", seed=1, **MOE)  # other weights: everything comes from the file
    return resume_third_step(model, _logits, f"{root}/mixtral", world, when, "aot_eager")


@pytest.mark.slow
@pytest.mark.extended
def test_moe_dcp_round_trip_2_to_4_to_one_process(tmp_path):
    root = str(tmp_path)
    saved = spawn(moe_save_worker, 2, root, timeout=900)
    resumed = spawn(moe_load_worker, 4, (root, "after"), timeout=900)
    resumed += spawn(moe_load_worker, 4, (root, "before"), timeout=900)
    resumed.append(moe_load_worker(0, 1, (root, "")))  # plain: no tspc, no process group

    ref = build_moe("mixtral", **MOE)
    opt = adamw(ref.parameters())
    data = batches(3, seq=16)
    for ids in data[:2]:
        _step(ref, _logits, opt, ids)
    want3 = _third_step(ref, _logits, opt, data[2])
    for i, r in enumerate(saved + resumed):
        _same_third_step(r, want3, ("saved" if i < len(saved) else "resumed", i))
    for r in saved:
        assert r["mlp"] and all(s == "matched" for s in r["mlp"]), r["mlp"]
    # the experts hold most of the weights: 1/D of them per rank
    ratios = [r["weights_ratio"] for r in saved]
    print(f"MoE weights per rank at D = 2 / one process: {ratios}")
    assert all(x < 0.75 for x in ratios), ratios
