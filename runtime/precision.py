"""The dtype that sums, softmaxes and log-sum-exps run in: fp32 for 16-bit floats (whose sums
would round at every step), the tensor's own dtype otherwise. A float64 model (gradient checks
against finite differences run one) stays float64 end to end: an unconditional ``.float()``
would round it to fp32, and torch's float64 kernels refuse an fp32 log-sum-exp."""

from __future__ import annotations

import torch

HALF = (torch.float16, torch.bfloat16)


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in HALF else dtype


def upcast(x: torch.Tensor) -> torch.Tensor:
    """``x`` in its accumulation dtype (no copy when it is already)."""
    return x.to(accumulation_dtype(x.dtype))
