"""Record one training step (forward + loss + backward) of each scheme as rank r of D, on fake
tensors and torch's ``fake`` process group, as ``tspc plan --measure`` runs it.

* ``tsp``: the reference model compiled with ``backend="tsp"`` (inner aot_eager): the real
  rewritten per-rank forward and backward graphs, op by op.
* ``tp`` / ``tp_sp``: the same model under torch's own tensor-parallel plans
  (:mod:`tspc.tools.baselines`, what ``bench/throughput.py`` measures), run eagerly: DTensor
  issues its functional collectives and the recorder sees its local ops.
* ``cp``: context parallelism with zigzag ring attention: every rank holds all weights and S/D
  tokens (zigzag), and each attention is a ring of D steps passing K/V (forward) and K/V with
  dK/dV (backward) point to point, each hop overlapped with one block of attention. It is
  recorded from the model run on S/D tokens in one process, with each attention op replaced by
  that ring, and a gradient all-reduce of each layer's weights (DDP-style, over the D ranks,
  overlapped with the rest of the backward) added after the layer's attention backward.

The optimizer step is not part of the step (as in ``bench/throughput.py``: its cost is the
same elementwise update of 1/D of the weights under TSP, TP and TP+SP).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from tspc.tools.fake_run import (
    TORCH_DTYPES,
    LossModel,
    _default_dtype,
    _fake_group,
    _keep_fake_parameter_class,
    ref_config_from_shape,
)
from tspc.tools.timemodel.trace import ATTENTION, Op, OpRecorder

SCHEMES = ("tsp", "tp", "tp_sp", "cp")
LABELS = {"tsp": "TSP", "tp": "TP", "tp_sp": "TP+SP", "cp": "CP (ring)"}
RECOMPUTE = ("none", "full")


class _Checkpointed(nn.Module):
    """A decoder layer whose activations are recomputed in backward (full recomputation)."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, *args: Any) -> Any:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.layer, *args, use_reentrant=False)


def _checkpoint_layers(model: nn.Module) -> None:
    for i, layer in enumerate(model.layers):
        model.layers[i] = _Checkpointed(layer)


def trace_step(
    shape: Any,
    scheme: str,
    *,
    devices: int,
    seq_len: int,
    micro_batch: int = 1,
    dtype: str = "bf16",
    layers: int | None = None,
    recompute: str = "none",
    rank: int = 0,
) -> list[Op]:
    """The ops of one step of ``scheme`` as ``rank`` of ``devices``, in program order."""
    if scheme not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose from {SCHEMES}")
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")
    if seq_len % (2 * devices):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2*D = {2 * devices}")
    config = ref_config_from_shape(shape, layers)
    if scheme == "cp":
        return _trace_cp(config, devices, seq_len, micro_batch, dtype, recompute)
    from tspc.runtime.compat import FakeTensorMode, no_fake_mode
    from tspc.samples.reference_model import RefModel

    torch.compiler.reset()
    with (
        _fake_group(rank, devices),
        _default_dtype(TORCH_DTYPES[dtype]),
        _keep_fake_parameter_class(),
        FakeTensorMode(),
    ):
        base = RefModel(config)
        if scheme == "tsp":
            model = LossModel(base)
            step = torch.compile(
                model,
                backend="tsp",
                options={"recompute": recompute, "inner": "aot_eager"},
            )
        else:
            from torch.distributed.device_mesh import init_device_mesh

            from tspc.tools.baselines import build_tp, build_tp_sp

            with no_fake_mode():
                mesh = init_device_mesh("cpu", (devices,))
            (build_tp if scheme == "tp" else build_tp_sp)(base, mesh)
            if recompute == "full":
                _checkpoint_layers(base)
            model = step = LossModel(base)
        ids = torch.randint(0, config.vocab_size, (micro_batch, seq_len))
        targets = torch.randint(0, config.vocab_size, (micro_batch, seq_len))
        # One step first, not recorded: TSP compiles; DTensor fills its sharding-propagation
        # cache, whose first look at an op runs it on fake tensors (the recorder would count it)
        step(ids, targets).backward()
        for p in model.parameters():
            p.grad = None
        recorder = OpRecorder(devices)
        with recorder:
            step(ids, targets).backward()
    torch.compiler.reset()
    return recorder.ops


def _trace_cp(
    config: Any, devices: int, seq_len: int, micro_batch: int, dtype: str, recompute: str
) -> list[Op]:
    """Context parallelism (module doc): the local step with each attention made a ring."""
    from tspc.runtime.compat import FakeTensorMode
    from tspc.samples.reference_model import RefModel

    local = seq_len // devices
    with _default_dtype(TORCH_DTYPES[dtype]), FakeTensorMode():
        base = RefModel(config)
        if recompute == "full":
            _checkpoint_layers(base)
        model = LossModel(base)
        ids = torch.randint(0, config.vocab_size, (micro_batch, local))
        targets = torch.randint(0, config.vocab_size, (micro_batch, local))
        recorder = OpRecorder(1)
        with recorder:
            model(ids, targets).backward()
        layer_bytes = sum(p.numel() * p.element_size() for p in base.layers[0].parameters())
    return ring_attention(recorder.ops, devices, float(layer_bytes))


def ring_attention(ops: list[Op], devices: int, layer_grad_bytes: float) -> list[Op]:
    """Replace each attention op of a one-rank, S/D-token step by zigzag ring attention over
    ``devices`` ranks (module doc). A local attention of S/D queries against S/D keys becomes D
    blocks whose FLOPs add up to 1/D of the full causal attention (zigzag balances them); the
    K/V of the local op (its bytes) travel one hop per step, with dK/dV in backward."""
    out: list[Op] = []
    handle = 10**9
    grad_handles = []
    d = devices
    for op in ops:
        if op.kind != "compute" or op.name not in ATTENTION:
            out.append(op)
            continue
        backward = op.name.endswith("_backward")
        # the local op is causal over S/D tokens: 1/(2 D^2) of full attention's work without
        # the mask; the ring's D blocks together do 1/(2D) of it -> D times the local op
        total = op.flops * d
        # K and V (forward: of q, k, v, out) or K, V, dK, dV (backward: of dout, q, k, v,
        # out, dq, dk, dv): half the op's bytes when heads are not grouped
        kv = op.nbytes / 2
        for step in range(d):
            if step + 1 < d:
                handle += 1
                out.append(Op("ring_kv_start", "start", nbytes=kv, dtype=op.dtype,
                              collective="p2p", devices=d, handle=handle))  # fmt: skip
            out.append(dataclasses.replace(op, flops=total / d))
            if step + 1 < d:
                out.append(Op("wait_tensor", "wait", handle=handle))
        if backward and d > 1:
            handle += 1
            grad_handles.append(handle)
            out.append(Op("grad_all_reduce", "start", nbytes=layer_grad_bytes, dtype=op.dtype,
                          collective="all_reduce", devices=d, handle=handle))  # fmt: skip
    out += [Op("wait_tensor", "wait", handle=h) for h in grad_handles]
    return out
