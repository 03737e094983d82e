"""``generate()`` on a TSP-compiled mixture-of-experts model (issue 27) against the same model in
one process: greedy tokens equal, logits close. Decode runs each rank's own experts on the new
tokens and sums over ranks with one all-reduce (``runtime/decode_moe.py``). One spawn runs every
case: each experts form of ``tests/test_moe.py``'s families and Mixtral with experts uneven over
the ranks. Qwen3-MoE, OLMoE and PhiMoE hold their experts in the same module as Mixtral (only
their routers differ, and decode runs the router as the model's own code): their decode is a
repeat, in the extended tier."""

from __future__ import annotations

import traceback
import warnings

import pytest
import torch

from tests.test_generate import _generate, _logit_err
from tests.test_moe import MOE_FAMILIES
from tests.test_moe import build as build_moe
from tspc.launch import spawn

# a routed-experts form each: Mixtral's (E = 4 and 3, uneven), Qwen2-MoE's shared expert and
# its gate, GraniteMoE's parallel experts, Llama-4's every expert on every token
ROUTER_REPEATS = ("qwen3_moe", "olmoe", "phimoe")
CASES = [(f, {}) for f in MOE_FAMILIES if f not in ROUTER_REPEATS] + [
    ("mixtral", {"num_local_experts": 3})
]


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


def _check(cases: list) -> None:
    for rows in spawn(moe_generate_worker, 2, cases, timeout=900):
        for r in rows:
            assert "error" not in r, r
            assert r["same"], r
            assert r["logits"] < 1e-4, r


# the suite's share: uneven experts (E = 3 on D = 2) and every expert on every token (Llama-4)
SUITE_CASES = [c for c in CASES if c[1] or c[0] == "llama4_text"]


@pytest.mark.slow
def test_moe_generate_equals_one_process_d2():
    _check(SUITE_CASES)


@pytest.mark.slow
@pytest.mark.extended
def test_moe_generate_router_variants_equal_one_process_d2():
    _check([c for c in CASES if c not in SUITE_CASES] + [(f, {}) for f in ROUTER_REPEATS])
