"""``options={"inner": "inductor"}`` on real gloo processes: Inductor compiles the local compute
of the forward and backward graphs, outputs and gradients equal the same model in one process,
and Inductor's generated code keeps the overlap schedule: FileCheck over that code finds every
transfer's start before each GEMM and attention call the schedule placed between the start and
its wait, and the wait after them (``tests.helpers.check_transfers_keep_overlap``)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.helpers import check_transfers_keep_overlap, grad_error
from tspc.launch import spawn


def _reference_step(world: int):
    """Two copies of the reference model, a batch, and the first's output with its gradients
    (one process, no tspc): what each test's compiled copy is checked against."""
    from samples.reference_model import build_reference_model

    torch.compiler.reset()
    ref = build_reference_model(seed=1, num_layers=2)
    model = build_reference_model(seed=1, num_layers=2)
    ids = torch.randint(0, 256, (2, 8 * world), generator=torch.Generator().manual_seed(7))
    expected = ref(ids)
    expected.float().pow(2).mean().backward()
    return ref, model, ids, expected


def inductor_worker(rank: int, world: int) -> dict:
    from torch._inductor import config as inductor_config

    import tspc
    from tspc.backend import COMPILED
    from tspc.runtime.compat import work_registry_size
    from tspc.runtime.counters import COUNTER

    ref, model, ids, expected = _reference_step(world)
    COUNTER.reset()
    compiled = torch.compile(model, backend="tsp", options={"inner": "inductor"})
    # Graphs with transfers compiled cold: the FileCheck below takes its expectations from the
    # graphs as Inductor's post-grad passes rewrote them in place, which a hit in the FX graph
    # cache leaves as tspc scheduled them (a warm hit's code: test_inductor_cache.py).
    with inductor_config.patch(fx_graph_cache=False) if world > 1 else contextlib.nullcontext():
        out = compiled(ids)
        out.float().pow(2).mean().backward()
    err, _ = grad_error(ref, model)
    aot = COMPILED[-1].aot
    overlapping = [
        check_transfers_keep_overlap(gm, code)
        for gm, code in zip(
            aot.forward_gms + aot.backward_gms,
            aot.forward_inductor_code + aot.backward_inductor_code,
            strict=True,
        )
    ]
    moved_wait_caught = None
    if world > 1:
        # the check must notice a wait moved in front of the compute it overlapped: move the
        # last head group's weight wait up to right after its broadcast's start
        lines = aot.forward_inductor_code[0].splitlines()
        start = max(i for i, ln in enumerate(lines) if "tspc.broadcast_start.default(" in ln)
        buffer = lines[start].split(" = ", 1)[0].strip()
        wait = next(
            i
            for i, ln in enumerate(lines)
            if f"_c10d_functional.wait_tensor.default({buffer})" in ln
        )
        lines.insert(start + 1, lines.pop(wait))  # right after the start's line
        try:
            check_transfers_keep_overlap(aot.forward_gms[0], "\n".join(lines))
            moved_wait_caught = False
        except RuntimeError:
            moved_wait_caught = True
    return {
        "moved_wait_caught": moved_wait_caught,
        "out_err": ((out - expected).abs().max() / expected.abs().max()).item(),
        "grad_err": err,
        "level": tspc.last_report().level,
        "matched": len(tspc.last_report().matched),
        "recv": COUNTER.total_recv(),
        "code": aot.forward_inductor_code + aot.backward_inductor_code,
        "overlapping": overlapping,
        # every transfer's Work was waited (torch's registry holds none after the step)
        "pending_works": work_registry_size(),
    }


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_inductor_inner_matches_one_process(world):
    for r in spawn(inductor_worker, world, timeout=900):
        assert r["level"] == "tsp" and r["matched"] == 4, r
        assert r["out_err"] <= 1e-5, r["out_err"]
        assert r["grad_err"] <= 1e-5, r["grad_err"]
        # Inductor generated the code of both graphs; with D > 1 every transfer that the
        # schedule overlaps with compute still overlaps it there (checked in the worker: the
        # number of such transfers per graph)
        assert len(r["code"]) == 2, len(r["code"])
        if world > 1:
            assert r["recv"] > 0
            fwd, bwd = r["code"]
            forward_overlaps, backward_overlaps = r["overlapping"]
            # 2 layers: per layer at least the next head group's broadcast and a ring hop
            assert forward_overlaps >= 4 and backward_overlaps >= 4, r["overlapping"]
            assert r["moved_wait_caught"]
            assert "tspc.reduce_start" in bwd and "tspc.reduce_scatter_start" in bwd
            # waits are torch's own: no tspc handle table, Inductor sees wait_tensor
            for code in (fwd, bwd):
                assert "torch.ops._c10d_functional.wait_tensor.default(" in code
                assert "tspc.broadcast_wait" not in code and "tspc.ring_wait" not in code
        assert r["pending_works"] == 0, r["pending_works"]


def inductor_fails_worker(rank: int, world: int) -> dict:
    """Inductor raising its own error on the backward graph (as torch 2.13's CPU codegen did
    on Llama-4's padded chunked mask): that graph runs unfused, the forward stays Inductor's."""
    import warnings

    from torch._inductor.exc import InductorError

    import tspc
    import tspc.inner as inner
    from tspc.backend import COMPILED
    from tspc.errors import InductorFallbackWarning

    real = inner.compile_with_inductor

    def fails_on_backward(g, ex, is_backward):
        if is_backward:
            raise InductorError(AssertionError("a codegen bug"), None)
        return real(g, ex, is_backward=is_backward)

    inner.compile_with_inductor = fails_on_backward
    ref, model, ids, expected = _reference_step(world)
    compiled = torch.compile(model, backend="tsp", options={"inner": "inductor"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compiled(ids)
        out.float().pow(2).mean().backward()
    err, _ = grad_error(ref, model)
    rep = tspc.last_report()
    return {
        "out_err": ((out - expected).abs().max() / expected.abs().max()).item(),
        "grad_err": err,
        "level": rep.level,
        "fallbacks": rep.fallbacks,
        "notes": rep.notes,
        "warned": [str(w.message) for w in caught if w.category is InductorFallbackWarning],
        "forward_code": len(COMPILED[-1].aot.forward_inductor_code),
        "backward_code": len(COMPILED[-1].aot.backward_inductor_code),
    }


@pytest.mark.slow
def test_inductor_failure_on_one_graph_keeps_tsp_and_the_numbers():
    for r in spawn(inductor_fails_worker, 2, timeout=900):
        assert r["level"] == "tsp" and not r["fallbacks"], r
        assert r["out_err"] <= 1e-5 and r["grad_err"] <= 1e-5, r
        assert (r["forward_code"], r["backward_code"]) == (1, 0), r
        assert len(r["warned"]) == 1 and "backward graph" in r["warned"][0], r["warned"]
        assert any("Inductor failed on the rewritten backward" in n for n in r["notes"]), r


@pytest.mark.extended
def test_a_gathered_bool_mask_compiles_with_inductor(fake_group):
    """Llama-4's chunked mask under left padding with eager attention, graph-only as rank 0 of
    2: the padding mask is all-gathered and put back in true order (``zigzag_unshard``), a cat
    of bools that Inductor's CPU code generation once held as an int64 buffer and rejected
    (runtime/zigzag.py's BOOL_THROUGH_UINT8). Inductor compiles both graphs: no fallback."""
    import warnings

    from transformers import AutoConfig, AutoModelForCausalLM

    import tspc
    from tests.test_zoo import FAMILIES, SMALL

    fake_group(0, 2)
    cfg = AutoConfig.for_model("llama4_text", **{**SMALL, **FAMILIES["llama4_text"][0]})
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    ids = torch.randint(1, 128, (2, 17), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 17, dtype=torch.long)
    mask[0, :5] = 0
    cm = torch.compile(model, backend="tsp", fullgraph=True, options={"inner": "inductor"})
    with warnings.catch_warnings():
        warnings.simplefilter("error", tspc.InductorFallbackWarning)
        cm(input_ids=ids, attention_mask=mask).logits.sum().backward()
    rep = tspc.last_report()
    assert rep.level == "tsp" and len(rep.matched) == 6, rep.summary()
    assert not [n for n in rep.notes if n.startswith("Inductor failed")], rep.notes
