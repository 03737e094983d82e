"""Train the reference model on a 2-D mesh: TSP inside a node, fully sharded data parallel across.

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        --rdzv-id job1 samples/train_fsdp_2d.py --out result.pt

Each node's processes form one TSP axis (D = processes per node); the nodes form the
data-parallel axis (dp = number of nodes), over which ``data_parallel="fsdp"`` also splits the
parameters, gradients and optimizer state: every parameter is a DTensor on the (dp, tsp) mesh.
Every dp rank trains on its own part of each global batch, with the ordinary loop
(``AdamW(model.parameters())``, ``clip_grad_norm_``, ``step``). Rank 0 writes the global
losses and the full trained state dict to ``--out``: ``tests/test_fsdp_2d.py`` compares them with
the same training in one process (``train_one_process``).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from samples.reference_model import build_reference_model  # noqa: E402
from samples.train_tsp import train_step  # noqa: E402 - the ordinary step: backward, clip, step

SEQ, BATCH, VOCAB = 16, 4, 256


def global_batches(steps: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen) for _ in range(steps)]


def train_one_process(steps: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same training, one process, no tspc: the whole global batch each step."""
    model = build_reference_model(seed=0, num_layers=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-4)
    losses = [train_step(model, opt, ids) for ids in global_batches(steps)]
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    import tspc

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--data-parallel", default="fsdp", choices=["fsdp", "replicate"])
    ap.add_argument("--out", default=None, help="rank 0 saves losses and the full state here")
    args = ap.parse_args(argv)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    if device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    per_node = int(os.environ["LOCAL_WORLD_SIZE"])
    nodes = dist.get_world_size() // per_node
    # torchrun numbers the ranks node by node, so the last mesh dim (tsp) stays inside a node
    mesh = init_device_mesh(device, (nodes, per_node), mesh_dim_names=("dp", "tsp"))
    model = build_reference_model(seed=0, num_layers=2).to(device)
    options = {"group": mesh, "mesh_dim": "tsp", "data_parallel": args.data_parallel}
    run = torch.compile(model, backend="tsp", options=options)
    opt = torch.optim.AdamW(run.parameters(), lr=1e-3, eps=1e-4)
    dp_rank = mesh.get_local_rank("dp")
    losses = []
    for ids in global_batches(args.steps):
        loss = torch.tensor(train_step(run, opt, ids.chunk(nodes)[dp_rank].to(device)))
        dist.all_reduce(loss, group=mesh.get_group("dp"))  # the mean over the global batch
        losses.append(loss.item() / nodes)
    state = tspc.state_dict(run)  # a collective: full tensors on every rank
    if dist.get_rank() == 0 and args.out:
        torch.save({"losses": losses, "state": state}, args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
