"""Inference: a long prompt and a few decoded tokens, tspc against one process and DTensor TP.

    python bench/inference.py --prompt 16384 --new 16 --devices 1 2 4

A transformers Llama (random weights, GQA) generates greedily from one prompt of ``--prompt``
tokens, batch 1, on CPU gloo processes:

* ``one``: one process, eager ``model.generate`` (no tspc);
* ``one_compiled``: one process, compiled as transformers documents it for generation: a static
  cache (``generation_config.cache_implementation = "static"``) and
  ``model.forward = torch.compile(model.forward)`` (Inductor; no CUDA graphs on CPU);
* ``tsp``: ``model.forward = torch.compile(model.forward, backend="tsp")`` then
  ``model.generate``: the prompt on the TSP schedules (1/D of the tokens and of the weights per
  rank, each rank keeping its own tokens' K/V), decode tensor-parallel on the shards with the
  sequence-sharded cache (``tspc/generate.py``);
* ``tsp_heads``: the same with ``options={"decode_layout": "heads"}``: at the first decode step
  each layer's cache is re-laid by head groups (one all-to-all), then decode attention is local
  to each rank (2 all-reduces per layer, as TP);
* ``tp``: Megatron tensor parallelism with torch's ``parallelize_module`` (colwise q/k/v/gate/up,
  rowwise o/down; every rank runs the whole prompt, KV cache sharded by heads), eager generate.

Per rank: weights held (bytes of the local tensors), KV cache held after generate, the peak of
CPU memory allocated during generate above what was resident before it (``tspc.tools.memory.
MemoryTracker``: activations, cache and communication buffers), prefill time (the model's first
call in a generate) and decode tokens/s (its other calls, one token each). Speed runs without the
tracker (the profiler under it costs time); a short warm-up generate compiles first.
Tokens of every mode are compared with one process. Numbers are of one run on a shared 2-core
machine: D ranks share 2 cores, so tokens/s fall with D here for every mode; the ratios between
modes at the same D are what the run shows.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from samples.cli import parser_with  # noqa: E402
from samples.generate_tsp import build  # noqa: E402
from tspc.launch import spawn  # noqa: E402


def _tp(model, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (world,))
    plan = {}
    for i in range(len(model.model.layers)):
        p = f"model.layers.{i}."
        for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            plan[p + n] = ColwiseParallel()
        plan[p + "self_attn.o_proj"] = RowwiseParallel()
        for n in ("mlp.gate_proj", "mlp.up_proj"):
            plan[p + n] = ColwiseParallel()
        plan[p + "mlp.down_proj"] = RowwiseParallel()
    return parallelize_module(model, mesh, plan)


def _local_bytes(model) -> int:
    from torch.distributed.tensor import DTensor

    total = 0
    for p in model.parameters():
        t = p.to_local() if isinstance(p, DTensor) else p
        total += t.numel() * t.element_size()
    return total


def _cache_bytes(cache) -> int:
    return sum(
        layer.keys.numel() * layer.keys.element_size()
        + layer.values.numel() * layer.values.element_size()
        for layer in cache.layers
    )


def run_rank(rank: int, world: int, mode: str, args: dict) -> dict:
    from tspc.tools.memory import MemoryTracker

    torch.set_num_threads(1)
    model = build(args)
    if mode == "tp":
        model = _tp(model, world)
    elif mode == "one_compiled":
        model.generation_config.cache_implementation = "static"
        model.forward = torch.compile(model.forward)
    elif mode in ("tsp", "tsp_heads"):
        options = {"decode_layout": "heads"} if mode == "tsp_heads" else None
        model.forward = torch.compile(model.forward, backend="tsp", options=options)
    ids = torch.randint(
        1, args["vocab"], (1, args["prompt"]), generator=torch.Generator().manual_seed(1)
    )

    def gen(x, n):
        with torch.no_grad():
            return model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=n,
                do_sample=False,
                return_dict_in_generate=True,
                min_new_tokens=n,
            )

    # every model call timed: the first of a generate is the prompt, the others decode steps
    calls: list[float] = []
    root = model

    def pre(mod, args):
        calls.append(-time.perf_counter())

    def post(mod, args, out):
        calls[-1] += time.perf_counter()

    root.register_forward_pre_hook(pre)
    root.register_forward_hook(post)
    gen(ids[:, :32], 2)  # warm-up: compiles (tsp), first release of the full weights
    if mode.startswith("tsp"):
        gen(ids, 2)  # the long prompt's compile; later generates reuse it
    if mode == "one_compiled":  # the static cache's length is the prompt's + new: its shapes
        gen(ids, args["new"])
    calls.clear()
    out = gen(ids, args["new"])
    t_prefill, t_decode = calls[0], sum(calls[1:])
    with MemoryTracker() as mt:
        out = gen(ids, args["new"])
    return {
        "weights": _local_bytes(model),
        "cache": _cache_bytes(out.cache),
        "peak": mt.peak_bytes,
        "prefill_s": t_prefill,
        "decode_tok_s": (len(calls) - 1) / t_decode,
        "tokens": out.sequences[0, args["prompt"] :].tolist(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = parser_with(
        __doc__.split("\n\n")[0], prompt=16384, new=16, hidden=256, intermediate=688, heads=8,
        kv_heads=4, layers=2, vocab=512,
    )  # fmt: skip
    ap.add_argument("--devices", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--modes", nargs="+", default=["tsp", "tsp_heads", "tp"])
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument(
        "--no-compiled", action="store_true", help="leave out the compiled one-process row"
    )
    a = ap.parse_args(argv)
    # what each rank is given: the prompt and the model's sizes
    args = {k: v for k, v in vars(a).items() if k not in ("devices", "modes", "json")}
    rows = []
    one = spawn(run_rank, 1, "one", args, timeout=3600)[0]
    rows.append(("one", 1, one))
    if not a.no_compiled:
        compiled = spawn(run_rank, 1, "one_compiled", args, timeout=3600)[0]
        compiled["tokens_equal"] = compiled["tokens"] == one["tokens"]
        rows.append(("one_compiled", 1, compiled))
    for d in a.devices:
        for mode in a.modes:
            if mode in ("tp", "tsp_heads") and d == 1:
                continue
            per_rank = spawn(run_rank, d, mode, args, timeout=3600)
            worst = max(per_rank, key=lambda r: r["peak"])
            worst = {**worst, "tokens_equal": all(r["tokens"] == one["tokens"] for r in per_rank)}
            worst["prefill_s"] = max(r["prefill_s"] for r in per_rank)
            worst["decode_tok_s"] = min(r["decode_tok_s"] for r in per_rank)
            rows.append((mode, d, worst))
            print(f"done {mode} D={d}", flush=True)
    mb = 1 / 2**20
    head = (
        f"prompt {a.prompt}, {a.new} new tokens, batch 1; Llama h={a.hidden}, "
        f"{a.heads} heads / {a.kv_heads} KV, F={a.intermediate}, {a.layers} layers; fp32, CPU\n\n"
        "| mode | D | weights/rank MB | KV cache/rank MB | peak during generate MB | "
        "peak vs one | prefill s | decode tok/s | decode vs one compiled | tokens = one |\n"
        "|---|---|---|---|---|---|---|---|---|---|"
    )
    base = next((r["decode_tok_s"] for m, _, r in rows if m == "one_compiled"), None)
    lines = [head]
    for mode, d, r in rows:
        lines.append(
            f"| {mode} | {d} | {r['weights'] * mb:.1f} | {r['cache'] * mb:.2f} | "
            f"{r['peak'] * mb:.1f} | {r['peak'] / one['peak']:.2f} | {r['prefill_s']:.2f} | "
            f"{r['decode_tok_s']:.1f} | "
            + (f"{r['decode_tok_s'] / base:.2f}" if base else "-")
            + f" | {r.get('tokens_equal', True)} |"
        )
    table = "\n".join(lines)
    print(table)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                [
                    {"mode": m, "D": d, **{k: v for k, v in r.items() if k != "tokens"}}
                    for m, d, r in rows
                ],
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
