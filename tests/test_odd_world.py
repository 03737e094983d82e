"""D = 3 (a world size that is not a power of two), and two user-facing paths no other test
checks by value: outputs left sharded (``outputs="sharded"``) hold exactly this rank's zigzag
tokens of the one-process output, and ``tspc.load_state_dict`` of new full weights after the
first call makes the compiled model compute with them. Against one process throughout."""

from __future__ import annotations

import pytest
import torch

from tspc.launch import spawn

MODEL = dict(hidden_size=96, num_heads=6, num_kv_heads=3, intermediate_size=192, num_layers=2)


def odd_world_worker(rank: int, world: int) -> dict:
    import tspc
    from samples.reference_model import build_reference_model
    from tests.helpers import grad_error

    out = {}
    seq = 4 * world * 2  # two tokens per zigzag chunk
    ids = torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(0))
    # a training step: loss and gradients equal one process
    ref = build_reference_model(seed=0, **MODEL)
    model = build_reference_model(seed=0, **MODEL)
    compiled = torch.compile(model, backend="tsp", options={"strict": True})
    loss = compiled(ids).float().pow(2).mean()
    loss.backward()
    ref_loss = ref(ids).float().pow(2).mean()
    ref_loss.backward()
    out["loss_err"] = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
    out["grad_err"] = grad_error(ref, model)[0]
    out["matched"] = len(tspc.last_report().matched)
    # new weights loaded after the first call: the compiled model uses them
    other = build_reference_model(seed=1, **MODEL)
    tspc.load_state_dict(compiled, other.state_dict())
    with torch.no_grad():
        got, want = compiled(ids), other(ids)
    out["loaded_err"] = ((got - want).abs().max() / want.abs().max()).item()
    # outputs left sharded: this rank's chunks p and 2D-1-p of the sequence, in that order
    torch.compiler.reset()
    model = build_reference_model(seed=0, **MODEL)
    sharded = torch.compile(model, backend="tsp", options={"outputs": "sharded"})
    with torch.no_grad():
        local = sharded(ids)
        dense = ref(ids)
    c = seq // (2 * world)
    mine = torch.cat(
        [dense[:, rank * c : (rank + 1) * c], dense[:, (2 * world - 1 - rank) * c :][:, :c]], 1
    )
    out["sharded_shape"] = tuple(local.shape)
    out["sharded_err"] = ((local - mine).abs().max() / mine.abs().max()).item()
    return out


@pytest.mark.slow
def test_three_ranks_train_load_weights_and_leave_outputs_sharded():
    for rank, r in enumerate(spawn(odd_world_worker, 3, timeout=900)):
        assert r["matched"] == 4, (rank, r)  # 2 layers x (attention, MLP), strict mode
        assert r["loss_err"] < 1e-5 and r["grad_err"] < 1e-5, (rank, r)
        assert r["loaded_err"] < 1e-5, (rank, r)
        assert r["sharded_shape"] == (2, 8, 256), (rank, r)
        assert r["sharded_err"] < 1e-5, (rank, r)
