"""Ranks that disagree, shared storage, and torch's process-wide state (docs/guarantees.md:
"Ranks agree, or a clear error", "Shared and tied storage", "No process-wide changes to torch").

* Weights initialised without a common seed: every rank raises ``ModuleStateMismatchError``
  naming the first differing parameter; with ``sync_module_states`` rank 0's weights are
  broadcast and three AdamW steps equal one process holding rank 0's weights.
* Inputs: different lengths per rank raise ``InputMismatchError`` on every rank (by default)
  within seconds, where gloo used to abort one rank and hang the other; different batches of
  the same shape raise with ``check_inputs=True``.
* A pass that fails on one rank only (simulated) leaves the ranks with different programs:
  every rank raises ``ProgramMismatchError`` at the first call instead of a gloo abort.
* A model whose parameters are views of one flat tensor trains three AdamW steps equal to one
  process and checkpoints; its shared storage is never freed.
* Compiling, training and deleting a model leaves torch's process-wide state as it found it.
"""

from __future__ import annotations

import time

import pytest
import torch

from samples.reference_model import build_reference_model
from tests.helpers import adamw_side_by_side, grad_error
from tspc.launch import spawn


def _ids(seed: int, seq: int = 16) -> torch.Tensor:
    return torch.randint(0, 256, (2, seq), generator=torch.Generator().manual_seed(seed))


def _loss(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


def _timed_error(call) -> dict:
    start = time.monotonic()
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the test checks the type and the message
        return {"type": type(e).__name__, "error": str(e), "seconds": time.monotonic() - start}
    return {"type": None, "error": "no error", "seconds": time.monotonic() - start}


# --------------------------------------------------------------------------- module states


def weights_worker(rank: int, world: int, sync: bool) -> dict:
    torch.compiler.reset()
    ref = build_reference_model(seed=0, num_layers=2)  # rank 0's weights
    model = build_reference_model(seed=rank, num_layers=2)  # no common seed
    options = {"inner": "aot_eager", "sync_module_states": sync}
    run = torch.compile(model, backend="tsp", options=options)
    ids = _ids(0)
    if not sync:
        return _timed_error(lambda: run(ids))
    return _train_against(ref, model, run, ids)


def _train_against(ref, model, run, ids) -> dict:
    """The gradients of one step and the full state dict after 3 AdamW steps of the compiled
    ``run`` (of ``model``) against ``ref`` in one process: the largest errors."""
    _loss(ref(ids), ids).backward()
    _loss(run(ids), ids).backward()
    res = {"grad_err": grad_error(ref, model)[0]}
    adamw_side_by_side(
        list(ref.parameters()),
        list(model.parameters()),
        lambda: _loss(ref(ids), ids),
        lambda: _loss(run(ids), ids),
    )
    ref_state = ref.state_dict()
    res["state_err"] = max(
        (v.full_tensor() if hasattr(v, "full_tensor") else v).sub(ref_state[k]).abs().max().item()
        for k, v in model.state_dict().items()
    )
    return res


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.extended)])
def test_weights_that_differ_between_ranks_are_an_error_on_every_rank(world):
    for r in spawn(weights_worker, world, False, timeout=300):
        msg = r["error"]
        assert r["type"] == "ModuleStateMismatchError", r
        # the first parameter of the model that differs (the embedding, seeded per rank)
        assert "'embed.weight' differs between ranks" in msg, msg
        assert "sync_module_states" in msg, msg
        assert r["seconds"] < 250, r  # the first call's compile, then the check: no hang


@pytest.mark.slow
def test_sync_module_states_trains_rank_0s_model():
    for r in spawn(weights_worker, 2, True, timeout=300):
        assert r["grad_err"] < 1e-4, r
        assert r["state_err"] < 1e-5, r


# --------------------------------------------------------------------------- inputs


def inputs_worker(rank: int, world: int, case: str) -> dict:
    torch.compiler.reset()
    model = build_reference_model(seed=0, num_layers=1)
    options = {"inner": "aot_eager", "comm_timeout": 20.0}
    if case == "batch":
        options["check_inputs"] = True
    run = torch.compile(model, backend="tsp", options=options)
    if case == "length":  # the first call: lengths 16 and 32
        ids = _ids(0, seq=16 * (rank + 1))
    elif case == "batch":  # one agreed call, then another batch on each rank (a DistributedSampler)
        _loss(run(_ids(0)), _ids(0)).backward()
        ids = _ids(rank)
    else:  # "second length": one agreed call, then each rank changes to its own length
        _loss(run(_ids(0)), _ids(0)).backward()
        ids = _ids(0, seq=32 + 16 * rank)
    return _timed_error(lambda: _loss(run(ids), ids).backward())


@pytest.mark.slow
@pytest.mark.parametrize("case", ["length", "batch", "second length"])
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.extended)])
def test_inputs_that_differ_between_ranks_are_an_error_on_every_rank(world, case):
    for r in spawn(inputs_worker, world, case, timeout=300, fresh=True):
        assert r["type"] == "InputMismatchError", r
        assert "input 'l_input_ids_' differs between ranks" in r["error"], r
        if case != "batch":
            assert "shape (2, 32)" in r["error"] or "(2, 48)" in r["error"], r
        # the check's error, not the collective timeout's (the length cases include a compile)
        assert "CollectiveTimeout" not in r["error"] and r["seconds"] < (
            20 if case == "batch" else 250
        ), r


# --------------------------------------------------------------------------- programs


def program_worker(rank: int, world: int) -> dict:
    """A pass that fails on the last rank only (a rank-dependent bug, simulated): that rank
    runs the passes again without the failing MLP, the others shard it."""
    import tspc.pipeline as pipeline

    torch.compiler.reset()
    model = build_reference_model(seed=0, num_layers=2)
    original = pipeline.rewrite_mlp

    def failing_on_last_rank(gm, info, m, group, *args):
        if group.rank == world - 1 and m.module.endswith("layers.1.mlp"):
            raise RuntimeError("a rank-dependent failure")
        return original(gm, info, m, group, *args)

    pipeline.rewrite_mlp = failing_on_last_rank
    try:
        run = torch.compile(model, backend="tsp", options={"inner": "aot_eager"})
        ids = _ids(0)
        return _timed_error(lambda: _loss(run(ids), ids).backward())
    finally:
        pipeline.rewrite_mlp = original


@pytest.mark.slow
def test_programs_that_differ_between_ranks_are_an_error_on_every_rank():
    """Where gloo aborted one rank and left the other in a collective, every rank raises
    ``ProgramMismatchError`` at the first call, naming the module and each rank's status."""
    for r in spawn(program_worker, 2, timeout=300, fresh=True):
        assert r["type"] == "ProgramMismatchError", r
        msg = r["error"]
        assert "'layers.1.mlp' is matched on rank 0" in msg, msg
        assert "skipped on rank 1 (rewrite failed: RuntimeError: a rank-dependent" in msg, msg
        assert r["seconds"] < 250, r


# --------------------------------------------------------------------------- shared storage


def carve_from_one_buffer(model: torch.nn.Module) -> torch.Tensor:
    """Every parameter of ``model`` becomes a view of one flat tensor (as a flat-buffer
    optimizer or a checkpoint loader lays them out), with the same values; returns the flat
    tensor, which the model also keeps."""
    params = list(model.named_parameters())
    flat = torch.cat([p.detach().reshape(-1) for _, p in params])
    offset = 0
    for name, p in params:
        owner = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
        view = flat[offset : offset + p.numel()].view_as(p)
        setattr(owner, name.rpartition(".")[2], torch.nn.Parameter(view))
        offset += p.numel()
    model.flat = flat
    return flat


def shared_worker(rank: int, world: int) -> dict:
    import tspc

    torch.compiler.reset()
    ref = build_reference_model(seed=0, num_layers=2)
    model = build_reference_model(seed=0, num_layers=2)
    flat = carve_from_one_buffer(model)
    kept = model.norm.weight  # a replicated parameter sharing the storage of sharded ones
    run = torch.compile(model, backend="tsp", options={"inner": "aot_eager"})
    ids = _ids(0)
    res = _train_against(ref, model, run, ids)
    res["flat_bytes"] = flat.untyped_storage().nbytes()
    res["kept_sum"] = float(kept.detach().float().sum())  # read: a freed storage would crash
    res["released"] = tspc.is_released(kept)
    return res


@pytest.mark.slow
def test_parameters_carved_from_one_buffer_train_like_one_process():
    for r in spawn(shared_worker, 2, timeout=300, fresh=True):
        assert r["grad_err"] < 1e-4, r
        assert r["state_err"] < 1e-5, r
        assert r["flat_bytes"] > 0, r


# --------------------------------------------------------------------------- torch's global state


def torch_state() -> dict:
    """What of torch is process-wide and a backend could change: fx's side-effect set, the
    global optimizer and module hooks, Inductor's lowering table (once imported), the Dynamo,
    functorch and Inductor configs, grad mode and the default dtype."""
    import sys

    import torch.fx.node as fx_node
    import torch.nn.modules.module as module_mod
    import torch.optim.optimizer as optimizer_mod

    state = {
        "fx side-effect set": set(fx_node._side_effectful_functions),
        "optimizer hooks": [
            list(optimizer_mod._global_optimizer_pre_hooks),
            list(optimizer_mod._global_optimizer_post_hooks),
        ],
        "module hooks": {
            name: list(value)
            for name, value in vars(module_mod).items()
            if name.startswith("_global_") and isinstance(value, dict)
        },
        "dynamo config": torch._dynamo.config.get_config_copy(),
        "grad mode": torch.is_grad_enabled(),
        "default dtype": torch.get_default_dtype(),
    }
    if "torch._inductor.lowering" in sys.modules:
        state["inductor lowerings"] = set(sys.modules["torch._inductor.lowering"].lowerings)
        state["inductor config"] = sys.modules["torch._inductor.config"].get_config_copy()
    if "torch._functorch.config" in sys.modules:
        state["functorch config"] = sys.modules["torch._functorch.config"].get_config_copy()
    return state


def _differences(before: dict, after: dict) -> list[str]:
    out = []
    for k in set(before) | set(after):
        a, b = before.get(k), after.get(k)
        if a != b:
            extra = sorted(map(str, b - a)) if isinstance(a, set) and isinstance(b, set) else b
            out.append(f"{k}: {extra}")
    return out


def state_worker(rank: int, world: int) -> dict:
    import gc

    import torch._functorch.partitioners  # noqa: F401 - torch's own imports add to the state
    import torch._inductor.compile_fx  # noqa: F401
    import torch._inductor.lowering  # noqa: F401

    torch.compiler.reset()
    before = torch_state()
    during = _train_one_model()
    torch.compiler.reset()
    gc.collect()
    return {"during": during, "differences": _differences(before, torch_state())}


def _train_one_model() -> bool:
    """Two AdamW steps of a model compiled with tspc, in a frame of its own: the model is gone
    when it returns (``release.owner_modules_of`` reads the callers' frame locals, which keep
    what they held while the frame lives)."""
    from tspc.runtime import optimizers

    model = build_reference_model(seed=0, num_layers=1)
    run = torch.compile(model, backend="tsp", options={"inner": "aot_eager"})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # built before the first call
    ids = _ids(0)
    for _ in range(2):
        _loss(run(ids), ids).backward()
        opt.step()
        opt.zero_grad()
    return optimizers.hook_installed()


@pytest.mark.slow
def test_compiling_training_and_deleting_a_model_leaves_torch_as_it_was():
    for r in spawn(state_worker, 2, timeout=300, fresh=True):
        assert r["during"], r  # the optimizer hook was there while the model lived
        assert r["differences"] == [], r


IMPORT_CHECK = """
import torch, torch.optim, torch.fx
from tests.test_trust_ranks import torch_state, _differences
torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])
before = torch_state()
import tspc, tspc.backend
print(_differences(before, torch_state()))
"""


@pytest.mark.slow
def test_importing_tspc_changes_nothing_in_torch():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", IMPORT_CHECK], capture_output=True, text=True, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr


@pytest.mark.slow  # imports Inductor's lowerings (seconds)
def test_inductor_lowerings_and_fx_marks_of_tspc_ops_last_only_for_the_compile():
    from torch._inductor.lowering import lowerings

    from tspc.runtime import comm

    starts = set(comm.START_KIND)
    assert not starts & set(lowerings)
    with comm.lowered_for_inductor():
        assert starts <= set(lowerings)
    assert not starts & set(lowerings)
    from torch.fx.node import _side_effectful_functions

    # torch marks its own wait_tensor (torch.distributed._functional_collectives); tspc's ops
    # are marked only inside the context
    before = set(_side_effectful_functions)
    assert not starts & before
    with comm.collectives_kept():
        assert set(_side_effectful_functions) >= comm.SIDE_EFFECT_OPS
    assert set(_side_effectful_functions) == before
