"""One compile per model and shape family: a second training step compiles nothing; a new
sequence length compiles once, for every length (``dynamic_seq``, the default), and the lengths
after it compile nothing; each compile is counted and given a reason (``tspc/compiles.py``).

Every step's output is checked against the same model trained in one process. Counted three
ways that do not depend on each other: Dynamo's own counters (how many graphs
Dynamo traced), calls of the inner compiler (``tspc.backend.compile_inner``, wrapped here), and
tspc's compile records, whose kinds say why each compile happened.
"""

from __future__ import annotations

import logging

import pytest
import torch

from tests.helpers import counting_inner_compiles
from tspc.launch import spawn

pytestmark = pytest.mark.slow  # whole-model compiles in this process: seconds each

# a second step, a new length (Dynamo traces the length symbolically: tspc compiles one program
# for every length), a length seen before, a third length, the first length again, and a length
# that is no multiple of 2D (tspc pads it: compiled for that length alone)
LENGTHS = (16, 16, 24, 24, 32, 16, 18)
# (Dynamo's ``dynamic``, tspc's ``dynamic_seq``): automatic dynamic and the default; the length
# symbolic from the first call; and the per-length compiles without ``dynamic_seq``
CASES = ((None, True), (True, True), (True, False))


def _steps(rank, world):
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    log = logging.getLogger("tspc.compiles")
    keep, level = Keep(), log.level
    log.addHandler(keep)
    log.setLevel(logging.INFO)
    try:  # a pooled worker runs later tests: neither the handler nor the wrapper may outlive this
        with counting_inner_compiles() as inner_calls:
            return _steps_counted(inner_calls, lines)
    finally:
        log.removeHandler(keep)
        log.setLevel(level)


def _steps_counted(inner_calls: list, lines: list) -> dict:
    from samples.reference_model import build_reference_model
    from tspc import compiles
    from tspc.runtime.compat import dynamo_counters

    results = {}
    for dynamic, dynamic_seq in CASES:
        torch.compiler.reset()
        dynamo_counters().clear()
        inner_calls.clear()
        lines.clear()
        # another MLP width per case: a graph of the same shapes compiled by the first case may
        # legitimately be reused by the second (as Dynamo reuses a graph for another module)
        kw = dict(hidden_size=32, intermediate_size=64 + 32 * len(results), num_layers=1)
        model, ref = (build_reference_model(**kw, num_heads=4, num_kv_heads=2) for _ in range(2))
        # built before the first call: its first step swaps in the DTensor parameters
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        options = {"inner": "aot_eager", "dynamic_seq": dynamic_seq}
        cm = torch.compile(model, backend="tsp", dynamic=dynamic, options=options)
        per_step, errors = [], []
        first = max((e.graph_id for e in compiles.EVENTS), default=-1)
        lengths = LENGTHS if dynamic is None else (16, 16, 24, 16)
        for s in lengths:
            before = len(inner_calls)
            ids = torch.randint(0, 256, (2, s), generator=torch.Generator().manual_seed(s))
            out, expected = cm(ids), ref(ids)
            # the output after every earlier step's update: the programs' gradients were right
            errors.append(((out - expected).abs().max() / expected.abs().max()).item())
            for o, m in ((out, opt), (expected, ref_opt)):
                o.float().square().mean().backward()
                m.step()
                m.zero_grad()
            per_step.append(len(inner_calls) - before)
        results[dynamic, dynamic_seq] = {
            "per_step": per_step,
            "errors": errors,
            "unique_graphs": dynamo_counters()["stats"]["unique_graphs"],
            "tspc": dict(dynamo_counters()["tspc"]),
            "kinds": [e.kind for e in compiles.events(first)],
            "lines": list(lines),
        }
    return results


@pytest.mark.slow
def test_second_step_and_new_length_compile_once():
    from tspc import compiles

    results = spawn(_steps, 2, timeout=600)
    # every rank compiles the same graphs at the same steps
    assert [r[k]["per_step"] for r in results for k in r] == [
        results[0][k]["per_step"] for _ in results for k in results[0]
    ]
    for r in results:  # every step of every case equals one process
        assert all(max(case["errors"]) < 1e-5 for case in r.values()), r
    auto = results[0][None, True]
    # Dynamo: static at the first length, symbolic from the second (automatic dynamic)
    assert auto["unique_graphs"] == 2
    # tspc: the first length, then one program for every length at the second; nothing at a
    # second step, a length seen before, a third length or the first length again; the padded
    # length alone
    assert auto["per_step"] == [1, 0, 1, 0, 0, 0, 1]
    assert auto["kinds"] == [compiles.NEW_GRAPH, compiles.NEW_SYMBOLIC_GRAPH, compiles.NEW_SHAPE]
    assert auto["tspc"] == {
        "compiles": 3,
        f"reason:{compiles.NEW_GRAPH}": 1,
        f"reason:{compiles.NEW_SYMBOLIC_GRAPH}": 1,
        f"reason:{compiles.NEW_SHAPE}": 1,
        "runs_without_compile": 2,  # 32, and 16 under the symbolic graph
    }
    assert any("no compile for the new shape" in ln and "[2, 32]" in ln for ln in auto["lines"])
    marked = results[0][True, True]
    # dynamic=True: Dynamo traces once, symbolic; tspc compiles once, for every length
    assert marked["unique_graphs"] == 1
    assert marked["per_step"] == [1, 0, 0, 0]
    assert marked["kinds"] == [compiles.NEW_SYMBOLIC_GRAPH]
    per_length = results[0][True, False]
    # without dynamic_seq: one compile per distinct length, and the log says what changed
    assert per_length["unique_graphs"] == 1
    assert per_length["per_step"] == [1, 0, 1, 0]
    assert per_length["kinds"] == [compiles.NEW_SYMBOLIC_GRAPH, compiles.NEW_SHAPE]
    assert any("[2, 24] (was [2, 16])" in ln for ln in per_length["lines"])


def test_static_compile_is_reused_only_under_the_same_grad_mode():
    """The first length's compile (Dynamo's static trace, made under ``no_grad``) is not reused
    by the symbolic graph for a call with gradients: that call compiles, and its gradients
    reach the weights (one process, D = 1)."""
    from samples.reference_model import build_reference_model
    from tspc import compiles

    model = build_reference_model(
        hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2
    )
    cm = torch.compile(model, backend="tsp", options={"inner": "aot_eager"})
    first = max((e.graph_id for e in compiles.EVENTS), default=-1)
    with torch.no_grad():
        for s in (16, 24, 16):  # static 16, symbolic 24, 16 again: reused (same grad mode)
            cm(torch.randint(0, 256, (2, s)))
    assert len(compiles.events(first)) == 2
    # Dynamo traces again for grad mode (symbolic at once); tspc compiles that graph rather than
    # reusing the no_grad compile of the same signature
    cm(torch.randint(0, 256, (2, 16))).float().sum().backward()
    kinds = [e.kind for e in compiles.events(first)]
    assert kinds == [compiles.NEW_GRAPH, compiles.NEW_SYMBOLIC_GRAPH, compiles.NEW_SYMBOLIC_GRAPH]
    assert model.lm_head.weight.grad is not None
