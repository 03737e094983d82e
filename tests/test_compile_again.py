"""Compiling one model again: ``torch.compile(model, backend="tsp")`` a second time, after the
first compiled module is dropped or beside it. After the first compiled call the model holds
DTensor parameters and the records of how each is sharded (``runtime/tsp_params.py``'s
``TSPParam``); those records live as long as the model (not the compiled module), and a second
compiled module is refused with an error naming the fix, never DTensor's mixed-tensor error.
(Not checked here: that the model is freed once deleted. Even without a second compile, an
``OptimizedModule`` of it outlives ``del`` + ``torch.compiler.reset()`` + ``gc.collect()`` in a
gloo worker; found, not fixed.)
Real gloo runs (D = 2): outputs and gradients against one process."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import grad_error
from tests.mlp_forms import model_with
from tspc.launch import spawn


def _step(ref, model, fn, ids) -> dict:
    """One forward and backward of ``fn`` (a compiled wrapper of ``model``) against ``ref``."""
    for m in (ref, model):
        m.zero_grad(set_to_none=True)
    expected = ref(ids)
    expected.sum().backward()
    got = fn(ids)
    got.sum().backward()
    out_err = ((got - expected).abs().max() / expected.abs().max()).item()
    return {"out_err": out_err, "grad_err": grad_error(ref, model)[0]}


def _refused(fn, ids) -> str:
    try:
        fn(ids)
    except Exception as e:  # noqa: BLE001 - the message is the result
        return f"{type(e).__name__}: {e}"
    return "not refused"


def compile_again_worker(rank: int, world: int) -> dict:
    import gc

    from torch.distributed.tensor import DTensor

    from tspc.runtime.tsp_params import tsp_param_of

    torch.compiler.reset()
    ids = torch.randint(0, 256, (2, 4 * world), generator=torch.Generator().manual_seed(3))
    ref, model = model_with("gated"), model_with("gated")
    first, beside = torch.compile(model, backend="tsp"), torch.compile(model, backend="tsp")
    out = {"first": _step(ref, model, first, ids)}
    out["beside"] = _refused(beside, ids)
    out["first_after_refusal"] = _step(ref, model, first, ids)
    torch.compiler.reset()  # Dynamo compiles the first compiled module again from scratch
    out["first_after_reset"] = _step(ref, model, first, ids)
    del first, beside
    gc.collect()
    dparams = [p for p in model.parameters() if isinstance(p, DTensor)]
    out["records_kept"] = bool(dparams) and all(tsp_param_of(p) is not None for p in dparams)
    out["again"] = _refused(torch.compile(model, backend="tsp"), ids)
    return out


@pytest.mark.slow
def test_a_model_compiled_again_is_refused_with_the_fix_and_its_records_kept():
    for r in spawn(compile_again_worker, 2, timeout=900):
        for case in ("first", "first_after_refusal", "first_after_reset"):
            assert r[case]["out_err"] < 1e-5 and r[case]["grad_err"] < 1e-5, (case, r)
        assert r["records_kept"], r
        for case in ("beside", "again"):
            assert r[case].startswith("TSPConfigError"), r[case]
            assert "Keep that compiled module" in r[case], r[case]
