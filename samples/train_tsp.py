"""Train the reference model with ``backend="tsp"`` on D gloo processes, next to one process.

    python samples/train_tsp.py --world-size 2 --steps 5

Every rank runs the same data through the ordinary loop: ``AdamW(model.parameters())`` built
before the first call, ``clip_grad_norm_``, ``step``. After the first call the parameters are
DTensors holding this rank's slices; after the last step DTensor's ``full_tensor`` rebuilds the
full model, which is compared with the same training run in one process without tspc.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from samples.cli import parser_with  # noqa: E402
from samples.reference_model import build_reference_model  # noqa: E402
from tspc.launch import spawn  # noqa: E402


def lm_loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def train_step(model, opt: torch.optim.Optimizer, ids: torch.Tensor) -> float:
    """The ordinary step, the same for the compiled model and the reference: returns the loss."""
    loss = lm_loss(model(ids), ids)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    return loss.item()


def run_rank(rank: int, world: int, args: dict) -> dict:

    kw = {"num_layers": args["layers"], "hidden_size": args["hidden"]}
    reference = build_reference_model(seed=0, **kw)
    net = build_reference_model(seed=0, **kw)
    model = torch.compile(net, backend="tsp")
    gen = torch.Generator().manual_seed(0)
    batches = [
        torch.randint(0, 256, (args["batch"], args["seq"]), generator=gen)
        for _ in range(args["steps"])
    ]
    # the ordinary idiom: after the first call these are DTensors holding this rank's slices
    opt = torch.optim.AdamW(model.parameters(), lr=args["lr"], eps=1e-4)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=args["lr"], eps=1e-4)
    losses, ref_losses = [], []
    for ids in batches:
        losses.append(train_step(model, opt, ids))
        ref_losses.append(train_step(reference, opt_ref, ids))
    full = {k: v.full_tensor() for k, v in net.state_dict().items()}  # DTensors, gathered
    diff = max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())
    owned = sum(p.to_local().numel() for p in net.parameters())
    total = sum(p.numel() for p in reference.parameters())
    return {
        "losses": losses,
        "ref_losses": ref_losses,
        "diff": diff,
        "owned": owned,
        "total": total,
    }


def main(argv: list[str] | None = None) -> int:
    p = parser_with(__doc__, world_size=2, steps=5, seq=32, batch=2, layers=2, hidden=64)
    p.add_argument("--lr", type=float, default=1e-3)
    a = p.parse_args(argv)
    results = spawn(run_rank, a.world_size, vars(a), timeout=900)
    r0 = results[0]
    print(f"{'step':>4s} {'tsp loss':>10s} {'1-proc loss':>12s}")
    for i, (x, y) in enumerate(zip(r0["losses"], r0["ref_losses"])):
        print(f"{i:4d} {x:10.6f} {y:12.6f}")
    for rank, r in enumerate(results):
        print(
            f"rank {rank}: optimizer owns {r['owned']:,} of {r['total']:,} parameters "
            f"({r['owned'] / r['total']:.0%})"
        )
    worst = max(r["diff"] for r in results)
    print(f"max |parameters - one process| after {a.steps} steps: {worst:.2e}")
    ok = worst < 1e-4
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
