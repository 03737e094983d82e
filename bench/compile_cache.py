"""Compile time at D > 1 with Inductor's caches: a cold process start, then warm ones.

    python bench/compile_cache.py                 # D = 2, the reference model, 2 layers
    python bench/compile_cache.py --world 2 --starts 3 --cache-dir /tmp/x

Each start is a fresh set of gloo processes (``tspc.launch.spawn`` with an environment), all
sharing one Inductor cache directory (``TORCHINDUCTOR_CACHE_DIR``, new unless given), so the
first start compiles cold and the later ones find Inductor's FX graph cache filled. Per rank
and start: the first step's seconds (forward + backward of a loss: Dynamo, tspc's passes,
aot_autograd, Inductor), the inner compiler's share of it (forward and backward graphs), the
FX graph and AOTAutograd cache counters, and a hash of Inductor's generated code (a warm start
must get the cold start's code).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def first_step_worker(rank: int, world: int, layers: int, seq: int) -> dict:
    import torch

    from samples.reference_model import build_reference_model
    from tspc.backend import COMPILED
    from tspc.runtime.compat import dynamo_counters

    model = build_reference_model(seed=1, num_layers=layers)
    ids = torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(7))
    compiled = torch.compile(model, backend="tsp", options={"inner": "inductor"})
    t0 = time.perf_counter()
    compiled(ids).float().pow(2).mean().backward()
    first_step_s = time.perf_counter() - t0
    aot = COMPILED[-1].aot
    counters = dynamo_counters()
    code = "\n".join(aot.forward_inductor_code + aot.backward_inductor_code)
    return {
        "first_step_s": round(first_step_s, 1),
        "inner_s": {k: round(v, 1) for k, v in aot.compile_seconds.items()},
        "fx_cache": {k: v for k, v in counters["inductor"].items() if "fxgraph_cache" in k},
        "aot_cache": {k: v for k, v in counters["aot_autograd"].items() if "autograd_cache" in k},
        "code_sha": hashlib.sha256(code.encode()).hexdigest()[:12],
    }


def main() -> None:
    from tspc.launch import spawn

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (batch 2)")
    p.add_argument("--starts", type=int, default=2, help="process starts (the first is cold)")
    p.add_argument("--cache-dir", default=None, help="default: a new directory")
    args = p.parse_args()
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="tspc-compile-cache-")
    env = {"TORCHINDUCTOR_CACHE_DIR": cache_dir, "TSPC_INNER": ""}
    print(f"D = {args.world}, reference model, {args.layers} layers; cache {cache_dir}")
    for start in range(args.starts):
        per_rank = spawn(
            first_step_worker, args.world, args.layers, args.seq, timeout=3600, env=env
        )
        for rank, r in enumerate(per_rank):
            print(f"start {start + 1} rank {rank}: {json.dumps(r)}", flush=True)


if __name__ == "__main__":
    main()
