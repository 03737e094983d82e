"""Would these graphs run on CUDA? CPU-only ops in traced graphs, and the attention kernels chosen.

Two checks over the aot_autograd graphs of a compile traced on fake CUDA tensors
(``tspc dump --device cuda``):

* ``cpu_only_ops``: every ``OpOverload`` the graphs call must have a CUDA kernel: no name with
  ``_for_cpu``, and a CUDA or composite kernel in the dispatcher. A CPU-only build of torch
  registers no CUDA kernels at all, so there the answer comes from the dispatch table torch
  ships in ``torchgen/packaged/ATen/native/native_functions.yaml`` (the source the dispatcher's
  registrations are generated from): an aten op has a CUDA kernel if its entry, or the entry
  it is a ``structured_delegate`` of, lists ``CUDA`` or a composite key, or lists none.
* ``attention_kernels``: the zigzag attention op is one custom-op node whose body picks its
  kernels at run time (``tspc/ops/attention_kernels.py``), so the graph alone does not show
  them. Its forward and backward bodies are run on fake tensors of the node's own shapes and
  device, and every aten op they call is recorded: the kernels chosen, checked like the graphs.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import re
from collections.abc import Iterable

import torch

from tspc.runtime.compat import (
    OpOverload,
    TorchDispatchMode,
    fake_tensor_mode,
    has_kernel_for_dispatch_key,
)

_COMPOSITE = (
    "CompositeExplicitAutograd",
    "CompositeExplicitAutogradNonFunctional",
    "CompositeImplicitAutograd",
)
# aten ops that are attention kernels, by the name the report gives them
ATTENTION_OPS = {
    "aten::_scaled_dot_product_flash_attention_for_cpu": "cpu_flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu_backward": "cpu_flash",
    "aten::_scaled_dot_product_flash_attention": "cuda_flash",
    "aten::_scaled_dot_product_flash_attention_backward": "cuda_flash",
    "aten::_scaled_dot_product_efficient_attention": "cuda_efficient",
    "aten::_scaled_dot_product_efficient_attention_backward": "cuda_efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cuda_cudnn",
    "aten::_scaled_dot_product_cudnn_attention_backward": "cuda_cudnn",
}


@functools.cache
def _yaml_dispatch() -> dict[str, tuple[set[str], str | None]]:
    """{op name with overload: (dispatch keys, structured_delegate)} from native_functions.yaml."""
    spec = importlib.util.find_spec("torchgen")
    if spec is None or not spec.submodule_search_locations:
        return {}
    path = os.path.join(
        spec.submodule_search_locations[0], "packaged", "ATen", "native", "native_functions.yaml"
    )
    if not os.path.exists(path):
        return {}
    table: dict[str, tuple[set[str], str | None]] = {}
    name, in_dispatch = None, False
    with open(path) as f:
        for line in f:
            m = re.match(r"- func: ([\w.]+)\(", line)
            if m:
                name, in_dispatch = m.group(1), False
                table[name] = (set(), None)
                continue
            if name is None:
                continue
            if line.startswith("  dispatch:"):
                in_dispatch = True
            elif in_dispatch and line.startswith("    ") and ":" in line:
                keys = line.split(":", 1)[0]
                table[name][0].update(k.strip() for k in keys.split(","))
            elif line.startswith("  structured_delegate:"):
                table[name] = (table[name][0], line.split(":", 1)[1].strip())
                in_dispatch = False
            elif line.startswith("  ") and not line.startswith("    "):
                in_dispatch = False
    return table


def _yaml_has_cuda(name: str) -> bool | None:
    """From native_functions.yaml: None when the op is not in it."""
    table = _yaml_dispatch()
    short = name.split("::", 1)[1]
    if short.endswith(".default"):
        short = short[: -len(".default")]
    if short not in table:
        return None
    keys, delegate = table[short]
    if delegate is not None and delegate in table:
        keys = keys | table[delegate][0]
    if not keys and delegate is None:
        return True  # no dispatch section: CompositeImplicitAutograd
    return any(k == "CUDA" or k.startswith("Composite") for k in keys)


def has_cuda_kernel(op: OpOverload) -> bool:
    """Whether ``op`` can run on CUDA (see the module doc)."""
    name = op.name()
    if "_for_cpu" in name:
        return False
    if name.startswith("prim::"):  # TorchScript metadata ops (prim::device): no kernel runs
        return True
    if any(has_kernel_for_dispatch_key(name, k) for k in ("CUDA", *_COMPOSITE)):
        return True
    if torch.backends.cuda.is_built():
        return False  # the dispatcher is complete on a CUDA build
    if name.startswith("aten::"):
        return bool(_yaml_has_cuda(name))
    return False


def graph_ops(gms: Iterable[torch.fx.GraphModule]) -> set[OpOverload]:
    return {
        n.target
        for gm in gms
        for n in gm.graph.nodes
        if n.op == "call_function" and isinstance(n.target, OpOverload)
    }


def cpu_only_ops(ops: Iterable[OpOverload]) -> list[str]:
    """Names of the ops that have no CUDA kernel, sorted."""
    return sorted({op.name() for op in ops if not has_cuda_kernel(op)})


class _OpRecorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: set[OpOverload] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.add(func)
        return func(*args, **(kwargs or {}))


def _fake_like(mode, x):
    if isinstance(x, torch.Tensor):
        with mode:
            return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device)
    return x


def attention_kernel_ops(gms: Iterable[torch.fx.GraphModule]) -> dict[str, set]:
    """{"forward"/"backward": aten ops} that the zigzag attention nodes of ``gms`` run, from
    their bodies run on fake tensors of each node's shapes, dtypes and device."""
    from tspc.ops import zigzag_attention as zz

    fwd_op = torch.ops.tspc.zigzag_causal_attention.default
    out: dict[str, set] = {"forward": set(), "backward": set()}
    for gm in gms:
        for n in gm.graph.nodes:
            if n.target is not fwd_op:
                continue
            vals = [a.meta.get("val") if isinstance(a, torch.fx.Node) else a for a in n.args]
            q, k, v, rank, world, scale, *rest = vals
            valid = rest[0] if rest else n.kwargs.get("key_valid")
            if isinstance(valid, torch.fx.Node):
                valid = valid.meta.get("val")
            # documents only decide which blocks run (data, read on the host), not the kernels
            window = rest[1] if len(rest) > 1 else n.kwargs.get("window")
            mode = fake_tensor_mode(allow_non_fake_inputs=True)
            q, k, v, valid = (_fake_like(mode, t) for t in (q, k, v, valid))
            with mode, torch.no_grad():
                rec = _OpRecorder()
                with rec:
                    o, lse = zz._forward(q, k, v, rank, world, scale, valid, window)
                out["forward"] |= rec.ops
                rec = _OpRecorder()
                with rec:
                    zz._attention_backward(o, q, k, v, o, lse, rank, world, scale, valid, window)
                out["backward"] |= rec.ops
    return out


def kernels_named(ops: Iterable[OpOverload]) -> list[str]:
    """The attention kernels (``ATTENTION_OPS`` names) among ``ops``, sorted."""
    return sorted({ATTENTION_OPS[op.name()] for op in ops if op.name() in ATTENTION_OPS})


def check_graphs(forward_gms: list, backward_gms: list) -> dict:
    """The device check of one compiled graph: what ``tspc dump --device cuda`` reports."""
    fwd, bwd = graph_ops(forward_gms), graph_ops(backward_gms)
    inner = attention_kernel_ops(forward_gms)
    return {
        "cpu_only_ops": {
            "forward graph": cpu_only_ops(fwd),
            "backward graph": cpu_only_ops(bwd),
            "zigzag attention forward": cpu_only_ops(inner["forward"]),
            "zigzag attention backward": cpu_only_ops(inner["backward"]),
        },
        "attention_kernels": {
            "forward graph": kernels_named(fwd),
            "backward graph": kernels_named(bwd),
            "zigzag attention forward": kernels_named(inner["forward"]),
            "zigzag attention backward": kernels_named(inner["backward"]),
        },
        "backward_graph_traced": bool(backward_gms),
        "ops_checked": len(fwd | bwd | inner["forward"] | inner["backward"]),
    }
