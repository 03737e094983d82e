"""End to end on real gloo processes: backend="tsp" equals the same model in one process.

Every configuration runs in the same D processes (one spawn per world size keeps the suite
fast); each is a fresh model and a fresh compile, and each checks that tspc really ran (a report
with every layer matched, and communication counted when D > 1) so a silent fallback to plain
eager cannot pass.
"""

from __future__ import annotations

import pytest
import torch

from tspc.launch import spawn

CONFIGS = [
    # (batch, seq multiplier of 2D, model overrides)
    (1, 2, {}),
    (2, 3, {}),
    (2, 4, {"mask": "explicit"}),
    (1, 5, {"num_kv_heads": 4}),
    (2, 2, {"num_kv_heads": 1, "num_layers": 3}),
    (2, 3, {"tie_embeddings": True, "num_heads": 8, "num_kv_heads": 8, "hidden_size": 128}),
]


def forward_worker(rank: int, world: int, configs: list[int]) -> list[dict]:
    import tspc
    from samples.reference_model import build_reference_model
    from tspc.runtime.counters import COUNTER

    results = []
    for batch, mult, overrides in (CONFIGS[i] for i in configs):
        torch.compiler.reset()
        seq = 2 * world * mult
        kw = {"num_layers": 2, **overrides}
        ref_model = build_reference_model(seed=1, **kw)
        model = build_reference_model(seed=1, **kw)
        torch.manual_seed(7)
        ids = torch.randint(0, 256, (batch, seq))
        with torch.no_grad():
            expected = ref_model(ids)
            COUNTER.reset()
            out = torch.compile(model, backend="tsp")(ids)
        rep = tspc.last_report()
        results.append(
            {
                "config": (batch, seq, overrides),
                "err": ((out - expected).abs().max() / expected.abs().max()).item(),
                "matched": sorted(e.module for e in rep.matched),
                "skipped": [(e.module, e.reason) for e in rep.skipped],
                "level": rep.level,
                "recv": COUNTER.total_recv(),
                "layers": kw["num_layers"],
            }
        )
    return results


# D = 4 in the suite: the two configurations whose head groups split differently at D = 4 (one
# K/V head for four ranks, eight heads on a wider model); every configuration in the extended
# tier. D = 4 training (tests/test_training.py) runs in the suite too.
D4_SUITE = [4, 5]


@pytest.mark.slow
@pytest.mark.parametrize(
    "world,configs",
    [
        pytest.param(1, range(len(CONFIGS)), id="1"),
        pytest.param(2, range(len(CONFIGS)), id="2"),
        pytest.param(4, D4_SUITE, id="4"),
        pytest.param(4, range(len(CONFIGS)), marks=pytest.mark.extended, id="4-all"),
    ],
)
def test_outputs_equal_one_process(world, configs):
    for rank_results in spawn(forward_worker, world, list(configs), timeout=600):
        for r in rank_results:
            assert r["level"] == "tsp", r
            assert not r["skipped"], r
            assert len(r["matched"]) == 2 * r["layers"], r
            assert (r["recv"] > 0) == (world > 1), r
            assert r["err"] <= 1e-5, r
