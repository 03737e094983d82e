"""Attention kernels by device and dtype (tspc/ops/attention_kernels.py).

CPU numerics of every code path that a GPU takes and CPU can run (the math fallback, the
query-fold / per-member loop used for GQA where a kernel has no grouped heads), the CUDA paths
traced on fake CUDA tensors (which aten kernels, with which shapes), and the memory of GQA
without repeated K/V.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import zigzag_against_dense
from tspc.ops import attention_kernels as ak
from tspc.ops import zigzag_attention as zz

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.mark.parametrize(
    "device, dtype, head_dim, masked, kernel",
    [
        (CPU, torch.float32, 64, False, "cpu_flash"),
        (CPU, torch.bfloat16, 64, True, "cpu_flash"),
        (CUDA, torch.bfloat16, 128, False, "cuda_flash"),
        (CUDA, torch.float16, 256, False, "cuda_flash"),
        (CUDA, torch.bfloat16, 128, True, "cuda_efficient"),  # flash takes no mask
        (CUDA, torch.float32, 64, False, "cuda_efficient"),  # flash is half precision only
        (CUDA, torch.bfloat16, 512, False, "cuda_efficient"),  # flash: head dim <= 256
        (CUDA, torch.bfloat16, 36, False, "math"),  # unaligned head dim
        (torch.device("meta"), torch.float32, 64, False, "math"),
    ],
)
def test_kernel_choice(device, dtype, head_dim, masked, kernel):
    assert ak.choose_kernel(device, dtype, head_dim, masked) == kernel


@pytest.mark.parametrize("path", ["math", "fold"])
@pytest.mark.parametrize("world, n", [(1, 16), (2, 32), (2, 13), (4, 30)])
@pytest.mark.parametrize("kv_heads, key_padding", [(4, False), (2, True), (1, False)])
def test_gpu_code_paths_match_dense_causal_on_cpu(
    monkeypatch, path, world, n, kv_heads, key_padding
):
    """'math': the device-generic fallback; 'fold': a kernel without grouped heads (CUDA's
    efficient kernel), here CPU flash told it has none: queries folded for the prefix blocks,
    looped per group member for the causal diagonal."""
    if path == "math":
        monkeypatch.setattr(ak, "choose_kernel", lambda *a: "math")
    else:
        monkeypatch.setattr(ak, "_native_gqa", lambda kernel: False)
    zigzag_against_dense(world, n, kv_heads, key_padding)


def _fake_cuda_ops(dtype, kv_heads, padding, head_dim=64, world=2, s=64):
    """The aten ops the zigzag kernel's forward and backward call on fake CUDA tensors."""
    from tspc import device_check, fake_cuda
    from tspc.runtime.compat import fake_tensor_mode

    fake_cuda.ensure_device_guard()
    mode = fake_tensor_mode()
    with mode:
        q = torch.empty(2, 4, s // world, head_dim, device="cuda", dtype=dtype)
        k = torch.empty(2, kv_heads, s, head_dim, device="cuda", dtype=dtype)
        valid = torch.ones(2, s, dtype=torch.bool, device="cuda") if padding else None
    rec = device_check._OpRecorder()
    with mode, rec:
        o, lse = zz._forward(q, k, k, 0, world, 0.125, valid)
        dq, dk, dv = zz._attention_backward(o, q, k, k, o, lse, 0, world, 0.125, valid)
    assert o.shape == q.shape and lse.shape == q.shape[:3] and lse.dtype == torch.float32
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape
    return rec.ops


@pytest.mark.parametrize(
    "dtype, kv_heads, padding, kernel",
    [
        (torch.bfloat16, 4, False, "cuda_flash"),
        (torch.bfloat16, 1, False, "cuda_flash"),  # grouped heads natively
        (torch.float16, 2, True, "cuda_efficient"),  # key padding: a bias
        (torch.float32, 2, False, "cuda_efficient"),  # folded / looped GQA
    ],
)
def test_cuda_kernels_on_fake_cuda(dtype, kv_heads, padding, kernel):
    from tspc.device_check import cpu_only_ops, kernels_named

    ops = _fake_cuda_ops(dtype, kv_heads, padding)
    assert kernels_named(ops) == [kernel]
    assert cpu_only_ops(ops) == []
    assert torch.ops.aten.repeat_interleave.self_int not in ops  # K/V never repeated
    assert torch.ops.aten.repeat_interleave.Tensor not in ops


def test_gqa_does_not_materialise_repeated_kv():
    """8 query heads per KV head: the old kernel's repeat_interleave made 8x copies of K and V
    (2 x 4 MiB here, 24 MiB with its gradients); forward and backward now stay below the size
    of one repeated copy of K and V."""
    from tspc.memory import MemoryTracker

    torch.manual_seed(0)
    b, hq, hk, s, d, world = 1, 8, 1, 1024, 64, 2
    q = torch.randn(b, hq, s // world, d)
    k, v = torch.randn(b, hk, s, d), torch.randn(b, hk, s, d)
    repeated_kv = 2 * b * hq * s * d * 4
    with MemoryTracker() as fwd:
        o, lse = zz._forward(q, k, v, 0, world, d**-0.5, None)
    with MemoryTracker() as bwd:
        zz._attention_backward(o, q, k, v, o, lse, 0, world, d**-0.5, None)
    assert fwd.peak_bytes < repeated_kv, fwd.peak_bytes
    assert bwd.peak_bytes < repeated_kv, bwd.peak_bytes
