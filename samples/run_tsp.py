"""Compile the reference model with ``backend="tsp"`` on D gloo processes and check it.

    python samples/run_tsp.py --world-size 2 --seq 64 --batch 2

Each rank builds the same model (same seed), runs it once without tspc (the single-device
reference) and once through ``torch.compile(model, backend="tsp")``, and reports what the
backend matched, what it communicated (measured by the runtime's counters, next to the
schedule's prediction) and the largest difference from the reference.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from samples.cli import parser_with  # noqa: E402
from samples.reference_model import build_reference_model  # noqa: E402
from tspc.launch import spawn  # noqa: E402


def run_rank(rank: int, world: int, args: dict) -> dict:
    import tspc
    from tspc.runtime.counters import COUNTER

    model_kw = dict(
        num_layers=args["layers"],
        hidden_size=args["hidden"],
        num_heads=args["heads"],
        num_kv_heads=args["kv_heads"],
        intermediate_size=args["intermediate"],
        mask=args["mask"],
    )
    reference = build_reference_model(seed=0, **model_kw)
    model = build_reference_model(seed=0, **model_kw)
    torch.manual_seed(123)  # the same tokens on every rank
    ids = torch.randint(0, reference.cfg.vocab_size, (args["batch"], args["seq"]))
    with torch.no_grad():
        expected = reference(ids)
    compiled = torch.compile(model, backend="tsp", options={"inner": args["inner"]})
    COUNTER.reset()
    with torch.no_grad():
        out = compiled(ids)
    counters = COUNTER.snapshot()
    report = tspc.last_report()
    err = (out - expected).abs().max().item()
    return {
        "summary": report.summary(),
        "entries": [(e.kind, e.module, e.status, e.details) for e in report.entries],
        "predicted": report.predicted_recv_bytes,
        "counters": counters,
        "max_abs_err": err,
        "scale": expected.abs().max().item(),
    }


def main(argv: list[str] | None = None) -> int:
    p = parser_with(
        __doc__, world_size=2, seq=64, batch=2, layers=2, hidden=128, heads=8, kv_heads=4,
        intermediate=256,
    )  # fmt: skip
    p.add_argument("--mask", choices=("causal", "explicit"), default="causal")
    p.add_argument("--inner", choices=("aot_eager", "inductor", "eager"), default="aot_eager")
    a = p.parse_args(argv)
    args = {k: getattr(a, k) for k in vars(a)}
    results = spawn(run_rank, a.world_size, args, timeout=600)
    r0 = results[0]
    print(r0["summary"])
    print("\ncommunication per layer, received by each rank (bytes):")
    print(f"  {'layer':24s} {'measured':>12s} {'predicted':>12s}")
    for rank, r in enumerate(results):
        by_tag = r["counters"]["by_tag"]
        for tag in sorted(set(by_tag) | set(r["predicted"])):
            measured = sum(k["recv_bytes"] for k in by_tag.get(tag, {}).values())
            pred = r["predicted"].get(tag, "-")
            if rank == 0:
                print(f"  {tag:24s} {measured:12d} {pred!s:>12s}")
    print("\ncollectives on rank 0 (calls, bytes received):")
    for kind, c in sorted(r0["counters"]["by_kind"].items()):
        print(f"  {kind:15s} {c['calls']:5d} {c['recv_bytes']:12d}")
    worst = max(r["max_abs_err"] / max(r["scale"], 1e-12) for r in results)
    print(
        f"\nmax |tsp - single device| = {max(r['max_abs_err'] for r in results):.3e} "
        f"({worst:.2e} of the output scale) on {a.world_size} ranks"
    )
    ok = worst <= 1e-5
    print("OK: outputs equal the single-device model" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
