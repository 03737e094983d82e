"""In-place writes survive the passes: dead-code elimination keeps them and the overlap schedule
does not move a read across one. Found on transformers' MoE blocks (Llama-4's routed experts are
added into the shared expert's output with ``out.add_(routed)``, whose result nobody reads; the
un-permutation ``inv[perm] = arange(n)`` is then read by ``x[inv]``, with no graph edge to the
write). Graph-only: Dynamo's own graphs of small functions, no process group."""

from __future__ import annotations

import torch

from tests.helpers import capture
from tspc.passes.graph_utils import eliminate_dead_code, mutated_args
from tspc.passes.schedule import pin_mutation_order


def test_dead_code_elimination_keeps_in_place_writes():
    def f(x, y):
        out = x * 2
        out.add_(y)  # result unused: fx alone would erase it
        z = out * 3
        dead = x + 1  # noqa: F841 - really dead
        torch.relu_(z)
        return out, z

    gm, inputs = capture(f, torch.randn(4), torch.randn(4))
    expected = f(*inputs)
    eliminate_dead_code(gm.graph)
    gm.recompile()
    names = [
        n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
        for n in gm.graph.nodes
    ]
    assert "add_" in names and "relu_" in names, names
    assert sum(1 for n in gm.graph.nodes if n.op != "placeholder" and n.op != "output") == 4, names
    for got, want in zip(gm(*inputs), expected):
        torch.testing.assert_close(got, want)


def test_a_chain_of_writes_into_a_buffer_is_kept():
    """``self.ema.mul_(0.9).add_(0.1 * m)``, the moving-average idiom: the ``add_`` writes what
    ``mul_`` returned, the buffer itself. It was dropped as a write into a value nobody reads,
    silently leaving the buffer at ``0.9 * ema`` (found by probing, at every D)."""
    ema = torch.zeros(4)

    def f(x):
        with torch.no_grad():
            ema.mul_(0.9).add_(0.1 * x)
        return x * 2

    x = torch.randn(4)
    gm, inputs = capture(f, x)
    ema.zero_()
    eliminate_dead_code(gm.graph)
    gm.recompile()
    gm(*inputs)
    torch.testing.assert_close(ema, 0.1 * x)


def test_a_write_into_a_value_nobody_reads_is_dead():
    """Falcon's eager ``scores /= c`` once canonicalize_attention has replaced the attention:
    the in-place write must not keep the unused ``q @ k^T`` (and, sharded, its K gather)."""

    def f(q, k, x):
        scores = q @ k.transpose(-1, -2)
        scores.div_(2.0)  # into a value nothing reads: dead with it
        kept = x * 2
        kept.add_(1.0)  # into a value the output reads: live
        return q + 1, kept

    q, k, x = torch.randn(2, 4, 8), torch.randn(2, 4, 8), torch.randn(3)
    gm, inputs = capture(f, q, k, x)  # Dynamo's placeholder order (k before q here)
    expected = f(q, k, x)
    eliminate_dead_code(gm.graph)
    gm.recompile()
    names = [
        n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
        for n in gm.graph.nodes
    ]
    assert "div_" not in names and "matmul" not in names and "transpose" not in names, names
    assert "add_" in names, names
    for got, want in zip(gm(*inputs), expected):
        torch.testing.assert_close(got, want)


def test_mutated_args_of_each_in_place_form():
    def f(x, idx, v):
        a = x.clone()
        a[idx] = v
        b = x.clone()
        b += 1
        c = torch.ops.aten.add_.Tensor(x.clone(), 1)
        d = (x > 0) & (x < 1)  # operator.and_: not in place
        return a, b, c, d

    gm, _ = capture(f, torch.randn(4), torch.tensor([1]), torch.tensor([2.0]))
    writes = [n for n in gm.graph.nodes if mutated_args(n)]
    assert len(writes) == 3, [n.format_node() for n in gm.graph.nodes]


def test_in_place_writes_and_their_readers_keep_their_order():
    """``inv[perm] = arange(n)`` then ``out[inv]`` (transformers' MoE un-permutation): the read
    has no graph edge to the write, so both are pinned — before this, the output gather's hoist
    moved the read above the write and it indexed uninitialised memory."""

    def f(w, perm):
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(8)
        inv2 = inv.view(2, 4)
        inv2.add_(0)
        free = w.view(-1, 2) * 2  # reads nothing written: may still move
        return w[inv], free

    gm, _ = capture(f, torch.randn(8, 3), torch.randperm(8))
    assert pin_mutation_order(gm.graph) > 0
    pinned = [n for n in gm.graph.nodes if n.meta.get("tspc_pinned")]
    kinds = {
        n.target if n.op == "call_method" else getattr(n.target, "__name__", "") for n in pinned
    }
    assert {"empty_like", "setitem", "view", "add_", "getitem"} <= kinds, kinds
    assert "mul" not in kinds, kinds  # w.view(-1, 2) * 2 reads nothing written
