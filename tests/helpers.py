"""Helpers for tests: capture Dynamo's graph, count tspc collectives, compare with one process."""

from __future__ import annotations

from collections import Counter

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

    torch._dynamo.reset()
    torch.compile(model, backend=backend, fullgraph=True)(*inputs, **kwargs)
    return captured["gm"], captured["inputs"]


def count_collectives(gm: fx.GraphModule) -> Counter:
    """{(op name, tag): count} for every tspc op in a graph."""
    c: Counter = Counter()
    for n in gm.graph.nodes:
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "tspc":
            name = n.target._opname
            tag = n.args[-1] if isinstance(n.args[-1], str) else ""
            c[(name, tag)] += 1
    return c


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


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

    torch._dynamo.reset()  # one process plays several ranks: never reuse another rank's graph
    model = build_reference_model(num_layers=2, **model_kw)
    ids = torch.randint(0, 256, (2, 32))
    COMPILED.clear()
    out = torch.compile(model, backend="tsp")(ids)
    out.float().sum().backward()
    (cg,) = COMPILED
    return cg
