"""``data_parallel="fsdp"`` on a 2-D (dp, tsp) = (2, 2) mesh of 4 gloo ranks, against one process.

Each dp rank trains on its own half of the global batch; the one-process reference trains on the
whole batch with the same loss normalisation (the mean over all tokens). Checked in one spawn:
the parameters are 2-D DTensors on the mesh, the losses, gradients, ``clip_grad_norm_`` norms
and three AdamW steps equal one process, and the optimizer state each rank keeps is measured
(bytes of its live storages) against one process's.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tspc.launch import spawn

SEQ = 16


def lm_loss(logits, ids):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def global_batches(steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, 256, (4, SEQ), generator=gen) for _ in range(steps)]


def state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the distinct storages the optimizer's state holds on this rank (a DTensor's
    local tensor: what this rank keeps)."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, DTensor):
                v = v.to_local()
            if isinstance(v, torch.Tensor) and v.dim() > 0:
                s = v.untyped_storage()
                seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def fsdp_mesh_model(options: dict | None = None):
    from torch.distributed.device_mesh import init_device_mesh

    from samples.reference_model import build_reference_model

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tsp"))
    model = build_reference_model(seed=0, num_layers=2)
    opts = {"group": mesh, "mesh_dim": "tsp", "data_parallel": "fsdp", **(options or {})}
    return mesh, model, torch.compile(model, backend="tsp", options=opts)


def train_worker(rank: int, world: int) -> dict:
    from torch.distributed.tensor import DTensor

    from samples.reference_model import build_reference_model

    mesh, model, run = fsdp_mesh_model()
    dp_rank = mesh.get_local_rank("dp")
    ref = build_reference_model(seed=0, num_layers=2)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-4)
    opt = torch.optim.AdamW(run.parameters(), lr=1e-3, eps=1e-4)  # before the first call
    out = {"loss_err": 0.0, "grad_err": 0.0, "norm_err": 0.0}
    for ids in global_batches(3):
        mine = ids[2 * dp_rank : 2 * dp_rank + 2]
        ref_loss = lm_loss(ref(ids), ids)
        ref_loss.backward()
        ref_grads = {n: q.grad.clone() for n, q in ref.named_parameters()}
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        loss = lm_loss(run(mine), mine)
        loss.backward()
        grads = {n: p.grad.full_tensor() for n, p in model.named_parameters()}
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        # the global loss: the mean of the dp ranks' means (equal batch sizes)
        glob = loss.detach().clone()
        torch.distributed.all_reduce(glob, group=mesh.get_group("dp"))
        out["loss_err"] = max(out["loss_err"], abs(glob.item() / 2 - ref_loss.item()))
        out["norm_err"] = max(out["norm_err"], abs(norm.item() - ref_norm.item()))
        for n, g in ref_grads.items():
            err = (grads[n] - g).abs().max().item() / g.abs().max().item()
            out["grad_err"] = max(out["grad_err"], err)
        opt_ref.step()
        opt_ref.zero_grad()
        opt.step()
        opt.zero_grad()
    out["param_err"] = max(
        (p.full_tensor() - q).abs().max().item()
        for (_, p), (_, q) in zip(model.named_parameters(), ref.named_parameters())
    )
    out["placements"] = {
        n: (p.device_mesh.mesh_dim_names, [str(x) for x in p.placements])
        for n, p in model.named_parameters()
    }
    out["opt_bytes"], out["ref_opt_bytes"] = state_bytes(opt), state_bytes(opt_ref)
    return out


@pytest.mark.slow
def test_fsdp_2d_trains_like_one_process():
    results = spawn(train_worker, 4, timeout=600)
    for r in results:
        assert r["loss_err"] < 1e-5, r
        assert r["grad_err"] < 1e-4, r
        assert r["norm_err"] < 1e-5, r
        assert r["param_err"] < 1e-5, r
        for name, (dims, placements) in r["placements"].items():
            assert dims == ("dp", "tsp"), name
            assert placements[0].startswith("Shard"), (name, placements)
        # optimizer state: 1/(dp x D) of one process's, within 10%
        ratio = r["opt_bytes"] * 4 / r["ref_opt_bytes"]
        assert 0.9 < ratio < 1.1, (ratio, r["opt_bytes"], r["ref_opt_bytes"])
