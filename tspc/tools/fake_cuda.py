"""Fake CUDA tensors on any build of torch, for checks that need no GPU (``tspc dump --device cuda``).

``FakeTensorMode`` makes tensors on ``cuda`` with shape, dtype and device but no data, and runs
every op through its meta kernel, so Dynamo, the passes and aot_autograd produce the graphs a
GPU run would (SDPA lowers to the CUDA flash / efficient ops, not the CPU ones). Two things in
torch still want a CUDA runtime:

* Ops look up the CUDA *device guard*. On a CUDA build without a device, ``FakeTensorMode``
  installs a no-op guard itself (``torch._C._ensureCUDADeviceGuardSet``); on a CPU-only build
  there is no guard to replace and an op on a fake CUDA tensor fails ("PyTorch is not linked
  with support for cuda devices"), or aborts the process where it happens in C++ (autograd
  metadata). ``ensure_device_guard`` registers c10's own ``FakeGuardImpl<CUDA>`` from a
  20-line shared library compiled once with the system C++ compiler (about 2 s, cached).
* The autograd engine asks for the current accelerator stream, which no guard can fake. So
  without a real GPU, graphs are traced *without* autograd (inference: the forward graph
  only); ``autograd_available()`` says which.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sysconfig

import torch

_GUARD_SOURCE = r"""
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>
namespace {
c10::impl::FakeGuardImpl<c10::DeviceType::CUDA> fake_guard;
}
// Registers a no-op CUDA device guard, as torch does itself on CUDA builds without a device.
extern "C" int tspc_register_fake_cuda_guard() {
  static c10::impl::DeviceGuardImplRegistrar registrar(c10::DeviceType::CUDA, &fake_guard);
  return 1;
}
"""
_LOADED = False


class FakeCudaUnavailable(RuntimeError):
    """The no-op CUDA device guard could not be built (no C++ compiler)."""


def autograd_available() -> bool:
    """Backward graphs on fake CUDA tensors need a real CUDA device (see the module doc)."""
    return torch.cuda.is_available()


def _cache_dir() -> str:
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "tspc")


def ensure_device_guard() -> None:
    """Make fake CUDA tensors usable in this process (a no-op on CUDA builds)."""
    global _LOADED
    if _LOADED or torch.backends.cuda.is_built():
        return
    torch_dir = os.path.dirname(torch.__file__)
    tag = hashlib.sha1((_GUARD_SOURCE + torch.__version__ + torch_dir).encode()).hexdigest()[:12]
    lib = os.path.join(_cache_dir(), f"fake_cuda_guard_{tag}.so")
    if not os.path.exists(lib):
        os.makedirs(_cache_dir(), exist_ok=True)
        src = lib[:-3] + ".cpp"
        with open(src, "w") as f:
            f.write(_GUARD_SOURCE)
        cxx = os.environ.get("CXX") or sysconfig.get_config_var("CXX") or "c++"
        tmp = f"{lib}.{os.getpid()}.tmp"
        cmd = [
            *cxx.split(), "-O1", "-shared", "-fPIC", "-std=c++17",
            f"-I{torch_dir}/include", src, f"-L{torch_dir}/lib", "-lc10",
            f"-Wl,-rpath,{torch_dir}/lib", "-o", tmp,
        ]  # fmt: skip
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
        except (OSError, subprocess.SubprocessError) as e:
            detail = getattr(e, "stderr", "") or str(e)
            raise FakeCudaUnavailable(
                "this torch has no CUDA and the no-op CUDA device guard that fake CUDA tensors "
                f"need could not be compiled ({' '.join(cmd[:1])}): {detail.strip()[-400:]}"
            ) from e
        os.replace(tmp, lib)  # atomic: concurrent processes never load a half-written file
    ctypes.CDLL(lib).tspc_register_fake_cuda_guard()
    _LOADED = True


def fake_cuda_like(mode, t: torch.Tensor, requires_grad: bool = False) -> torch.Tensor:
    """A fake CUDA tensor in ``mode`` with ``t``'s shape, strides and dtype (no data)."""
    with mode:
        out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cuda")
    return out.requires_grad_(requires_grad and t.is_floating_point())


def model_to_fake_cuda(model: torch.nn.Module, mode, *, requires_grad: bool) -> torch.nn.Module:
    """``model`` with every parameter and buffer replaced by a fake CUDA tensor (in place; a
    parameter shared by two modules, e.g. tied embeddings, stays shared)."""
    done: dict[int, torch.Tensor] = {}
    for mod in model.modules():
        for name, p in list(mod._parameters.items()):
            if p is not None:
                if id(p) not in done:
                    grad = requires_grad and p.requires_grad
                    new = fake_cuda_like(mode, p.detach(), grad)
                    done[id(p)] = torch.nn.Parameter(new, requires_grad=new.requires_grad)
                mod._parameters[name] = done[id(p)]
        for name, b in list(mod._buffers.items()):
            if b is not None:
                mod._buffers[name] = done.setdefault(id(b), fake_cuda_like(mode, b))
    return model
