"""The first checks on one GPU, in one command (under 5 minutes on an H200):

    python bench/gpu_check.py                 # the three sections below, one table each
    python bench/gpu_check.py --layers 4      # a shorter model if compile time is tight
    python bench/gpu_check.py --smoke         # tiny shapes on CPU (what the tests run)

1. kernels: the zigzag attention op on CUDA (``tspc/ops/attention_kernels.py``) against dense
   ``F.scaled_dot_product_attention(is_causal=True)`` at D = 2 and 4, emulated in one process:
   each rank's zigzag query chunks are run against the full K/V, the outputs are put back in
   order and compared, and so are dq, and dk/dv summed over the ranks. bf16 (flash), fp32
   (memory-efficient) and bf16 with key padding (memory-efficient with a bias), GQA 4:1. Errors
   are the largest absolute difference relative to the largest magnitude of the reference.
2. memory: peak ``torch.cuda.max_memory_allocated`` of the zigzag op's forward + backward
   (rank 0 of D) against dense SDPA's on the full sequence.
3. end to end, D = 1: ``backend="tsp"`` (inner Inductor) against ``torch.compile`` (Inductor) on
   the reference model at ~1B parameters (hidden 2048, 16 layers, 16 heads, 8 KV heads, MLP
   5632, vocabulary 32000, sequence 4096, batch 1), bf16 weights, forward + backward of the
   cross-entropy loss: compile time, step time (median of ``--iters``), tokens/s, peak memory,
   and the first step's loss of both.

Without CUDA the GPU sections are skipped with a message; ``--smoke`` runs every section's code
on CPU at tiny sizes (eager inner compiler), so the script itself is tested without a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import torch
import torch.nn.functional as F

from tspc.ops.zigzag_attention import zigzag_causal_attention
from tspc.runtime.zigzag import zigzag_slice, zigzag_unshard
from tspc.tools.plan import ModelShape


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _peak_reset(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak(device: str) -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")


def _inputs(b, hq, hkv, s, d, dtype, device, padding):
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (
        torch.randn(b, h, s, d, generator=g).to(device, dtype).requires_grad_()
        for h in (hq, hkv, hkv)
    )
    valid = None
    if padding:
        valid = torch.ones(b, s, dtype=torch.bool, device=device)
        valid[0, : s // 8] = False  # left padding of the first sequence
    return q, k, v, valid


def _dense(q, k, v, valid):
    rep = q.shape[1] // k.shape[1]
    ke, ve = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    if valid is None:
        return F.scaled_dot_product_attention(q, ke, ve, is_causal=True)
    s = q.shape[2]
    mask = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()[None, None]
    mask = mask & valid[:, None, None, :]
    return F.scaled_dot_product_attention(q, ke, ve, attn_mask=mask).nan_to_num()


# relative max error allowed against dense SDPA (which itself runs in the same dtype)
TOLERANCE = {torch.bfloat16: 3e-2, torch.float16: 5e-3, torch.float32: 1e-4}


def check_kernels(device: str, shape: dict, worlds=(2, 4)) -> list[list]:
    """Section 1: rows of (case, D, out, dq, dk, dv errors, kernel ms)."""
    from tspc.ops.attention_kernels import choose_kernel

    rows = []
    cases = [("bf16", torch.bfloat16, False), ("fp32", torch.float32, False)]
    cases.append(("bf16+pad", torch.bfloat16, True))
    for name, dtype, padding in cases:
        q, k, v, valid = _inputs(**shape, dtype=dtype, device=device, padding=padding)
        ref = _dense(q, k, v, valid)
        go = torch.randn_like(ref)
        gq, gk, gv = torch.autograd.grad(ref, (q, k, v), go)
        kernel = choose_kernel(q.device, dtype, q.shape[-1], padding)
        d = q.shape[-1]
        for world in worlds:
            outs, dqs = [], []
            dk, dv = torch.zeros_like(k), torch.zeros_like(v)
            _sync(device)
            t0 = time.perf_counter()
            for r in range(world):
                ql = zigzag_slice(q.detach(), 2, r, world).requires_grad_()
                kk, vv = k.detach().requires_grad_(), v.detach().requires_grad_()
                out, _ = zigzag_causal_attention(ql, kk, vv, r, world, d**-0.5, valid)
                a, bk, bv = torch.autograd.grad(out, (ql, kk, vv), zigzag_slice(go, 2, r, world))
                outs.append(out.detach())
                dqs.append(a)
                dk += bk
                dv += bv
            _sync(device)
            ms = (time.perf_counter() - t0) * 1e3
            out = zigzag_unshard(torch.stack(outs), 2, world)
            dq = zigzag_unshard(torch.stack(dqs), 2, world)
            errs = [_rel(out, ref), _rel(dq, gq), _rel(dk, gk), _rel(dv, gv)]
            tol = TOLERANCE[dtype]
            ok = "ok" if max(errs) <= tol else f"FAIL (> {tol})"
            rows.append([f"{name} ({kernel})", world, *errs, ms, ok])
    return rows


def check_memory(device: str, shape: dict, worlds=(2, 4)) -> list[list]:
    """Section 2: peak GiB of forward + backward, zigzag rank 0 of D vs dense SDPA."""
    rows = []
    q, k, v, _ = _inputs(**shape, dtype=torch.bfloat16, device=device, padding=False)
    d = q.shape[-1]
    _peak_reset(device)
    base = torch.cuda.memory_allocated() / 2**30 if device == "cuda" else float("nan")
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.sum().backward()
    rows.append(["dense SDPA (full sequence)", 1, _peak(device) - base])
    del out
    for world in worlds:
        ql = zigzag_slice(q.detach(), 2, 0, world).requires_grad_()
        kk, vv = k.detach().requires_grad_(), v.detach().requires_grad_()
        _peak_reset(device)
        base = torch.cuda.memory_allocated() / 2**30 if device == "cuda" else float("nan")
        out, _ = zigzag_causal_attention(ql, kk, vv, 0, world, d**-0.5, None)
        out.sum().backward()
        rows.append([f"zigzag rank 0 of {world}", world, _peak(device) - base])
    return rows


class _WithLoss(torch.nn.Module):
    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, targets):
        logits = self.model(ids)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def end_to_end(device: str, cfg: ModelShape, seq: int, iters: int, inner: str) -> list[list]:
    """Section 3: D = 1 tsp vs Inductor (rows: name, params B, compile s, step ms, tok/s,
    peak GiB, first loss)."""
    from tspc.tools.measure import reference_model

    rows = []
    backends = [("inductor", "inductor", None), ("tsp", "tsp", {"inner": inner})]
    if device != "cuda":
        backends[0] = ("eager", None, None)  # no Inductor compile on the smoke path
    for name, backend, options in backends:
        torch.compiler.reset()
        model = reference_model(cfg).to(device=device, dtype=torch.bfloat16)
        n_params = sum(p.numel() for p in model.parameters()) / 1e9
        step_model = _WithLoss(model)
        if backend is not None:
            step_model = torch.compile(step_model, backend=backend, options=options)
        g = torch.Generator(device="cpu").manual_seed(1)
        ids = torch.randint(0, cfg.vocab, (1, seq), generator=g).to(device)
        targets = torch.randint(0, cfg.vocab, (1, seq), generator=g).to(device)
        _peak_reset(device)
        t0 = time.perf_counter()
        loss = step_model(ids, targets)
        loss.backward()
        _sync(device)
        compile_s = time.perf_counter() - t0
        first = loss.item()
        times = []
        for _ in range(iters):
            for p in model.parameters():
                p.grad = None
            _sync(device)
            t0 = time.perf_counter()
            step_model(ids, targets).backward()
            _sync(device)
            times.append(time.perf_counter() - t0)
        step = statistics.median(times)
        rows.append([name, n_params, compile_s, step * 1e3, seq / step, _peak(device), first])
        del model, step_model, loss
    return rows


def _table(title: str, header: list[str], rows: list[list]) -> str:
    def cell(x):
        if isinstance(x, float):
            return f"{x:.3g}" if abs(x) < 1e4 else f"{x:.0f}"
        return str(x)

    cells = [header, *[[cell(x) for x in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = [title]
    for r in cells:
        lines.append("  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)))
    return "\n".join(lines)


MODEL_1B = ModelShape(hidden=2048, layers=16, heads=16, kv_heads=8, intermediate=5632, vocab=32000)
MODEL_SMOKE = ModelShape(hidden=64, layers=1, heads=4, kv_heads=2, intermediate=128, vocab=256)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (no GPU needed)")
    p.add_argument("--layers", type=int, default=MODEL_1B.layers)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--inner", default="inductor", help="tsp's inner compiler (section 3)")
    a = p.parse_args(argv)

    if a.smoke:
        device, seq, iters, inner = "cpu", 32, 1, "eager"
        cfg = MODEL_SMOKE
        attn = dict(b=1, hq=4, hkv=1, s=64, d=16)
    elif not torch.cuda.is_available():
        print(
            "gpu_check: CUDA is not available: skipping the GPU sections (kernels, memory, "
            "end to end). Run with --smoke for the CPU code path."
        )
        return 0
    else:
        device, seq, iters, inner = "cuda", a.seq, a.iters, a.inner
        cfg = replace(MODEL_1B, layers=a.layers)
        attn = dict(b=1, hq=16, hkv=4, s=8192, d=128)
    t0 = time.perf_counter()
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (smoke)"
    print(f"gpu_check on {name}, torch {torch.__version__}")
    kernel_rows = check_kernels(device, attn)
    print(
        _table(
            f"\n1. zigzag kernel vs dense causal SDPA ({attn}), relative max error",
            ["case", "D", "out", "dq", "dk", "dv", "ms (all ranks)", "check"],
            kernel_rows,
        )
    )
    print(
        _table(
            "\n2. attention forward + backward peak memory (GiB above inputs), bf16",
            ["what", "D", "peak GiB"],
            check_memory(device, attn),
        )
    )
    print(
        _table(
            f"\n3. end to end, D = 1, bf16, seq {seq}, forward + backward of the loss",
            ["backend", "params (B)", "compile s", "step ms", "tokens/s", "peak GiB", "loss"],
            end_to_end(device, cfg, seq, iters, inner),
        )
    )
    failed = [r[0] for r in kernel_rows if r[-1] != "ok"]
    print(f"\ngpu_check: done in {time.perf_counter() - t0:.0f} s", end="")
    print(f"; kernel checks FAILED: {', '.join(failed)}" if failed else "; kernel checks ok")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
