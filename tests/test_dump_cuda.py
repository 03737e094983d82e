"""`tspc dump --device cuda`: the rank graphs traced on fake CUDA tensors hold no CPU-only op,
and the report names the attention kernels chosen (no GPU needed)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_dump import REF_TARGET, run_cli
from tspc.tools.device_check import has_cuda_kernel

pytestmark = pytest.mark.slow  # whole-model compiles in this process: seconds each

aten = torch.ops.aten

BF16_MODEL = """
import torch
from tspc.samples.reference_model import build_reference_model


def build_model_and_inputs(seq, batch):
    model = build_reference_model(num_layers=1, num_heads=4, num_kv_heads=1).to(torch.bfloat16)
    return model, torch.randint(0, 256, (batch, seq))
"""


def test_cuda_kernel_lookup():
    assert not has_cuda_kernel(aten._scaled_dot_product_flash_attention_for_cpu.default)
    assert not has_cuda_kernel(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    for op in (
        aten.mm.default,  # structured: its CUDA kernel is on mm.out
        aten.add.Tensor,
        aten.view.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention_backward.default,
        torch.ops.tspc.zigzag_causal_attention.default,  # composite custom op
    ):
        assert has_cuda_kernel(op), op

    @torch.library.custom_op("tspc_test::cpu_only", mutates_args=(), device_types="cpu")
    def cpu_only(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    assert not has_cuda_kernel(torch.ops.tspc_test.cpu_only.default)


def _dump(tmp_path, target, *extra):
    out = tmp_path / "dump"
    rc, stdout, stderr = run_cli(
        target, "--world-size", "2", "--seq", "32", "--out", str(out), "--device", "cuda", *extra
    )
    assert rc == 0, stderr + stdout
    graph_dir = out / "rank0" / "graph0"
    check = json.loads((graph_dir / "device_check.json").read_text())
    return stdout, graph_dir, check


def test_dump_reference_model_on_fake_cuda_fp32(tmp_path):
    stdout, graph_dir, check = _dump(tmp_path, REF_TARGET, "--set", "num_layers=1")
    assert "on fake CUDA tensors" in stdout
    assert "every op has a CUDA kernel" in stdout
    assert all(ops == [] for ops in check["cpu_only_ops"].values()), check
    assert check["ops_checked"] > 20
    # fp32: flash is half precision only, so the memory-efficient kernel, forward and backward
    assert check["attention_kernels"]["zigzag attention forward"] == ["cuda_efficient"]
    assert check["attention_kernels"]["zigzag attention backward"] == ["cuda_efficient"]
    forward = (graph_dir / "forward.py").read_text()
    assert "device(type='cuda'" in forward and "_for_cpu" not in forward
    assert "tspc.zigzag_causal_attention" in forward
    if not torch.cuda.is_available():
        assert not check["backward_graph_traced"] and "backward graph not traced" in stdout


def test_dump_bf16_gqa_model_on_fake_cuda_uses_flash(tmp_path):
    target = tmp_path / "bf16_model.py"
    target.write_text(BF16_MODEL)
    stdout, _, check = _dump(tmp_path, str(target))
    assert all(ops == [] for ops in check["cpu_only_ops"].values()), check
    assert check["attention_kernels"]["zigzag attention forward"] == ["cuda_flash"]
    assert check["attention_kernels"]["zigzag attention backward"] == ["cuda_flash"]
    assert "zigzag attention forward: cuda_flash" in stdout


def test_cpu_dump_writes_no_device_check(tmp_path):
    out = tmp_path / "d"
    rc, _, stderr = run_cli(
        REF_TARGET, "-D", "2", "--seq", "32", "--out", str(out), "--no-backward",
        "--set", "num_layers=1", "--device", "cpu",
    )  # fmt: skip
    assert rc == 0, stderr
    assert not (out / "rank0" / "graph0" / "device_check.json").exists()
