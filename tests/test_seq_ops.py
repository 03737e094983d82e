"""The sequence pass looks ops up by identity (``passes/seq_ops.py``), not by name: a user's
custom op called ``add`` is unknown (its sharded inputs are gathered: exact), torch's ``add`` in
any spelling is elementwise (no communication). Graph-only: no process group."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from tspc.passes.analyse import analyse, propagate_shapes
from tspc.passes.seq_ops import ELEMENTWISE, is_elementwise, is_inplace
from tspc.passes.shard_sequence import shard_sequence
from tspc.runtime.group import TSPGroup


@torch.library.custom_op("tspc_test::add", mutates_args=())
def custom_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    # token-wise too, but nothing tells the pass so: it must not assume it
    return x + y


@custom_add.register_fake
def _(x, y):
    return torch.empty_like(x)


def _node(op: str, target) -> fx.Node:
    g = fx.Graph()
    x = g.placeholder("x")
    return g.create_node(op, target, (x, x))


def test_torch_add_in_every_spelling_is_elementwise_and_a_custom_add_is_not():
    for op, target in [
        ("call_function", torch.add),
        ("call_function", operator.add),
        ("call_function", torch.ops.aten.add.Tensor),
        ("call_method", "add"),
        ("call_method", "add_"),
        ("call_function", operator.iadd),
    ]:
        assert is_elementwise(_node(op, target)), (op, target)
    assert not is_elementwise(_node("call_function", torch.ops.tspc_test.add.default))
    # an ATen op nobody listed, tagged pointwise by torch
    assert torch.ops.aten.sinc.default not in ELEMENTWISE
    assert is_elementwise(_node("call_function", torch.ops.aten.sinc.default))
    # names that are dtypes in torch (torch.float) are not ops
    assert torch.float32 not in ELEMENTWISE
    assert is_inplace(_node("call_method", "add_")) and is_inplace(
        _node("call_function", operator.iadd)
    )
    assert not is_inplace(_node("call_function", torch.add))


def _sharded_graph(add):
    def f(x, w):
        h = torch.nn.functional.linear(x, w)
        return add(h, h).sum()

    gm = fx.symbolic_trace(f)
    inputs = [torch.randn(2, 8, 4), torch.randn(4, 4)]
    propagate_shapes(gm, inputs)
    info = analyse(gm, inputs)
    report = shard_sequence(gm, info, TSPGroup("g", rank=0, size=2), 8)
    return gm, report


def test_a_custom_op_named_add_gets_its_sharded_inputs_gathered():
    gm, report = _sharded_graph(torch.ops.tspc_test.add)
    assert [g["op"] for g in report.gathers] == ["add"]
    custom = next(n for n in gm.graph.nodes if n.target is torch.ops.tspc_test.add)
    assert [a.meta.get("tspc_role") for a in custom.args] == ["seq_gather"] * 2
    assert report.sharded_inputs == [("x", 1)]


def test_torch_add_keeps_the_tokens_split_and_sums_with_one_reduction():
    gm, report = _sharded_graph(torch.add)
    assert report.gathers == []
    assert report.sharded_inputs == [("x", 1)]
    names = [getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes]
    assert "sharded_sum" in names
