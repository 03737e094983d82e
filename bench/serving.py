"""A serving loop: prompts of random lengths and batch sizes, generated on D ranks; compiles counted.

    python bench/serving.py --prompts 20 --shortest 5 --longest 300 --max-batch 4 -D 2

A small transformers Llama (random weights) greedily generates ``--new`` tokens for each of
``--prompts`` requests; a request is a batch of 1 to ``--max-batch`` prompts (drawn at random,
seed ``--seed``), each of a random length in ``[--shortest, --longest]``, left-padded to the
batch's longest with an attention mask, as a server batches them. The same requests run in one
process (eager ``generate``) and on D gloo ranks after transformers' idiom
``model.forward = torch.compile(model.forward, backend="tsp")`` and ``tspc.enable_generate(model)``
(routed before the first prompt, so every prompt is padded to its bucket:
``tspc/prefill_buckets.py``).

Printed: per request its shape, whether its tokens equal one process's, the seconds it took and
the compiles it cost; then the totals: tspc's compiles (``counters["tspc"]["compiles"]``,
``tspc/compiles.py``: one per run of the passes and the inner compiler), Dynamo's traces of the
model's frame (``counters["stats"]["unique_graphs"]``) and the requests that ran with no compile.
"""

from __future__ import annotations

import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from samples.cli import parser_with  # noqa: E402
from samples.generate_tsp import build  # noqa: E402
from tspc.launch import spawn  # noqa: E402


def requests(args: dict) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The loop's requests: (input_ids, attention_mask), left-padded batches."""
    g = torch.Generator().manual_seed(args["seed"])
    out = []
    for _ in range(args["prompts"]):
        batch = int(torch.randint(1, args["max_batch"] + 1, (1,), generator=g))
        lengths = torch.randint(args["shortest"], args["longest"] + 1, (batch,), generator=g)
        width = int(lengths.max())
        ids = torch.randint(1, args.get("vocab", 256), (batch, width), generator=g)
        mask = torch.ones(batch, width, dtype=torch.long)
        for row, n in enumerate(lengths.tolist()):
            ids[row, : width - n] = 0  # the pad token
            mask[row, : width - n] = 0
        out.append((ids, mask))
    return out


def run_rank(rank: int, world: int, mode: str, args: dict) -> dict:
    from tspc.runtime.compat import dynamo_counters

    torch.set_num_threads(1)
    model = build(args)
    if mode == "tsp":
        import tspc

        model.forward = torch.compile(model.forward, backend="tsp")
        tspc.enable_generate(model)  # routed before the first prompt: it is bucketed too
    counters = dynamo_counters()
    rows = []
    for ids, mask in requests(args):
        before = (counters["tspc"]["compiles"], counters["stats"]["unique_graphs"])
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=args["new"],
                min_new_tokens=args["new"],
                do_sample=False,
            )
        rows.append(
            {
                "shape": tuple(ids.shape),
                "seconds": time.perf_counter() - t,
                "tspc_compiles": counters["tspc"]["compiles"] - before[0],
                "dynamo_traces": counters["stats"]["unique_graphs"] - before[1],
                "tokens": out[:, ids.shape[1] :].tolist(),
            }
        )
    return {"rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = parser_with(
        __doc__.split("\n\n")[0], prompts=20, shortest=5, longest=300, max_batch=4, new=4,
        world_size=2, hidden=64, heads=4, kv_heads=2, layers=2, seed=0,
    )  # fmt: skip
    a = ap.parse_args(argv)
    args = {k: v for k, v in vars(a).items() if k != "world_size"}
    args["prompt"] = a.longest  # the model's position table (samples/generate_tsp.py)
    one = spawn(run_rank, 1, "one", args, timeout=3600)[0]["rows"]
    ranks = spawn(run_rank, a.world_size, "tsp", args, timeout=3600)
    tsp = ranks[0]["rows"]
    print(
        f"{a.prompts} requests, batch 1-{a.max_batch}, lengths {a.shortest}-{a.longest}, "
        f"{a.new} new tokens, D = {a.world_size}; Llama h={a.hidden}, {a.layers} layers, CPU\n"
    )
    print("| request | batch x width | tokens = one | seconds | tspc compiles | Dynamo traces |")
    print("|---|---|---|---|---|---|")
    equal_all = True
    for i, (o, t) in enumerate(zip(one, tsp)):
        equal = all(r["rows"][i]["tokens"] == o["tokens"] for r in ranks)
        equal_all &= equal
        b, w = t["shape"]
        print(
            f"| {i} | {b} x {w} | {equal} | {t['seconds']:.2f} | {t['tspc_compiles']} | "
            f"{t['dynamo_traces']} |"
        )
    compiles = sum(t["tspc_compiles"] for t in tsp)
    traces = sum(t["dynamo_traces"] for t in tsp)
    free = sum(1 for t in tsp if t["tspc_compiles"] == 0 and t["dynamo_traces"] == 0)
    print(
        f"\ntokens equal one process: {equal_all}; tspc compiles {compiles}, Dynamo traces "
        f"{traces}; requests with no compile {free} of {len(tsp)}; "
        f"seconds {sum(t['seconds'] for t in tsp):.1f} (one process "
        f"{sum(o['seconds'] for o in one):.1f})"
    )
    return 0 if equal_all else 1


if __name__ == "__main__":
    raise SystemExit(main())
