"""One rewritten graph for every sequence length of a family: the baked lengths made symbolic.

The passes work on concrete shapes: a graph Dynamo traced with a symbolic sequence length is
specialised to one length (``specialize.py``) and the rewrites bake that rank's local length
into plain numbers — view and reshape sizes (``S / D``), the zigzag cut's padded length, an
``arange(S)`` of positions. Running the passes and the inner compiler again for every new length
is what made a new length cost a whole compile.

This pass takes the graphs the pipeline produced from the *same* Dynamo graph at several lengths
``S_1 .. S_m`` (m >= 3, every one a multiple of 2D, so no padding) and returns the first with
each number that differs between them replaced by a node computing it from the graph's
sequence-length input ``s``:

* the graphs must be the same graph up to those numbers: the same nodes in the same order, the
  same ops, the same arguments otherwise (a pass that decided differently at another length is
  no graph of one family: ``LengthNotGeneralizable``);
* each differing number must be ``a * (s // 2D) + b`` with integers ``a``, ``b`` — fitted on two
  lengths and exact at every other one (so a product ``s * s`` or a ``min(s, window)`` whose
  kink lies between the lengths is refused, not guessed);
* floats, strings, dtypes and tensor constants must be equal at every length.

The result computes, for a length ``s`` of the family, what the pipeline would have built for
``s``, as far as the given lengths show it. Pass-level decisions that change only beyond them
(a threshold no given length crosses) are not seen here: the caller chooses the lengths and
says so. The graph keeps its placeholders; the first graph's node metadata (its shapes at
``S_1``) stays on the old nodes, for reports.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx


class LengthNotGeneralizable(ValueError):
    """The graphs at the given lengths are not one graph with affine length arithmetic."""


def _affine(values: Sequence[int], ks: Sequence[int]) -> tuple[int, int] | None:
    """Integers ``(a, b)`` with ``values[i] == a * ks[i] + b`` for every i, or None."""
    dv, dk = values[1] - values[0], ks[1] - ks[0]
    if dv % dk:
        return None
    a = dv // dk
    b = values[0] - a * ks[0]
    if any(v != a * k + b for v, k in zip(values, ks)):
        return None
    return a, b


class _Generalizer:
    def __init__(
        self,
        graphs: Sequence[fx.GraphModule],
        lengths: Sequence[int],
        length_input: str,
        chunks: int,
    ):
        self.gms = list(graphs)
        self.lengths = list(lengths)
        self.chunks = chunks
        self.ks = [s // chunks for s in lengths]
        self.g = self.gms[0].graph
        self.positions = [{n: i for i, n in enumerate(gm.graph.nodes)} for gm in self.gms]
        self.nodes = [list(gm.graph.nodes) for gm in self.gms]
        found = [n for n in self.g.nodes if n.op == "placeholder" and n.name == length_input]
        if not found:
            raise LengthNotGeneralizable(f"the graph has no input named {length_input!r}")
        self.length_node = found[0]
        self.tail = [n for n in self.g.nodes if n.op == "placeholder"][-1]
        self.exprs: dict[tuple[int, int], fx.Node] = {}
        self.node = None  # the node whose arguments are being unified (for messages)

    def fail(self, what: str) -> LengthNotGeneralizable:
        at = ", ".join(str(s) for s in self.lengths)
        return LengthNotGeneralizable(
            f"node '{self.node.name}' ({self.node.format_node()}): {what} (lengths {at})"
        )

    def _append(self, target, args: tuple) -> fx.Node:
        with self.g.inserting_after(self.tail):
            node = self.g.call_function(target, args)
        node.meta["tspc_role"] = "seq_length_expr"
        self.tail = node
        return node

    def expression(self, a: int, b: int) -> Any:
        """``a * (s // chunks) + b``: a number, or a node computing it (memoised; after the
        graph's inputs)."""
        if a == 0:
            return b
        if (a, b) not in self.exprs:
            if b:
                node = self._append(operator.add, (self.expression(a, 0), b))
            elif a == 1:
                node = self._append(operator.floordiv, (self.length_node, self.chunks))
            else:
                node = self._append(operator.mul, (self.expression(1, 0), a))
            self.exprs[(a, b)] = node
        return self.exprs[(a, b)]

    def unify(self, xs: list[Any]) -> Any:
        x0 = xs[0]
        if any(type(x) is not type(x0) for x in xs):
            raise self.fail(f"arguments of different kinds {[type(x).__name__ for x in xs]}")
        if isinstance(x0, fx.Node):
            where = [p[x] for p, x in zip(self.positions, xs)]
            if len(set(where)) != 1:
                raise self.fail("arguments are different nodes")
            return x0
        if isinstance(x0, bool):
            if len(set(xs)) != 1:
                raise self.fail(f"flags {xs} differ")
            return x0
        if isinstance(x0, int):
            if len(set(xs)) == 1:
                return x0
            fit = _affine(xs, self.ks)
            if fit is None:
                raise self.fail(f"the numbers {xs} are not a * (S / 2D) + b with integers a, b")
            return self.expression(*fit)
        if isinstance(x0, (tuple, list)):  # torch.Size included: it becomes a tuple
            if len({len(x) for x in xs}) != 1:
                raise self.fail("sequences of different lengths")
            items = [self.unify([x[i] for x in xs]) for i in range(len(x0))]
            return list(items) if isinstance(x0, list) else tuple(items)
        if isinstance(x0, slice):
            return slice(
                self.unify([x.start for x in xs]),
                self.unify([x.stop for x in xs]),
                self.unify([x.step for x in xs]),
            )
        if isinstance(x0, dict):
            if any(list(x) != list(x0) for x in xs):
                raise self.fail("keyword arguments differ")
            return {k: self.unify([x[k] for x in xs]) for k in x0}
        if isinstance(x0, torch.Tensor):
            if any(x.shape != x0.shape or not torch.equal(x, x0) for x in xs):
                raise self.fail("tensor constants differ")
            return x0
        if isinstance(x0, float) and all(x != x for x in xs):  # NaN everywhere
            return x0
        if any(x != x0 for x in xs):
            raise self.fail(f"values {xs} differ")
        return x0

    def run(self) -> fx.GraphModule:
        if len({len(n) for n in self.nodes}) != 1:
            raise LengthNotGeneralizable(
                f"the pipeline built graphs of {[len(n) for n in self.nodes]} nodes at lengths "
                f"{self.lengths}: it decides differently per length"
            )
        for column in zip(*self.nodes):
            self.node = n0 = column[0]
            if any((n.op, n.target) != (n0.op, n0.target) for n in column):
                other = next(n for n in column if (n.op, n.target) != (n0.op, n0.target))
                raise self.fail(f"another operation at another length ({other.format_node()})")
            if n0.op == "get_attr":
                attrs = [getattr(gm, str(n.target)) for gm, n in zip(self.gms, column)]
                self.unify(attrs)
        # second walk: rewrite (expression nodes are inserted into the first graph as we go)
        for column in zip(*self.nodes):
            self.node = n0 = column[0]
            args = self.unify([n.args for n in column])
            kwargs = self.unify([n.kwargs for n in column])
            if args != n0.args:
                n0.args = args
            if kwargs != n0.kwargs:
                n0.kwargs = kwargs
        self.g.lint()
        self.gms[0].recompile()
        return self.gms[0]


def generalize_sequence_length(
    graphs: Sequence[fx.GraphModule],
    lengths: Sequence[int],
    length_input: str,
    chunks: int,
) -> fx.GraphModule:
    """``graphs[0]`` (changed in place) with every number that varies with the sequence length
    computed from its input ``length_input`` (module docstring). ``graphs[i]`` is the pipeline's
    graph at length ``lengths[i]``; ``chunks`` is 2D, which every length is a multiple of."""
    if len(graphs) != len(lengths) or len(lengths) < 3:
        raise ValueError("need the graphs at three lengths or more (two to fit, one to check)")
    if len(set(lengths)) != len(lengths) or any(s % chunks or s <= 0 for s in lengths):
        raise ValueError(f"lengths {list(lengths)} must be distinct positive multiples of {chunks}")
    return _Generalizer(graphs, lengths, length_input, chunks).run()
