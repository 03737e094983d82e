"""What an operation does to the tokens, told by the operation's identity — not its name.

Dynamo's graphs call torch-level functions (``torch.add``, ``F.silu``, ``operator.mul``),
Tensor methods (``x.view``) and, after some passes, ATen ``OpOverload``s. A node is looked up
by *what it calls*: the function object, the ``torch.Tensor`` method descriptor a
``call_method`` names, or an ``OpOverload``'s packet. A user's custom op that happens to be
called ``add`` is not ``torch.add``: it is unknown, and the sequence pass gathers its sharded
inputs (always exact).

The tables below are written as names for reading, and resolved once, at import, to the
objects torch exposes under those names (``torch``, ``torch.nn.functional``, ``torch.Tensor``,
``operator``, ``torch.special``, ``torch.ops.aten``): every lookup afterwards is by identity.
ATen ops that are not listed but carry ``torch.Tag.pointwise`` count as elementwise.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable

import torch
import torch.fx as fx
import torch.nn.functional as F

from tspc.ops.masked_rows import masked_attention
from tspc.ops.zigzag_attention import causal_attention
from tspc.runtime.compat import TORCH_C_NAMESPACES, OpOverload

# Token-wise math: every output element depends on the same position of every operand
# (operands broadcast). In-place spellings (``add_``, ``operator.iadd``) are included. Random
# ops are not token-wise: a rank's draw depends on which tokens it holds (passes/keyed_random.py
# keys dropout and rand_like/randn_like; the others are gathered).
ELEMENTWISE_NAMES = (
    "add sub mul div floor_divide remainder fmod pow neg abs exp expm1 log log1p log2 sqrt rsqrt "
    "sin cos tan tanh sinh cosh sigmoid silu gelu relu relu6 leaky_relu elu selu celu softplus "
    "mish hardtanh hardswish hardsigmoid erf erfc reciprocal clamp clamp_min clamp_max clip where "
    "masked_fill eq ne lt le gt ge bitwise_and bitwise_or bitwise_xor bitwise_not logical_and "
    "logical_or logical_xor logical_not maximum minimum lerp square sign nan_to_num float half "
    "bfloat16 double int long bool to contiguous clone detach type type_as round floor "
    "ceil trunc isnan isinf isfinite atan2 addcmul addcdiv copysign zeros_like ones_like "
    "full_like empty_like requires_grad_ sgn frac"
).split()
# Elementwise ops whose output is shaped by the first tensor argument alone.
FIRST_ARG_ONLY_NAMES = "type_as to zeros_like ones_like full_like empty_like".split()
# New tensors from sizes: replicated unless a rule says otherwise.
FACTORY_NAMES = (
    "arange zeros ones full empty tensor randn rand randint eye linspace logspace new_zeros "
    "new_ones new_empty new_full new_tensor scalar_tensor empty_strided"
).split()
# Keep their input's shape and act along one ``dim`` argument.
ALONG_DIM_NAMES = "softmax log_softmax cumsum cumprod cummax cummin logcumsumexp _softmax".split()
REDUCTION_NAMES = (
    "sum mean amax amin prod std var norm logsumexp any all count_nonzero argmax argmin nansum "
    "nanmean max min"
).split()
# Calls that produce no tensor (grad mode, autocast, profiler records).
NO_VALUE_NAMES = (
    "_set_grad_enabled _log_api_usage_once _enter_autocast _exit_autocast set_grad_enabled "
    "_record_function_enter _record_function_exit"
).split()

# operator's spellings of the same math (Dynamo records ``x + y`` as ``operator.add``).
_OPERATOR_SPELLINGS = {
    "div": ("truediv",),
    "floor_divide": ("floordiv",),
    "remainder": ("mod",),
    "bitwise_and": ("and_",),
    "bitwise_or": ("or_",),
    "bitwise_xor": ("xor",),
    "bitwise_not": ("invert",),
    "add_": ("iadd",),
    "sub_": ("isub",),
    "mul_": ("imul",),
    "div_": ("itruediv",),
}
_NAMESPACES = (
    torch,
    F,
    torch.Tensor,
    torch.special,
    *TORCH_C_NAMESPACES,
    torch.amp.autocast_mode,
    operator,
)
_OPS_NAMESPACES = ("aten", "profiler")


def resolve(names: Iterable[str]) -> frozenset:
    """The objects torch exposes under ``names``: functions, Tensor methods, operator
    functions and ATen op packets (dtypes and classes with the same name are not ops)."""
    found = set()
    for name in names:
        for spelled in (name, *_OPERATOR_SPELLINGS.get(name, ())):
            for ns in _NAMESPACES:
                obj = getattr(ns, spelled, None)
                if callable(obj) and not isinstance(obj, (type, torch.dtype)):
                    found.add(obj)
            for ns in _OPS_NAMESPACES:
                if hasattr(getattr(torch.ops, ns), spelled):
                    found.add(getattr(getattr(torch.ops, ns), spelled))
    return frozenset(found)


def _with_inplace(names: Iterable[str]) -> list[str]:
    return [v for n in names for v in (n, n + "_")]


ELEMENTWISE = resolve(_with_inplace(ELEMENTWISE_NAMES))
FIRST_ARG_ONLY = resolve(FIRST_ARG_ONLY_NAMES)
FACTORIES = resolve(FACTORY_NAMES)
ALONG_DIM = resolve(ALONG_DIM_NAMES)
REDUCTIONS = resolve(REDUCTION_NAMES)
NO_VALUE = resolve(NO_VALUE_NAMES)
ATTENTION = resolve(["scaled_dot_product_attention"]) | {causal_attention, masked_attention}


def op_key(node: fx.Node) -> object | None:
    """What ``node`` calls, as an object to look up: the function, the ``torch.Tensor``
    method a ``call_method`` names, or the packet of an ``OpOverload``."""
    if node.op == "call_function":
        t = node.target
        return t.overloadpacket if isinstance(t, OpOverload) else t
    if node.op == "call_method":
        return getattr(torch.Tensor, node.target, None)
    return None


def in_table(node: fx.Node, table: frozenset) -> bool:
    key = op_key(node)
    try:
        return key is not None and key in table
    except TypeError:  # an unhashable target is in no table
        return False


def is_elementwise(node: fx.Node) -> bool:
    """Token-wise (and head-wise) math: listed, or an ATen op tagged pointwise."""
    if in_table(node, ELEMENTWISE):
        return True
    t = node.target if node.op == "call_function" else None
    return (
        isinstance(t, OpOverload)
        and torch.Tag.pointwise in t.tags
        and torch.Tag.nondeterministic_seeded not in t.tags  # draws from the generator
    )


def is_first_arg_only(node: fx.Node) -> bool:
    return in_table(node, FIRST_ARG_ONLY)


def is_inplace(node: fx.Node) -> bool:
    """Writes into its first argument (``x.add_(y)``, ``x += y``, ``torch.relu_(x)``)."""
    key = op_key(node)
    if key is operator.iadd or key in (operator.isub, operator.imul, operator.itruediv):
        return True
    name = getattr(key, "__name__", "") if key is not None else ""
    return name.endswith("_") and not name.endswith("__") and name != "requires_grad_"


Rule = Callable[..., object]


def rule_table(*rules: dict) -> dict[object, Rule]:
    """``{op names or op object: rule}`` dicts (names separated by spaces) merged and resolved
    to ``{op object: rule}``."""
    table: dict[object, Rule] = {}
    for part in rules:
        for key, rule in part.items():
            for obj in resolve(key.split()) if isinstance(key, str) else (key,):
                table[obj] = rule
    return table


def lookup(node: fx.Node, table: dict[object, Rule]) -> Rule | None:
    key = op_key(node)
    try:
        return table.get(key) if key is not None else None
    except TypeError:
        return None
