"""Inductor's FX graph cache for graphs with transfers (``options={"inner": "inductor"}``, D = 2).

Two compiles of the same model in fresh Dynamo state share one new FX graph cache directory: the
first misses the cache for both graphs (forward and backward), the second hits it for both, and
the code it gets is byte for byte the cold compile's code and keeps the overlap schedule (the
FileCheck of ``tests.helpers.check_transfers_keep_overlap``). AOTAutograd's cache is not
consulted at all (``tspc/inner.py``: its key does not hold tspc's partitioner)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import check_transfers_keep_overlap
from tspc.runtime.compat import dynamo_counters


def _cache_counters() -> dict:
    counters = dynamo_counters()
    fx = {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache_")}
    return {"fx": fx, "aot": dict(counters["aot_autograd"])}


@pytest.mark.slow
def test_fx_graph_cache_serves_graphs_with_transfers(fake_group, tmp_path, monkeypatch):
    """Rank 0 of D = 2 on the fake process group (no peers: the compile is rank 0's real one,
    what the collectives deliver is not looked at). Only the FX graph cache starts empty
    (``FxGraphCache._get_tmp_dir``, private in torch 2.13, pointed at ``tmp_path``): the C++
    kernels' cache stays the suite's, so that on a second run of the suite the cold compile
    does not build the same kernels again; a kernel found there does not change the code
    Inductor generates around it, which is what is compared."""
    from torch._functorch import config as functorch_config
    from torch._inductor.codecache import FxGraphCache

    from samples.reference_model import build_reference_model
    from tspc.backend import COMPILED

    fake_group(0, 2)
    monkeypatch.setattr(FxGraphCache, "_get_tmp_dir", staticmethod(lambda: str(tmp_path)))
    # a user forcing AOTAutograd's cache does not get it for tsp's graphs (tspc/inner.py)
    monkeypatch.setattr(functorch_config, "force_autograd_cache", True)
    ids = torch.randint(0, 256, (1, 16), generator=torch.Generator().manual_seed(7))
    runs = []
    for _ in range(2):
        torch.compiler.reset()
        dynamo_counters().clear()
        model = build_reference_model(seed=1, num_layers=1, hidden_size=32, intermediate_size=64)
        compiled = torch.compile(model, backend="tsp", options={"inner": "inductor"})
        compiled(ids).float().pow(2).mean().backward()
        aot = COMPILED[-1].aot
        code = aot.forward_inductor_code + aot.backward_inductor_code
        runs.append({**_cache_counters(), "code": code, "gms": aot.forward_gms + aot.backward_gms})
    cold, warm = runs
    # The FileCheck's expectations come from the graph as Inductor's post-grad passes left it
    # (they rewrite it in place): the cold compile's. A hit runs no pass, so the warm run's
    # graphs are tspc's as scheduled, which Inductor's code need not follow op for op (its
    # mm + add -> addmm pattern and tspc's split of it may move a GEMM into an earlier
    # transfer's window); the warm code is checked like the cold.
    for run in runs:
        run["overlapping"] = [
            check_transfers_keep_overlap(gm, c)
            for gm, c in zip(cold["gms"], run["code"], strict=True)
        ]
    assert cold["fx"] == {"fxgraph_cache_miss": 2}, cold["fx"]
    assert warm["fx"] == {"fxgraph_cache_hit": 2}, warm["fx"]
    # no AOTAutograd cache lookup, though forced (no autograd_cache_hit / miss / bypass)
    assert not cold["aot"] and not warm["aot"], (cold["aot"], warm["aot"])
    # the warm code is the cold code and keeps the schedule's overlap: every transfer the
    # schedule overlaps with compute starts before that compute and is waited after it
    assert len(warm["code"]) == 2 and warm["code"] == cold["code"]
    assert warm["overlapping"] == cold["overlapping"], (cold["overlapping"], warm["overlapping"])
    forward_overlaps, backward_overlaps = warm["overlapping"]
    assert forward_overlaps >= 2 and backward_overlaps >= 2, warm["overlapping"]


def test_fence_choices_and_post_grad_pass_are_in_the_cache_key():
    """What tspc does to a graph Inductor compiles is part of Inductor's FX graph cache key as
    torch itself collects it (``FxGraphHashDetails``, with the config ``compile_with_inductor``
    sets): the fence choices handler (``inductor_choices_class``) and the post-grad pass both
    stand there for the hash of tspc's sources; without them (a graph with no transfers) neither
    is there."""
    from torch._inductor import config as inductor_config
    from torch._inductor.codecache import FxGraphHashDetails

    from tspc import inner

    def key_details():
        return FxGraphHashDetails(None, [], {}, [])

    with inductor_config.patch(
        inductor_choices_class=inner._fence_choices,
        post_grad_custom_post_pass=inner._split_addmm_pass(),
    ):
        with_transfers = key_details()
    without = key_details()
    source_hash = inner.tspc_source_hash()
    assert with_transfers.inductor_config["inductor_choices_class"] == source_hash
    assert with_transfers.post_grad_custom_post_pass == source_hash
    assert without.inductor_config["inductor_choices_class"] is None
    assert without.post_grad_custom_post_pass is None
