"""Shape propagation (``passes/analyse.py``): what an incremental propagation re-runs, Dynamo's
values taken as they are, the MLP ring's value rule; and the local dead-code removal that
the rewrites use (``graph_utils.erase_unused``). Graph-only: no process group."""

from __future__ import annotations

import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from tspc.passes.analyse import adopt_static_values, propagate_shapes
from tspc.passes.graph_utils import erase_unused
from tspc.passes.value_rules import ring_mlp_value
from tspc.runtime.ring_mlp import ring_mlp


def _f(x, w):
    h = F.linear(x, w)
    y = h.view(2, 8, 8)
    return y.relu().sum(-1)


def _traced():
    gm = fx.symbolic_trace(_f)
    nodes = {n.name: n for n in gm.graph.nodes}
    return gm, nodes, [torch.randn(16, 8), torch.randn(8, 8)]


def test_a_second_propagation_runs_nothing():
    gm, nodes, inputs = _traced()
    computed = [n for n in gm.graph.nodes if n.op != "placeholder"]
    assert propagate_shapes(gm, inputs) == len(computed)
    assert propagate_shapes(gm, inputs) == 0
    assert nodes["sum_1"].meta["val"].shape == (2, 8)


def test_changed_arguments_rerun_the_node_and_what_its_new_shape_reaches():
    gm, nodes, inputs = _traced()
    propagate_shapes(gm, inputs)
    nodes["view"].args = (nodes["linear"], 4, 4, 8)
    # view, relu, sum and the output: each one's input changed shape
    assert propagate_shapes(gm, inputs) == 4
    assert nodes["view"].meta["val"].shape == (4, 4, 8)
    assert nodes["sum_1"].meta["val"].shape == (4, 4)


def test_a_replaced_op_with_the_same_shape_stops_there():
    gm, nodes, inputs = _traced()
    propagate_shapes(gm, inputs)
    nodes["relu"].target = "sigmoid"
    assert propagate_shapes(gm, inputs) == 1  # sum's input has the same metadata


def test_an_inserted_node_runs_and_its_user_reruns():
    gm, nodes, inputs = _traced()
    propagate_shapes(gm, inputs)
    with gm.graph.inserting_after(nodes["linear"]):
        neg = gm.graph.call_function(torch.neg, (nodes["linear"],))
    nodes["view"].replace_input_with(nodes["linear"], neg)
    gm.recompile()
    assert propagate_shapes(gm, inputs) == 2  # neg (new) and view (new argument)
    assert neg.meta["val"].shape == (16, 8)


def test_new_input_shapes_rerun_everything_they_reach():
    gm, nodes, inputs = _traced()
    propagate_shapes(gm, inputs)
    nodes["view"].args = (nodes["linear"], 4, -1, 8)
    propagate_shapes(gm, inputs)
    assert propagate_shapes(gm, [torch.randn(32, 8), inputs[1]]) == 5
    assert nodes["view"].meta["val"].shape == (4, 8, 8)


def _g(x, w):
    return F.linear(x, w).relu().sum(-1)


def _dynamo_graph(dynamic: bool) -> fx.GraphModule:
    graphs = []

    def grab(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch.compiler.reset()
    torch.compile(_g, backend=grab, dynamic=dynamic)(torch.randn(16, 8), torch.randn(8, 8))
    torch.compiler.reset()
    return graphs[0]


def test_dynamo_static_values_are_adopted():
    gm = _dynamo_graph(dynamic=False)
    assert adopt_static_values(gm)
    for n in gm.graph.nodes:
        if n.op != "output":
            assert n.meta["val"] is n.meta["example_value"]


def test_symbolic_values_are_not_adopted():
    gm = _dynamo_graph(dynamic=True)
    assert not adopt_static_values(gm)
    assert not any("val" in n.meta for n in gm.graph.nodes if n.op != "placeholder")


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("conv1d", [False, True])
def test_ring_mlp_value_rule_matches_running_the_ring(world, bias, conv1d):
    h, f_local = 16, 24
    mode = FakeTensorMode()
    with mode:
        x = torch.randn(2, 5, h, requires_grad=True)
        gate, up = torch.randn(f_local, h), torch.randn(f_local, h)
        down = torch.randn(h, f_local)
        if conv1d:  # weights stored [in, out]
            gate, up, down = gate.t().contiguous(), up.t().contiguous(), down.t().contiguous()
        bg, bu = (torch.randn(f_local), torch.randn(f_local)) if bias else (None, None)
        orient = "ttt" if conv1d else "nnn"
        args = (x, [gate, up], [bg, bu], down, "gated:silu", orient, 0, world, "unused", "mlp")
        real = ring_mlp(*args)  # on fake tensors the collectives run their fake kernels
        rule = ring_mlp_value(*args)
    for attr in ("shape", "dtype", "device", "requires_grad"):
        assert getattr(rule, attr) == getattr(real, attr), attr
    assert rule.stride() == real.stride()


def test_erase_unused_removes_a_dead_chain_but_not_inputs_or_side_effects():
    g = fx.Graph()
    x = g.placeholder("x")
    a = g.call_function(torch.neg, (x,))
    b = g.call_function(torch.relu, (a,))
    printed = g.call_function(torch._assert, (a, "checked"))  # a side effect: stays
    c = g.call_function(operator.add, (b, 1))
    g.output(x)
    assert erase_unused(g, [c]) == 2  # c and b; a is still read by the assertion
    names = [n.name for n in g.nodes]
    assert "relu" not in names and "add" not in names
    assert a in g.nodes and printed in g.nodes and x in g.nodes
