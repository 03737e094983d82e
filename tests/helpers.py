"""Helpers for tests: capture Dynamo's graph, count tspc collectives, compare with one process."""

from __future__ import annotations

import contextlib
import copy
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.fx as fx

# The D = 4 run of a feature test whose D = 2 run stays in the suite: the extended tier
# (TSPC_EXTENDED=1 python -m pytest -m extended). D = 4 itself stays in the suite through the core
# equivalence, bytes, training, recompute and zoo tests.
D4_EXTENDED = pytest.param(4, marks=pytest.mark.extended)

# A transformers config small enough for many compiles on two cores (random weights, built with
# AutoConfig.for_model(family, **HF_SMALL, ...): nothing is downloaded).
HF_SMALL = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    pad_token_id=0,
    use_cache=False,
)


def capture(model, *inputs, **kwargs):
    """Dynamo's graph and example inputs for ``model(*inputs)`` (the graph a backend gets)."""
    captured = {}

    def backend(gm, example_inputs):
        captured["gm"], captured["inputs"] = gm, list(example_inputs)
        return gm.forward

    torch.compiler.reset()
    torch.compile(model, backend=backend, fullgraph=True)(*inputs, **kwargs)
    return captured["gm"], captured["inputs"]


def error_message(call: Callable[[], object], errors: Any = Exception) -> str:
    """The text of the error of type ``errors`` (a class or a tuple) that ``call()`` raises, or
    "no error". For spawned workers: they return plain data, so the test checks the message
    (``pytest.raises`` cannot reach into them)."""
    try:
        call()
    except errors as e:
        return str(e)
    return "no error"


def count_collectives(gm: fx.GraphModule) -> Counter:
    """{(op name, tag): count} for every tspc op in a graph; the ``wait_tensor`` of a tspc
    start (what a tspc wait becomes in a traced graph) counts as that start's wait op."""
    from tspc.runtime.comm import START_TO_WAIT, is_transfer_wait

    c: Counter = Counter()
    for n in gm.graph.nodes:
        if is_transfer_wait(n) and n.target not in START_TO_WAIT.values():
            start = n.args[0]
            c[(START_TO_WAIT[start.target]._opname, start.args[-1])] += 1
        elif n.op == "call_function" and getattr(n.target, "namespace", None) == "tspc":
            name = n.target._opname
            tag = n.args[-1] if isinstance(n.args[-1], str) else ""
            c[(name, tag)] += 1
    return c


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


def adamw_side_by_side(ref_params, params, ref_loss_fn, loss_fn, steps: int = 3) -> tuple:
    """``steps`` AdamW steps (lr 1e-3, eps 1e-4) of the one-process model and of the compiled
    one, the same on both: the first uses the gradients already there, each later one
    recomputes both losses (``ref_loss_fn()``, ``loss_fn()``) and backpropagates. Returns the
    two optimizers."""
    opt_ref = torch.optim.AdamW(ref_params, lr=1e-3, eps=1e-4)
    opt = torch.optim.AdamW(params, lr=1e-3, eps=1e-4)
    for step in range(steps):
        if step:
            opt_ref.zero_grad()
            opt.zero_grad()
            ref_loss_fn().backward()
            loss_fn().backward()
        opt_ref.step()
        opt.step()
    return opt_ref, opt


def train_step_against_one_process(ref: torch.nn.Module, model: torch.nn.Module, kwargs: dict):
    """One backward of a transformers model's own loss: ``ref`` in one process, ``model``
    through ``backend="tsp"`` (fullgraph). Returns both losses, the largest relative
    gradient error (``grad_error``) and the compiled model."""
    loss_ref = ref(**kwargs).loss
    loss_ref.backward()
    compiled = torch.compile(model, backend="tsp", fullgraph=True)
    loss = compiled(**kwargs).loss
    loss.backward()
    err, _ = grad_error(ref, model)
    return loss_ref, loss, err, compiled


def grad_error(ref: torch.nn.Module, model: torch.nn.Module) -> tuple[float, dict[str, list]]:
    """Largest relative gradient error of ``model`` (compiled with tspc, after backward) against
    ``ref`` (the same model run in one process), over every parameter. A DTensor parameter's
    gradient is gathered by DTensor itself (``full_tensor``, a collective every rank runs in
    the same order), so its placement is checked too. Also returns, per sharded parameter
    name, the (dim, start, stop) slices this rank holds."""
    from torch.distributed.tensor import DTensor

    from tspc.runtime.tsp_params import tsp_param_of

    err, owned = 0.0, {}
    for (name, p_ref), (_, p) in zip(ref.named_parameters(), model.named_parameters()):
        scale = p_ref.grad.abs().max().clamp_min(1e-12)
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        err = max(err, ((grad - p_ref.grad).abs().max() / scale).item())
        tp = tsp_param_of(p)
        if tp is not None and tp.sharded:
            local = p.grad.to_local()
            d = tp.entry.placement[1]
            for spec in tp.entry.own:
                mine = local.narrow(d, tp.entry.offsets[spec], spec.length)
                want = p_ref.grad.narrow(spec.dim, spec.start, spec.length)
                err = max(err, ((mine - want).abs().max() / scale).item())
                owned.setdefault(name, []).append((spec.dim, spec.start, spec.stop))
    return err, owned


def compile_reference_step(**model_kw):
    """Compile the 2-layer reference model with ``backend="tsp"`` as this process's rank of the
    current process group, run one forward and backward, and return the ``CompiledGraph``."""
    from samples.reference_model import build_reference_model
    from tspc.backend import COMPILED

    torch.compiler.reset()  # one process plays several ranks: never reuse another rank's graph
    model = build_reference_model(num_layers=2, **model_kw)
    ids = torch.randint(0, 256, (2, 32))
    COMPILED.clear()
    out = torch.compile(model, backend="tsp")(ids)
    out.float().sum().backward()
    (cg,) = COMPILED
    return cg


def zigzag_against_dense(world: int, n: int, kv_heads: int, key_padding: bool) -> None:
    """Each rank's zigzag causal attention (queries padded to P when n does not split into 2D
    chunks, keys of the true length) against dense causal SDPA of the whole sequence, forward
    and backward: real rows equal it, padded rows are finite and get no gradient, and the
    ranks' key/value gradients sum to the dense ones."""
    import torch.nn.functional as F

    from tspc.ops import zigzag_attention as zz
    from tspc.runtime.zigzag import local_valid, padded_length, zigzag_slice

    torch.manual_seed(0)
    b, hq, d = 2, 4, 8
    q = torch.randn(b, hq, n, d, requires_grad=True)
    k = torch.randn(b, kv_heads, n, d, requires_grad=True)
    v = torch.randn(b, kv_heads, n, d, requires_grad=True)
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None, None].expand(b, 1, n, n)
    valid = None
    if key_padding:
        valid = torch.ones(b, n, dtype=torch.bool)
        valid[0, :3] = False  # left padding: rows that see no key at all
        valid[1, -3:] = False  # right padding
        mask = mask & valid[:, None, None, :]
    rep = hq // kv_heads
    ref = F.scaled_dot_product_attention(
        q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1), attn_mask=mask
    ).nan_to_num()
    go = torch.randn_like(ref)
    gq, gk, gv = torch.autograd.grad(ref, (q, k, v), go)
    p = padded_length(n, world)
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for r in range(world):
        real = local_valid(n, r, world)
        ql = zigzag_slice(q.detach(), 2, r, world, padded=p).requires_grad_()
        kk, vv = k.detach().requires_grad_(), v.detach().requires_grad_()
        out, _ = zz.zigzag_causal_attention(ql, kk, vv, r, world, d**-0.5, valid)
        assert torch.isfinite(out).all()
        want = zigzag_slice(ref, 2, r, world, padded=p)
        torch.testing.assert_close(out[:, :, real], want[:, :, real], atol=5e-6, rtol=1e-5)
        grad_local = zigzag_slice(go, 2, r, world, padded=p) * real[:, None]
        a, bk, bv = torch.autograd.grad(out, (ql, kk, vv), grad_local)
        want_q = zigzag_slice(gq, 2, r, world, padded=p)
        torch.testing.assert_close(a[:, :, real], want_q[:, :, real], atol=5e-6, rtol=1e-5)
        assert (a[:, :, ~real] == 0).all()
        dk += bk
        dv += bv
    torch.testing.assert_close(dk, gk, atol=5e-6, rtol=1e-5)
    torch.testing.assert_close(dv, gv, atol=5e-6, rtol=1e-5)


def _overlap_compute() -> dict:
    """The compute a transfer can hide behind, as the scheduled aot graph names it, and the text
    of its call in Inductor's generated Python code, after ``_mark_gemms``: GEMMs are extern
    calls on CPU (Inductor may fold the accumulation ``y + x @ w`` into ``addmm``, so any GEMM
    matches any GEMM); the attention is tspc's op."""
    import tspc.backend  # noqa: F401 - registers the tspc ops

    ops = torch.ops.tspc
    return {
        torch.ops.aten.mm.default: "GEMM:",
        torch.ops.aten.addmm.default: "GEMM:",
        torch.ops.aten.bmm.default: "GEMM:",
        ops.zigzag_causal_attention.default: "torch.ops.tspc.zigzag_causal_attention.default(",
        ops.zigzag_causal_attention_backward.default: (
            "torch.ops.tspc.zigzag_causal_attention_backward.default("
        ),
    }


def _mark_gemms(code: str) -> str:
    """``code`` with every GEMM call prefixed ``GEMM:`` (FileCheck's ``check_regex`` searches
    from the start of the text, not from the previous match, so alternatives are spelled out
    this way for plain ``check``)."""
    import re

    return re.sub(r"extern_kernels\.(mm|addmm|bmm)\(", r"GEMM:extern_kernels.\1(", code)


def check_transfers_keep_overlap(gm: fx.GraphModule, code: str) -> int:
    """FileCheck Inductor's generated ``code`` for the scheduled graph ``gm`` it compiled: every
    transfer's start comes before each GEMM and attention call the schedule put between that
    start and its wait, in the schedule's order, and its wait after them. Returns the number of
    transfers that overlap some compute in the schedule (each one checked).

    A transfer is found in the code by its op and its constant arguments (the head group or
    ring shift, the size, the group, the tag: ``..._start.default(<tensor>, 1, 1536, '0', 2,
    'layers.0.attn')``), the k-th of equal ones in the code being the k-th in the graph, and
    its wait by the buffer the start's result is bound to (``wait_tensor(<buffer>)``: a start
    returns the buffer its transfer lands in, ``runtime/comm.py``).

    ``gm`` must be the graph as Inductor's post-grad passes left it (they rewrite it in place
    during a compile, not on a hit in the FX graph cache): its ``mm + add -> addmm`` pattern
    and tspc's split of it (``passes/aot_graphs.split_addmm_across_waits``) may move a GEMM
    into an earlier transfer's window, and the code follows that graph, not tspc's schedule
    before it."""
    import re

    from torch.testing import FileCheck

    from tspc.runtime.comm import START_KIND, wait_of

    compute = _overlap_compute()
    marked = _mark_gemms(code)
    nodes = list(gm.graph.nodes)
    order = {n: i for i, n in enumerate(nodes)}
    lines = code.splitlines()
    aliases: dict[str, str] = {}
    for ln in lines:  # Inductor binds an extern call's result, then re-binds it: bufB = bufA
        m = re.fullmatch(r"\s*(buf\d+) = (buf\d+)", ln)
        if m:
            aliases[m.group(2)] = m.group(1)
    seen: Counter = Counter()
    checked = 0
    for start in nodes:
        if start.op != "call_function" or start.target not in START_KIND:
            continue
        wait = wait_of(start)
        overlapped = [
            compute[n.target]
            for n in nodes[order[start] + 1 : order[wait]]
            if n.op == "call_function" and n.target in compute
        ]
        consts = ", ".join(repr(a) for a in start.args[1:])
        call = f"torch.ops.{start.target.namespace}.{start.target._opname}.default("
        signature = (call, consts)
        matches = [
            ln.strip()
            for ln in lines
            if call in ln and ln.rstrip().endswith(f", {consts})") and " = " in ln
        ]
        line = matches[seen[signature]]
        seen[signature] += 1
        buffer = line.split(" = ", 1)[0]
        while buffer in aliases:
            buffer = aliases[buffer]
        wait_call = f"torch.ops._c10d_functional.wait_tensor.default({buffer})"
        fc = FileCheck().check(line)
        for c in overlapped:
            fc = fc.check(c)
        fc.check(wait_call).run(marked)
        checked += bool(overlapped)
    return checked


@contextlib.contextmanager
def counting_inner_compiles():
    """Yields a list that gets one entry per call of the inner compiler
    (``tspc.backend.compile_inner``) while inside; restored on the way out, also on failure (a
    pooled worker runs later tests)."""
    import tspc.backend as backend

    calls: list[int] = []
    compile_inner = backend.compile_inner

    def counting(*args, **kwargs):
        calls.append(1)
        return compile_inner(*args, **kwargs)

    backend.compile_inner = counting
    try:
        yield calls
    finally:
        backend.compile_inner = compile_inner


def grad_err_vs(ref: torch.nn.Module, model: torch.nn.Module) -> float:
    """Largest gradient error over the parameters, each relative to its own largest reference
    gradient, floored at 1e-4 of the model's largest: the key biases' gradients are zero in exact
    arithmetic (softmax does not change when every key of a query moves by the same amount), so
    both sides hold rounding noise of ~1e-12 there, and noise over noise is no error."""
    from torch.distributed.tensor import DTensor

    pairs = []
    for p_ref, p in zip(ref.parameters(), model.parameters()):
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        if (g is None) != (p_ref.grad is None):  # a gradient lost (or made up): no match
            return float("inf")
        if g is not None:
            pairs.append((p_ref.grad, g))
    floor = 1e-4 * max(r.abs().max().item() for r, _ in pairs)
    return max(((g - r).abs().max() / max(r.abs().max().item(), floor)).item() for r, g in pairs)


class TinyLM(torch.nn.Module):
    """An embedding, one attention (a fused q/k/v projection, 4 heads of 16) and a GELU MLP
    at width 64, a 128-word head: the small model the in-place write and token-mixing tests
    vary between its parts."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.emb = nn.Embedding(128, 64)
        self.qkv = nn.Linear(64, 192)
        self.o = nn.Linear(64, 64)
        self.up = nn.Linear(64, 128)
        self.down = nn.Linear(128, 64)
        self.head = nn.Linear(64, 128)

    def attention(self, x: torch.Tensor, **sdpa) -> torch.Tensor:
        """The attention of ``x`` (SDPA's keywords: ``attn_mask=`` or ``is_causal=``), through
        the output projection."""
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, 16).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, **sdpa)
        return self.o(a.transpose(1, 2).reshape(b, s, 64))

    def mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.gelu(self.up(x)))


def compiled_copy(
    make: Callable[..., Any], *args: Any, options: dict | None = None, **kwargs: Any
) -> tuple[Any, Any, Any]:
    """A fresh start for one model of a worker: Dynamo reset, the seed set to 0, ``ref =
    make(*args, **kwargs)``, its copy ``model`` and ``model`` compiled with ``backend="tsp"``
    (``options``): (ref, model, compiled), as ``against_one_process`` takes them."""
    torch.compiler.reset()
    torch.manual_seed(0)
    ref = make(*args, **kwargs)
    model = copy.deepcopy(ref)
    return ref, model, torch.compile(model, backend="tsp", options=options)


def against_one_process(ref, model, compiled, x, x_ref=None) -> tuple[float, float]:
    """One call of ``compiled`` (``model`` through ``backend="tsp"``) and of ``ref`` in one
    process on ``x`` (``ref`` on ``x_ref`` when the model writes its input), each backpropagated
    along one fixed random direction: (the outputs' relative error, ``grad_err_vs``)."""
    for p in [*ref.parameters(), *model.parameters()]:
        p.grad = None
    got, expected = compiled(x), ref(x if x_ref is None else x_ref)
    probe = torch.randn(got.shape, generator=torch.Generator().manual_seed(1))
    (got * probe).sum().backward()
    (expected * probe).sum().backward()
    return rel_err(got, expected), grad_err_vs(ref, model)
