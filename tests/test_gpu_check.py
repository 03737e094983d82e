"""bench/gpu_check.py, the prepared GPU script: its CPU smoke path runs every section."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

from bench import gpu_check

pytestmark = pytest.mark.slow  # whole-model compiles in this process: seconds each


def test_gpu_check_smoke_runs_every_section_on_cpu():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = gpu_check.main(["--smoke"])
    text = out.getvalue()
    assert rc == 0, text
    for title in ("1. zigzag kernel", "2. attention forward + backward", "3. end to end"):
        assert title in text
    assert "kernel checks ok" in text and "FAIL" not in text
    assert text.count("(cpu_flash)") == 6  # 3 cases x D = 2, 4


def test_gpu_check_without_cuda_says_what_it_skips():
    if torch.cuda.is_available():
        return
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert gpu_check.main([]) == 0
    assert "CUDA is not available: skipping the GPU sections" in out.getvalue()
