"""Bad input, changing shapes, divergent inputs, dead peers, use after release, dtypes:
a clear error or the right answer, never a hang or a crash.

The gloo tests run in spawned processes, so a segfault (a read of released memory) fails the
test ("exited without reporting") instead of killing the run.
"""

from __future__ import annotations

import time

import pytest
import torch

from samples.reference_model import build_reference_model
from tests.helpers import error_message
from tspc.launch import WorkerError, spawn

# --------------------------------------------------------------------------- sequence length
# Any length compiles: one that does not split into 2D chunks is padded inside (the report
# says by how much) — tests/test_any_length.py.


# --------------------------------------------------------------------------- configuration


def test_more_ranks_than_heads_is_a_clear_error(fake_group):
    fake_group(0, 8)
    model = build_reference_model(num_layers=1, num_heads=4, num_kv_heads=4)
    with pytest.raises(Exception, match=r"D=8 ranks is more than its 4 attention heads"):
        torch.compile(model, backend="tsp")(torch.randint(0, 256, (1, 32)))


def test_more_ranks_than_intermediate_size_is_a_clear_error(fake_group):
    fake_group(0, 8)
    model = build_reference_model(
        num_layers=1, num_heads=8, num_kv_heads=8, hidden_size=64, intermediate_size=4
    )
    with pytest.raises(Exception, match=r"more than its intermediate size 4"):
        torch.compile(model, backend="tsp")(torch.randint(0, 256, (1, 32)))


def test_dtensor_sharded_model_is_refused(fake_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    fake_group(0, 2)
    # A model tspc sharded earlier in this process, still alive: its parameters' mesh can be
    # the very mesh object torch hands out below, which must not pass the user's DTensors as
    # tspc's own (CI failed so when an earlier test's model outlived it).
    earlier = build_reference_model(num_layers=1)
    torch.compile(earlier, backend="tsp")(torch.randint(0, 256, (1, 16)))
    mesh = init_device_mesh("cpu", (2,))
    model = build_reference_model(num_layers=1)
    plan = {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel()}
    parallelize_module(model.layers[0].mlp, mesh, {**plan, "down_proj": RowwiseParallel()})
    with pytest.raises(Exception, match=r"already sharded.*compile the unwrapped model"):
        torch.compile(model, backend="tsp")(torch.randint(0, 256, (1, 16)))
    del earlier


def test_two_d_mesh_needs_mesh_dim(fake_group):
    from torch.distributed.device_mesh import init_device_mesh

    fake_group(0, 4)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tsp"))
    model = build_reference_model(num_layers=1)
    with pytest.raises(Exception, match=r"2-D DeviceMesh .* without 'mesh_dim'"):
        torch.compile(model, backend="tsp", options={"group": mesh})(torch.randint(0, 256, (1, 16)))
    with pytest.raises(Exception, match=r"mesh_dim='tp' is not a dimension"):
        torch.compile(model, backend="tsp", options={"group": mesh, "mesh_dim": "tp"})(
            torch.randint(0, 256, (1, 16))
        )


# --------------------------------------------------------------------------- shapes


def shapes_worker(rank: int, world: int) -> list[float]:
    errs = []
    # one layer: what is checked is the compiles per shape, not the layers' schedule
    model = build_reference_model(seed=0, num_layers=1)
    ref = build_reference_model(seed=0, num_layers=1)
    compiled = torch.compile(model, backend="tsp")
    dyn = torch.compile(build_reference_model(seed=0, num_layers=1), backend="tsp", dynamic=True)
    for seq in (16, 24, 40):
        for batch in (1, 2):
            ids = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(seq))
            with torch.no_grad():
                want = ref(ids)
                for run in (compiled, dyn):
                    errs.append(((run(ids) - want).abs().max() / want.abs().max()).item())
    return errs


@pytest.mark.slow
def test_changing_shapes_recompile_the_same_way_on_every_rank():
    for errs in spawn(shapes_worker, 2, timeout=600):
        assert len(errs) == 12 and max(errs) < 1e-5, errs


# --------------------------------------------------------------------------- divergent inputs


def inputs_worker(rank: int, world: int) -> str:
    model = build_reference_model(num_layers=1)
    compiled = torch.compile(model, backend="tsp", options={"check_inputs": True})
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    compiled(ids)  # same inputs: fine
    if rank == 1:
        ids = ids.clone()
        ids[0, 3] += 1
    return error_message(lambda: compiled(ids))


@pytest.mark.slow
def test_check_inputs_names_the_input_and_the_rank():
    for msg in spawn(inputs_worker, 2, timeout=300):
        assert "input 'l_input_ids_' differs between ranks: rank(s) [1]" in msg, msg


# --------------------------------------------------------------------------- dead or stalled peers


def peer_worker(rank: int, world: int, mode: str) -> dict:
    import os

    import tspc

    model = build_reference_model(num_layers=2)
    compiled = torch.compile(model, backend="tsp", options={"comm_timeout": 8.0})
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        compiled(ids)  # a healthy step first
    if rank == 1:
        if mode == "die":
            os._exit(17)
        time.sleep(13)  # stall: alive, but never joins the next collective
        return {}
    start = time.monotonic()
    try:
        with torch.no_grad():
            compiled(ids)
    except Exception as e:  # noqa: BLE001 - re-raised with the time it took
        kind = "CollectiveTimeout" if isinstance(e, tspc.CollectiveTimeout) else type(e).__name__
        raise RuntimeError(
            f"SURVIVOR after {time.monotonic() - start:.1f}s raised {kind}: {e}"
        ) from None
    return {"hung": False}


def test_a_failed_transfer_is_raised_by_wait_tensor_naming_it_and_leaves_no_work():
    # The Work a start registers in torch's registry (runtime/comm.py), failing as gloo's does
    # when a peer is gone: torch's own wait_tensor raises tspc's error, naming the collective
    # and the layer, and the registry no longer holds the Work.
    import torch.distributed as dist

    import tspc
    from tspc.runtime import comm
    from tspc.runtime.compat import register_work, work_registry_size

    class GoneWork(dist.Work):
        def wait(self, timeout=None):
            raise RuntimeError("Connection closed by peer")

    before = work_registry_size()
    buf = torch.empty(4)
    with comm.timeout_scope(3.0):
        register_work(buf, comm._TransferWork([GoneWork()], "ring", "layers.1.mlp", (), True))
    assert work_registry_size() == before + 1
    with pytest.raises(tspc.CollectiveTimeout, match=r"ring for 'layers.1.mlp' .* within 3s"):
        torch.ops._c10d_functional.wait_tensor(buf)
    assert work_registry_size() == before


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["die", "stall"])
def test_dead_or_stalled_peer_raises_naming_the_collective_and_layer(mode):
    with pytest.raises(WorkerError) as info:
        spawn(peer_worker, 2, mode, timeout=90, fresh=True)  # a rank dies or stalls
    text = str(info.value)
    # the surviving rank fails fast, with the collective and the layer named
    assert "SURVIVOR after" in text, text
    seconds = float(text.split("SURVIVOR after ")[1].split("s")[0])
    assert seconds < 12, text
    assert "CollectiveTimeout" in text, text
    assert "for 'layers.0.attn'" in text or "for 'layers.0.mlp'" in text, text
    assert "A peer may have died or stalled" in text, text


# --------------------------------------------------------------------------- use after release


def released_worker(rank: int, world: int) -> dict:
    import copy
    import io

    import tspc

    model = build_reference_model(seed=0, num_layers=2)
    ref = build_reference_model(seed=0, num_layers=2)
    compiled = torch.compile(model, backend="tsp")
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    weight = model.layers[0].attn.q_proj.weight  # the original, held across the first call
    compiled(ids)  # first call: slices cut, the module holds DTensors, the original is released
    out = {"released": tspc.is_released(weight), "storage": weight.untyped_storage().nbytes()}
    attempts = {
        "eager call": lambda: model(ids),
        "state_dict": lambda: model.state_dict(),
        "save": lambda: torch.save(model.state_dict(), io.BytesIO()),
        "read weight": lambda: weight.sum(),
        "weight math": lambda: weight @ weight.T,
        "deepcopy": lambda: copy.deepcopy(weight),
    }
    for name, fn in attempts.items():
        try:
            fn()
            out[name] = "ran"
        except tspc.ReleasedParameterError as e:
            out[name] = str(e)
        except Exception as e:  # noqa: BLE001
            out[name] = f"{type(e).__name__}: {e}"
    out["shape"] = tuple(weight.shape)  # metadata stays readable
    # the compiled model keeps working, also after a recompile for a new length
    errs = []
    for seq in (16, 32):
        x = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(seq))
        with torch.no_grad():
            want = ref(x)
            errs.append(((compiled(x) - want).abs().max() / want.abs().max()).item())
    out["errs"] = errs
    full = tspc.state_dict(compiled)
    out["state_err"] = max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())
    return out


@pytest.mark.slow
def test_released_originals_raise_clear_errors_and_the_compiled_model_keeps_working():
    for r in spawn(released_worker, 2, timeout=300):
        assert r["released"] and r["storage"] == 0
        assert "Call the compiled model" in r["eager call"], r["eager call"]
        assert r["state_dict"] == "ran" and r["save"] == "ran", r
        for name in ("read weight", "weight math"):
            assert "model.parameters()" in r[name], (name, r[name])
        assert "holds its DTensor" in r["deepcopy"], r["deepcopy"]
        assert r["shape"] == (64, 64)
        assert max(r["errs"]) < 1e-5, r["errs"]
        assert r["state_err"] == 0.0


# --------------------------------------------------------------------------- dtypes, grad modes


def dtype_worker(rank: int, world: int) -> dict:
    from tests.helpers import grad_error

    out = {}
    combos = [
        (torch.float32, "grad"),
        (torch.bfloat16, "no_grad"),
        (torch.float16, "inference_mode"),
        (torch.bfloat16, "grad"),
        # float64 (gradient checks run models in double): no step may round it to fp32
        (torch.float64, "grad"),
    ]
    for dtype, mode in combos:
        torch.compiler.reset()
        model = build_reference_model(seed=0, num_layers=2).to(dtype)
        ref = build_reference_model(seed=0, num_layers=2).to(dtype)
        ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(1))
        ctx = {
            "no_grad": torch.no_grad,
            "inference_mode": torch.inference_mode,
            "grad": torch.enable_grad,
        }[mode]
        with ctx():
            got = torch.compile(model, backend="tsp")(ids)
            want = ref(ids)
        acc = torch.promote_types(dtype, torch.float32)
        got_, want_ = got.to(acc), want.to(acc)
        err = ((got_ - want_).abs().max() / want_.abs().max()).item()
        out[f"{dtype}-{mode}"] = err
        if mode == "grad":  # and the gradients, in the model's dtype
            got_.pow(2).mean().backward()
            want_.pow(2).mean().backward()
            out[f"{dtype}-grads"] = grad_error(ref, model)[0]
            if dtype in (torch.bfloat16, torch.float16):
                # Rounding differs from one process's (tspc sums partial gradients over ranks
                # in fp32): judged by the distance of each to fp32 gradients.
                exact = build_reference_model(seed=0, num_layers=2)
                exact(ids).float().pow(2).mean().backward()
                out[f"{dtype}-grads-vs-fp32"] = grad_error(exact, model)[0]
                out[f"{dtype}-grads-one-process-vs-fp32"] = grad_error(exact, ref)[0]
    return out


@pytest.mark.slow
def test_dtypes_and_grad_modes():
    tol = {
        "torch.float32": 1e-5,
        "torch.float64": 1e-12,
        "torch.bfloat16": 3e-2,
        "torch.float16": 5e-3,
    }
    for r in spawn(dtype_worker, 2, timeout=900):
        # tspc's bf16 gradients are as close to fp32's as one process's bf16 gradients are
        assert (
            r["torch.bfloat16-grads-vs-fp32"] < 1.5 * r["torch.bfloat16-grads-one-process-vs-fp32"]
        ), r
        assert r["torch.float32-grads"] < 1e-5, r
        assert r["torch.float64-grads"] < 1e-12, r
        for key, err in r.items():
            if "grads" in key:
                continue
            assert err < tol[key.split("-")[0]], (key, err)
