"""``dynamic_seq`` (the default): a new sequence length runs the program already compiled.

Once Dynamo has seen two lengths it traces the model with a symbolic length; tspc then compiles
one program for every length that is a multiple of 2D (``tspc/length_family.py``), and later
lengths run it with no pass and no inner compile. Counted three independent ways (Dynamo's
counters, calls of the inner compiler, tspc's compile records) and checked against one process
(outputs and every gradient) at every length. The rewriting itself is checked on plain graphs
here (``passes/generalize_length.py``).
"""

from __future__ import annotations

import json
import operator
import os

import pytest
import torch
import torch.fx as fx

from tests.helpers import HF_SMALL, counting_inner_compiles, grad_error
from tspc.launch import spawn
from tspc.passes.generalize_length import LengthNotGeneralizable, generalize_sequence_length

# --------------------------------------------------------------------------- graphs alone


def _graph(length: int, rows) -> fx.GraphModule:
    """``x.view(2, rows(length), -1)`` on an input of ``2 * length * 4`` numbers (the shape
    a pass would have baked), with the length as an unused int input like a specialised
    Dynamo graph."""
    g = fx.Graph()
    s = g.placeholder("s0")
    x = g.placeholder("x")
    v = g.call_method("view", (x, 2, rows(length), -1))
    g.output(g.call_function(operator.mul, (v, 2.0)))
    del s
    return fx.GraphModule(torch.nn.Module(), g)


def test_lengths_become_arithmetic_on_the_length_input():
    """Numbers affine in S / 2D become nodes computing them from the length input, so the
    graph runs at a length it was never built for; other numbers stay as they are."""
    lengths = (8, 12, 20)  # D = 2: multiples of 2D = 4
    graphs = [_graph(n, lambda n: n // 2 + 1) for n in lengths]  # rank-local rows + 1
    gm = generalize_sequence_length(graphs, lengths, "s0", 4)
    for n in (4, 16, 28):
        x = torch.randn(2 * (n // 2 + 1) * 3)
        assert torch.equal(gm(n, x), x.view(2, n // 2 + 1, -1) * 2.0)
    assert sum(n.op == "call_function" and n.target is operator.floordiv for n in gm.graph.nodes)


def test_numbers_not_affine_in_the_length_are_refused():
    """A number that is not ``a * (S / 2D) + b`` at all three lengths (here S * S / 16), or a
    graph that is another graph at one length, is refused, never guessed."""
    lengths = (8, 12, 20)
    quadratic = [_graph(n, lambda n: n * n // 16) for n in lengths]
    with pytest.raises(LengthNotGeneralizable, match="not a \\* \\(S / 2D\\) \\+ b"):
        generalize_sequence_length(quadratic, lengths, "s0", 4)
    other = [_graph(n, lambda n: n // 2) for n in lengths]
    other[2].graph.call_function(torch.relu, (next(iter(other[2].graph.nodes)),))
    with pytest.raises(LengthNotGeneralizable, match="nodes at lengths"):
        generalize_sequence_length(other, lengths, "s0", 4)


# --------------------------------------------------------------------------- gloo, D = 2

# (The reference model under Dynamo's automatic dynamic shapes, with a padded length and its
# outputs against one process at every step, is tests/test_compile_count.py's.) Llama (its loss
# in the graph) with ``dynamic=True``: symbolic from the first call, which compiles the family program. Mistral with
# a sliding window of 32 (``dynamic=True``): at 24 the window is wider than the sequence and the
# mask is plain causal, so that program serves lengths up to 32 only; 40 gets a second program
# (with the window), which 64 runs; 32 and 8 run the first.
LENGTHS = {
    "llama": (16, 16, 24, 40),
    "mistral": (24, 40, 32, 64, 8),
}
if not os.environ.get("TSPC_EXTENDED"):  # Mistral covers the same path (HF, loss in graph)
    del LENGTHS["llama"]
COMPILES = {
    "llama": [1, 0, 0, 0],
    "mistral": [1, 1, 0, 0, 0],
}


def _dynamic_steps(rank, world):
    with counting_inner_compiles() as inner_calls:
        return _steps_per_family(inner_calls)


def _steps_per_family(inner_calls: list) -> dict:
    from transformers import AutoConfig, AutoModelForCausalLM

    from tspc import compiles
    from tspc.runtime.compat import dynamo_counters

    results = {}
    for family in LENGTHS:
        torch.compiler.reset()
        dynamo_counters().clear()
        inner_calls.clear()
        # one layer: the window's meaning per length is decided per layer alike
        cfg = AutoConfig.for_model(family, **{**HF_SMALL, "num_hidden_layers": 1})
        cfg._attn_implementation = "sdpa"
        if family == "mistral":
            cfg.sliding_window = 32
        torch.manual_seed(0)
        ref = AutoModelForCausalLM.from_config(cfg).train()
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).train()
        options = {"inner": "aot_eager"}  # dynamic_seq: the default
        cm = torch.compile(model, backend="tsp", dynamic=True, options=options)
        first = max((e.graph_id for e in compiles.EVENTS), default=-1)
        steps = []
        for s in LENGTHS[family]:
            before = len(inner_calls)
            ids = torch.randint(1, 128, (2, s), generator=torch.Generator().manual_seed(s))
            # the loss inside the graph
            expected, got = ref(input_ids=ids, labels=ids), cm(input_ids=ids, labels=ids)
            loss_ref, loss = expected.loss, got.loss
            expected, got = expected.logits, got.logits
            out_err = ((got - expected).abs().max() / expected.abs().max()).item()
            loss_ref.backward()
            loss.backward()
            err, _ = grad_error(ref, model)
            ref.zero_grad(set_to_none=True)
            model.zero_grad(set_to_none=True)
            steps.append(
                {"length": s, "compiles": len(inner_calls) - before, "out": out_err, "grad": err}
            )
        results[family] = {
            "steps": steps,
            "unique_graphs": dynamo_counters()["stats"]["unique_graphs"],
            "tspc": dict(dynamo_counters()["tspc"]),
            "kinds": [e.kind for e in compiles.events(first)],
        }
    return results


@pytest.mark.slow
def test_new_lengths_run_the_compiled_program():
    from tspc import compiles

    for per_rank in spawn(_dynamic_steps, 2, timeout=900):
        for family, r in per_rank.items():
            for step in r["steps"]:  # every length equals one process
                assert step["out"] < 1e-5 and step["grad"] < 1e-5, (family, step)
            # inner compiles: Llama's first length (the family program); Mistral's first and
            # the first beyond its window; none at a second step or at any other new length
            assert [s["compiles"] for s in r["steps"]] == COMPILES[family], (family, r)
        mistral = per_rank["mistral"]
        assert mistral["unique_graphs"] == 1
        assert mistral["kinds"] == [compiles.NEW_SYMBOLIC_GRAPH, compiles.NEW_SHAPE]
        # run by a family program with no compile: Llama's 24 and 40; Mistral's 32, 64 and 8
        if llama := per_rank.get("llama"):  # extended tier
            assert llama["unique_graphs"] == 1 and llama["kinds"] == [compiles.NEW_SYMBOLIC_GRAPH]
            assert llama["tspc"]["compiles"] == 1 and llama["tspc"]["runs_without_compile"] == 2
        assert mistral["tspc"]["compiles"] == 2 and mistral["tspc"]["runs_without_compile"] == 3


# --------------------------------------------------------------------------- gloo, D = 4

D4_LENGTHS = (16, 32, 48, 24)  # multiples of 2D = 8: one program, compiled at the first


def _sharded_dumped_steps(rank, world, dump_dir):
    """The reference model symbolic from the first call, its outputs left sharded, a dump
    written: every length against one process, this rank's zigzag rows of it."""
    from samples.reference_model import build_reference_model
    from tspc import last_report
    from tspc.runtime.zigzag import zigzag_indices

    with counting_inner_compiles() as inner_calls:
        kw = dict(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4)
        ref, model = (build_reference_model(**kw, num_kv_heads=2) for _ in range(2))
        options = {"inner": "aot_eager", "outputs": "sharded", "dump_dir": dump_dir}
        cm = torch.compile(model, backend="tsp", dynamic=True, options=options)
        steps = []
        for s in D4_LENGTHS:
            before = len(inner_calls)
            ids = torch.randint(0, 256, (2, s), generator=torch.Generator().manual_seed(s))
            expected = ref(ids)
            local = cm(ids)
            mine = expected[:, zigzag_indices(s, rank, world)]
            # the loss over the whole sequence is the sum of every rank's part of it
            expected.float().square().sum().backward()
            local.float().square().sum().backward()
            err, _ = grad_error(ref, model)
            ref.zero_grad(set_to_none=True)
            model.zero_grad(set_to_none=True)
            steps.append(
                {
                    "compiles": len(inner_calls) - before,
                    "shape": tuple(local.shape),
                    "out": ((local - mine).abs().max() / mine.abs().max()).item(),
                    "grad": err,
                }
            )
    return {"steps": steps, "summary": last_report().summary()}


@pytest.mark.slow
@pytest.mark.extended
def test_one_program_at_d4_with_sharded_outputs_and_a_dump(tmp_path):
    results = spawn(_sharded_dumped_steps, 4, str(tmp_path), timeout=600)
    for rank, r in enumerate(results):
        assert [s["compiles"] for s in r["steps"]] == [1, 0, 0, 0], r
        assert [s["shape"][1] for s in r["steps"]] == [n // 4 for n in D4_LENGTHS]
        for step in r["steps"]:
            assert step["out"] < 1e-5 and step["grad"] < 1e-5, (rank, step)
        assert "one program for every length that is a multiple of 8" in r["summary"]
        # the dump reads the program's symbolic schedule at the length it was compiled at
        # (16): its bytes per kind equal what the runtime counted at that first call
        (graph,) = (tmp_path / f"rank{rank}").glob("graph*")  # one compile: one graph
        dumped = json.loads((graph / "report.json").read_text())
        read = dumped["comm_bytes"]["forward"]["per_kind"]
        counted = dumped["measured"]["forward"]["per_kind"]
        assert read["all_gather"] > 0 and read["broadcast"] + read["ring"] > 0
        assert {k: v for k, v in read.items() if v} == {
            k: v["recv_bytes"] for k, v in counted.items()
        }
        assert "NEVER WAITED" not in (graph / "schedule.txt").read_text()
