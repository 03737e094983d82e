"""Projections by a 2-D parameter, in the spellings models use.

``linear(x, W, b)`` with ``W`` ``[out, in]``; GPT-2's Conv1D ``addmm(b, x, W)`` and ``x @ W`` with
``W`` ``[in, out]`` (``transposed``); ``x @ W.T`` (Falcon's ``FalconLinear``) with ``W``
``[out, in]`` read through a transpose of the parameter. The MLP and attention matchers both
see a projection through ``as_linear``, so a spelling learnt here serves both.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from .graph_utils import arg, op_name, shape, tensor_val

_MATMULS = ("linear", "addmm", "matmul", "mm", "__matmul__")


def transposed_param(node) -> fx.Node | None:
    """``W`` when ``node`` is ``W.T`` / ``W.t()`` / ``W.transpose(0, 1)`` of a 2-D tensor."""
    if not isinstance(node, fx.Node) or node.op not in ("call_function", "call_method"):
        return None
    name = op_name(node)
    src = node.args[0] if node.args else None
    # ``src`` may carry no single tensor (``unbind(x)[i]``: a getitem of a tuple)
    if not isinstance(src, fx.Node) or tensor_val(src) is None or len(shape(src)) != 2:
        return None
    if name == "getattr" and len(node.args) == 2 and node.args[1] in ("T", "mT"):
        return src
    if name == "t":
        return src
    if name in ("transpose", "swapaxes") and {
        arg(node, 1, "dim0") % 2,
        arg(node, 2, "dim1") % 2,
    } == {0, 1}:
        return src
    if name == "permute":
        dims = node.args[1] if isinstance(node.args[1], (tuple, list)) else node.args[1:]
        if [d % 2 for d in dims] == [1, 0]:
            return src
    return None


@dataclass
class Linear:
    """A parameter projection node: ``linear(x, W, b)`` (``W`` is ``[out, in]``) or a Conv1D
    ``addmm(b, x, W)`` / ``x @ W`` (``W`` is ``[in, out]``: ``transposed``)."""

    node: fx.Node
    x: fx.Node
    weight: fx.Node
    bias: fx.Node | None
    transposed: bool

    # The inputs as the graph reads them now: sequence sharding, after matching, may put a
    # gather in front of ``x`` and routes every parameter through a gradient sync.
    def current_x(self) -> fx.Node:
        return self.node.args[1 if op_name(self.node) == "addmm" else 0]

    def current_bias(self) -> fx.Node | None:
        if op_name(self.node) == "addmm":
            return self.node.args[0]
        return arg(self.node, 2, "bias") if op_name(self.node) == "linear" else None

    @property
    def in_features(self) -> int:
        return shape(self.weight)[0 if self.transposed else 1]

    @property
    def out_features(self) -> int:
        return shape(self.weight)[1 if self.transposed else 0]

    @property
    def f_dim(self) -> int:
        """The weight dim holding the output features (F for an up, h for a down)."""
        return 1 if self.transposed else 0


def as_linear(node: fx.Node, params) -> Linear | None:
    """``node`` as a projection by a 2-D parameter, or None."""
    name = op_name(node)
    if name not in _MATMULS:
        return None

    def weight(w) -> bool:
        return isinstance(w, fx.Node) and w in params and len(shape(w)) == 2

    if name == "linear":
        w = arg(node, 1, "weight")
        return Linear(node, node.args[0], w, arg(node, 2, "bias"), False) if weight(w) else None
    if name == "addmm":
        b, x, w = node.args[:3] if len(node.args) >= 3 else (None, None, None)
        plain = node.kwargs.get("beta", 1) == 1 and node.kwargs.get("alpha", 1) == 1
        if weight(w) and plain and isinstance(x, fx.Node) and node.op == "call_function":
            return Linear(node, x, w, b, True)
        return None
    if len(node.args) != 2 or not isinstance(node.args[0], fx.Node):
        return None
    w = node.args[1]
    if weight(w):
        return Linear(node, node.args[0], w, None, True)  # x @ W
    w = transposed_param(w)
    if weight(w):
        return Linear(node, node.args[0], w, None, False)  # x @ W.T (Falcon's FalconLinear)
    return None
