"""Record the ops a step runs, in program order, with what the time model needs of each.

:class:`OpRecorder` is a ``TorchDispatchMode``: on fake tensors it sees every ATen and custom op
the step runs (aot_eager's compiled graphs run op by op; DTensor's local ops are seen because the
recorder lets the subclass unwrap first). For each op it keeps an :class:`Op`: its class (GEMM,
attention, memory-bound, view), its FLOPs (``torch.utils.flop_counter``'s formulas; attention by
its own rule, causal masks halving the work, which the counter ignores), the bytes it reads and
writes, and for a collective its kind, payload and the handle that pairs its start with its wait.
No time is computed here: one trace serves every hardware description.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry
from torch.utils.weak import WeakIdKeyDictionary

from tspc.runtime.compat import TorchDispatchMode, op_schema, tree_leaves

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass
class Op:
    """One op of a recorded step. ``kind``: compute, start (a collective is issued), wait (the
    compute stream needs a collective's result), sync (a collective that blocks at once)."""

    name: str
    kind: str
    cls: str = "memory"  # gemm, attention, memory, view, meta (compute ops)
    flops: float = 0.0
    nbytes: float = 0.0  # bytes read and written (compute) or the payload (collectives)
    dtype: str = "fp32"
    collective: str = ""  # all_gather, reduce_scatter, all_reduce, broadcast, reduce, ...
    devices: int = 1
    handle: int = -1
    head_dim: int = 0  # attention ops: the head size (its kernels' efficiency depends on it)


# tspc's start ops (runtime/comm.py) -> (collective kind, payload: "in" or "out" bytes)
TSPC_STARTS = {
    "broadcast_start": ("broadcast", "out"),
    "reduce_start": ("reduce", "in"),
    "all_gather_start": ("all_gather", "out"),
    "reduce_scatter_start": ("reduce_scatter", "in"),
    "ring_start": ("p2p", "in"),
    "ring_chunk_start": ("p2p", "in"),
    "all_reduce_start": ("all_reduce", "in"),
    "all_to_all_start": ("all_to_all", "in"),
}
# torch's functional collectives (DTensor issues these)
FUNCOL = {
    "all_gather_into_tensor": ("all_gather", "out"),
    "all_gather_into_tensor_out": ("all_gather", "out"),
    "reduce_scatter_tensor": ("reduce_scatter", "in"),
    "all_reduce": ("all_reduce", "in"),
    "all_reduce_": ("all_reduce", "in"),
    "all_to_all_single": ("all_to_all", "in"),
    "broadcast": ("broadcast", "in"),
    "broadcast_": ("broadcast", "in"),
}
GEMMS = {"mm", "addmm", "bmm", "baddbmm", "addmv", "mv", "_scaled_mm", "dot"}
ATTENTION = {
    "_scaled_dot_product_flash_attention_for_cpu": 1.0,
    "_scaled_dot_product_flash_attention": 1.0,
    "_scaled_dot_product_efficient_attention": 1.0,
    "_scaled_dot_product_cudnn_attention": 1.0,
    "zigzag_causal_attention": 1.0,
    # backward: recompute QK^T and P, then dV, dP, dQ, dK: 5 matmuls where forward has 2
    "_scaled_dot_product_flash_attention_for_cpu_backward": 2.5,
    "_scaled_dot_product_flash_attention_backward": 2.5,
    "_scaled_dot_product_efficient_attention_backward": 2.5,
    "_scaled_dot_product_cudnn_attention_backward": 2.5,
    "zigzag_causal_attention_backward": 2.5,
}
NO_DATA = {"empty", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "sym_size"}


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _nbytes(ts: Sequence[torch.Tensor]) -> float:
    return float(sum(t.numel() * t.element_size() for t in ts))


def _attention_qk(name: str, args: Sequence[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """An attention op's query and key (a backward takes the output's gradient first)."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    return (tensors[1], tensors[2]) if name.endswith("_backward") else (tensors[0], tensors[1])


def attention_flops(name: str, args: Sequence[Any], kwargs: dict[str, Any]) -> float:
    """FLOPs of an attention op: 4·B·Hq·Sq·Sk·d for the forward (QK^T and PV), halved by a
    causal mask (``is_causal``, and tspc's zigzag kernel, whose D ranks together do one causal
    attention), times 2.5 for a backward."""
    q, k = _attention_qk(name, args)
    b, hq, sq, d = q.shape[0], q.shape[1], q.shape[-2], q.shape[-1]
    sk = k.shape[-2]
    causal = "zigzag" in name or bool(kwargs.get("is_causal"))
    if not causal:  # positional is_causal (aten SDPA: dropout_p, is_causal after q, k, v)
        bools = [a for a in args if isinstance(a, bool)]
        causal = bool(bools and bools[0])
    fraction = 0.5 if causal else 1.0
    return ATTENTION[name] * 4.0 * b * hq * sq * sk * d * fraction


# tspc ops recorded as the ops their implementation runs (pure local compute, written in
# Python over ATen: on fake tensors they run as they would for real): op name -> the function
# of ``tspc/ops/zigzag_attention.py`` that implements it, with the op's arguments in order
EXPANDED = {
    "zigzag_causal_attention": "_forward",
    "zigzag_causal_attention_backward": "_attention_backward",
}


class OpRecorder(TorchDispatchMode):
    """``with OpRecorder(devices) as rec: step()`` -> ``rec.ops`` (see the module doc)."""

    def __init__(self, devices: int) -> None:
        super().__init__()
        self.devices = devices
        self.ops: list[Op] = []
        self._pending: WeakIdKeyDictionary = WeakIdKeyDictionary()  # storage -> handle
        self._handles = 0

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True  # see FakeMemoryTracker: record the compiled graphs, not their tracing

    def _handle_of(self, t: torch.Tensor) -> int:
        try:
            return self._pending.get(t.untyped_storage(), -1)
        except (RuntimeError, NotImplementedError):
            return -1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            return NotImplemented  # let DTensor unwrap: its local ops come back here
        out = func(*args, **kwargs)
        expand = EXPANDED.get(getattr(func, "_opname", "")) if func.namespace == "tspc" else None
        if expand is not None:
            # the kernel's own ops, as they run (its block SDPAs, slices and merges), in place
            # of one op with the whole attention's FLOPs
            schema = op_schema(func).arguments
            positional = [
                args[i] if i < len(args) else kwargs.get(a.name, a.default_value)
                for i, a in enumerate(schema)
            ]
            from tspc.ops import zigzag_attention

            with self:
                getattr(zigzag_attention, expand)(*positional)
            return out
        self.record(func, args, kwargs, out)
        return out

    def record(self, func: Any, args: Sequence[Any], kwargs: dict[str, Any], out: Any) -> None:
        namespace = getattr(func, "namespace", "")
        name = getattr(func, "_opname", str(func))
        ins, outs = _tensors((args, kwargs)), _tensors(out)
        dtype = DTYPE_NAMES.get((outs or ins or [torch.empty(0)])[0].dtype, "fp32")
        if name == "wait_tensor":
            self.ops.append(Op(name, "wait", handle=self._handle_of(ins[0])))
            return
        start = None
        if namespace == "tspc" and name in TSPC_STARTS:
            start = TSPC_STARTS[name]
        elif namespace in ("_c10d_functional", "c10d_functional") and name in FUNCOL:
            start = FUNCOL[name]
        if start is not None:
            kind, side = start
            payload = _nbytes(outs if side == "out" else ins[:1])
            self._handles += 1
            for t in outs:
                self._pending[t.untyped_storage()] = self._handles
            self.ops.append(
                Op(name, "start", nbytes=payload, dtype=dtype, collective=kind,
                   devices=self.devices, handle=self._handles)
            )  # fmt: skip
            return
        if namespace == "c10d":  # a blocking c10d collective (dist.* called in eager code)
            kind = "all_reduce" if "allreduce" in name else "broadcast"
            self.ops.append(
                Op(name, "sync", nbytes=_nbytes(ins[:1]), dtype=dtype, collective=kind,
                   devices=self.devices)
            )  # fmt: skip
            return
        if not outs:  # metadata queries (prim::device, sizes): no kernel, no data
            self.ops.append(Op(name, "compute", cls="meta", dtype=dtype))
            return
        if getattr(func, "is_view", False) or name in NO_DATA:
            self.ops.append(Op(name, "compute", cls="view", dtype=dtype))
            return
        nbytes = _nbytes(ins) + _nbytes(outs)
        if name in ATTENTION:
            flops = attention_flops(name, args, kwargs)
            head_dim = int(_attention_qk(name, args)[0].shape[-1])
            self.ops.append(
                Op(name, "compute", "attention", flops, nbytes, dtype, head_dim=head_dim)
            )
            return
        packet = getattr(func, "overloadpacket", None)
        flops = 0.0
        if packet in flop_registry:
            try:
                flops = float(flop_registry[packet](*args, **kwargs, out_val=out))
            except Exception:  # a formula that does not take this overload's arguments
                flops = 0.0
        cls = "gemm" if name in GEMMS else "memory"
        self.ops.append(Op(name, "compute", cls, flops, nbytes, dtype))


def is_traceable_wrapper_subclass_type(t: type) -> bool:
    """Whether ``t`` is a wrapper subclass (DTensor) whose ops unwrap to local ones."""
    return hasattr(t, "__tensor_flatten__") and hasattr(t, "__tensor_unflatten__")
