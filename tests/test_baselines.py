"""bench.baselines: torch's TP and TP+SP on the reference model equal one process, on gloo.

Each worker builds the single-process reference itself (same seed, no communication) and
returns only error numbers, so nothing but floats crosses the process boundary.

Tolerances. Forward logits: max abs error <= 1e-5 x max |logit|. Gradients: <= 1e-5 x the
tensor's max |grad| (the parallel sums run in another order). Parameters after one AdamW step:
Adam's first step is ``lr * g / (|g| + eps)``, which turns the ~1e-8 rounding differences of
gradients that are themselves ~1e-8 into O(lr) differences when eps is the default 1e-8
(measured: 8e-5 at lr 1e-3). With eps=1e-5 the measured difference is <= 1.7e-6, and the test
allows 1e-5 = 1% of lr: a parameter the step skipped or updated twice is off by ~lr.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench.baselines import build_tp, build_tp_sp, full_parameters, param_groups
from samples.reference_model import build_reference_model
from tests.helpers import D4_EXTENDED, error_message
from tspc.launch import spawn
from tspc.tools.memory import MemoryTracker, breakdown, state_bytes

pytestmark = pytest.mark.slow

LR, EPS = 1e-3, 1e-5
SEQ = 16


def _config(world_size: int, **extra) -> dict:
    # hidden 64, 2 layers; GQA with the kv heads divisible by the world size.
    heads, kv = (4, 2) if world_size <= 2 else (8, 4)
    cfg = dict(vocab_size=128, hidden_size=64, intermediate_size=160)
    return {**cfg, "num_heads": heads, "num_kv_heads": kv, **extra}


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (2, SEQ), generator=g)
    return ids, torch.randint(0, 128, (2, SEQ), generator=g)


def _train_step(model, fn, ids, tgt, optimizer):
    logits = fn(ids)
    F.cross_entropy(logits.flatten(0, 1), tgt.flatten()).backward()
    grads = full_parameters(model, grads=True)
    optimizer.step()
    return logits.detach(), grads, full_parameters(model)


def _compare(mode, cfg, ids, tgt, *, compile_=False, foreach=None) -> dict[str, float]:
    ref = build_reference_model(**cfg)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, eps=EPS)
    r_out, r_grads, r_params = _train_step(ref, ref, ids, tgt, opt)

    model = {"tp": build_tp, "tp_sp": build_tp_sp}[mode](build_reference_model(**cfg))
    seen: list[int] = []  # tokens per rank in the residual stream entering each block
    for layer in model.layers:
        layer.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[1]))
    fn = torch.compile(model, backend="aot_eager", fullgraph=True) if compile_ else model
    groups = param_groups(model) if foreach else model.parameters()
    opt = torch.optim.AdamW(groups, lr=LR, eps=EPS, foreach=foreach)
    out, grads, params = _train_step(model, fn, ids, tgt, opt)

    assert type(out) is torch.Tensor and out.shape == r_out.shape  # full logits, no DTensor
    assert grads.keys() == r_grads.keys() and params.keys() == r_params.keys()
    return {
        "block_tokens": sorted(set(seen)),
        "logits": ((out - r_out).abs().max() / r_out.abs().max()).item(),
        "grads": max(
            ((grads[n] - g).abs().max() / g.abs().max()).item() for n, g in r_grads.items()
        ),
        "params": max((params[n] - p).abs().max().item() for n, p in r_params.items()),
    }


def _check(errors: dict, tokens: int) -> None:
    assert errors["block_tokens"] == [tokens], errors  # TP+SP: S/D tokens between blocks
    assert errors["logits"] <= 1e-5, errors
    assert errors["grads"] <= 1e-5, errors
    assert errors["params"] <= 1e-5, errors


def _eager_rank(rank: int, world_size: int) -> dict:

    ids, tgt = _data()
    cfg = _config(world_size)
    out = {
        "tp": _compare("tp", cfg, ids, tgt),
        "tp_sp": _compare("tp_sp", cfg, ids, tgt),
        # HF-style explicit [S, S] mask built in the forward from the full sequence.
        "tp_sp_mask": _compare("tp_sp", _config(world_size, mask="explicit"), ids, tgt),
        # The multi-tensor AdamW path (GPU default) needs DTensor and plain params apart.
        "tp_sp_foreach": _compare("tp_sp", cfg, ids, tgt, foreach=True),
    }

    # Each rank holds 1/D of the seven projections per layer and all the rest.
    ref = build_reference_model(**cfg)
    sharded = sum(p.numel() * 4 for n, p in ref.named_parameters() if n.endswith("_proj.weight"))
    total = sum(p.numel() * 4 for p in ref.parameters())
    model = build_tp(build_reference_model(**cfg))
    out["param_bytes"] = state_bytes(model)["parameters"]
    out["param_bytes_expected"] = total - sharded + sharded // world_size

    # Collectives per forward+backward, as Megatron has them (the baselines must not be strawmen).
    for mode, build in (("tp", build_tp), ("tp_sp", build_tp_sp)):
        model = build(build_reference_model(**cfg))
        with torch.profiler.profile() as prof:
            F.cross_entropy(model(ids).flatten(0, 1), tgt.flatten()).backward()
        out[f"{mode}_collectives"] = {
            e.key: e.count for e in prof.key_averages() if e.key.startswith("c10d::")
        }

    # The memory tracker sees DTensor's collectives (functional c10d ops) as communication.
    for mode, build in (("tp", build_tp), ("tp_sp", build_tp_sp)):
        model = build(build_reference_model(**cfg))
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        with MemoryTracker() as mt:
            _train_step(model, model, ids, tgt, opt)
        out[f"{mode}_memory"] = breakdown(model, opt, tracker=mt)

    # uneven sequence shards must fail loudly, not compute garbage
    out["uneven"] = error_message(
        lambda: build_tp_sp(build_reference_model(**cfg))(ids[:, : SEQ - 1]), ValueError
    )
    # heads that do not split over the ranks (2 kv heads over 4 ranks)
    cfg = _config(world_size, num_heads=4, num_kv_heads=world_size // 2)
    out["bad_heads"] = error_message(lambda: build_tp(build_reference_model(**cfg)), ValueError)
    return out


@pytest.mark.parametrize("world_size", [2, D4_EXTENDED])
def test_tp_and_tp_sp_match_one_process(world_size):
    for r in spawn(_eager_rank, world_size, timeout=120):
        _check(r["tp"], SEQ)
        for key in ("tp_sp", "tp_sp_mask", "tp_sp_foreach"):
            _check(r[key], SEQ // world_size)
        assert r["param_bytes"] == r["param_bytes_expected"]
        layers = 2
        assert r["tp_collectives"] == {"c10d::allreduce_": 4 * layers}  # 2 fwd + 2 bwd per layer
        assert r["tp_sp_collectives"] == {
            # fwd: before attn/mlp + before the LM head; bwd: adjoints of the reduce-scatters
            # and of the embedding's sequence split (the LM head gather's adjoint is a slice).
            "c10d::allgather_into_tensor_coalesced_": 4 * layers + 2,
            # fwd: after attn/mlp; bwd: adjoints of the attn/mlp gathers.
            "c10d::reduce_scatter_tensor_coalesced_": 4 * layers,
        }
        for mode in ("tp", "tp_sp"):
            mem = r[f"{mode}_memory"]
            assert mem["parameters"] == r["param_bytes_expected"] == mem["gradients"]
            assert mem["communication_peak"] > 0 and mem["activations"] > 0
        assert "divisible" in r["uneven"]
        assert "divisible" in r["bad_heads"]


def _compiled_rank(rank: int, world_size: int) -> dict:
    ids, tgt = _data()
    cfg = _config(world_size)
    return {mode: _compare(mode, cfg, ids, tgt, compile_=True) for mode in ("tp", "tp_sp")}


def test_tp_and_tp_sp_under_torch_compile_aot_eager():
    # DTensor under Dynamo: one graph per model (fullgraph=True), forward and backward.
    for r in spawn(_compiled_rank, 2, timeout=180):
        _check(r["tp"], SEQ)
        _check(r["tp_sp"], SEQ // 2)
