"""``generate()`` on a TSP-compiled mixture-of-experts model (issue 27) against the same model in
one process: greedy tokens equal, logits close. Decode runs each rank's own experts on the new
tokens and sums over ranks with one all-reduce (``runtime/decode_moe.py``). One spawn runs every
case: each MoE family of ``tests/test_moe.py`` and Mixtral with experts uneven over the ranks."""

from __future__ import annotations

import traceback
import warnings

import pytest
import torch

from tests.test_generate import _generate, _logit_err
from tests.test_moe import MOE_FAMILIES
from tests.test_moe import build as build_moe
from tspc.launch import spawn

CASES = [(family, {}) for family in MOE_FAMILIES] + [("mixtral", {"num_local_experts": 3})]


def moe_generate_worker(rank: int, world: int, cases: list) -> list[dict]:
    import tspc

    warnings.filterwarnings("ignore")
    rows = []
    for family, extra in cases:
        torch.compiler.reset()
        ref = build_moe(family, use_cache=True, **extra).eval()
        cm = torch.compile(
            build_moe(family, use_cache=True, **extra).eval(),
            backend="tsp",
        )
        tspc.enable_generate(cm)
        try:
            got = _generate(cm)
        except Exception:  # noqa: BLE001 - reported per case
            rows.append({"case": (family, extra), "error": traceback.format_exc(limit=1)})
            continue
        want = _generate(ref)
        rows.append(
            {
                "case": (family, extra),
                "same": torch.equal(got.sequences, want.sequences),
                "logits": _logit_err(got, want),
            }
        )
    return rows


@pytest.mark.slow
def test_moe_generate_equals_one_process_d2():
    for rows in spawn(moe_generate_worker, 2, CASES, timeout=900):
        for r in rows:
            assert "error" not in r, r
            assert r["same"], r
            assert r["logits"] < 1e-4, r
