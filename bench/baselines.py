"""The benchmarks' baselines (TP, TP+SP with torch's own plans): they live in
``tspc/tools/baselines.py`` so that ``tspc plan --time`` traces the same models; this file keeps
``from bench.baselines import ...`` working."""

from tspc.tools.baselines import (  # noqa: F401
    build_tp,
    build_tp_sp,
    default_mesh,
    full_parameters,
    param_groups,
)

__all__ = ["build_tp", "build_tp_sp", "default_mesh", "full_parameters", "param_groups"]
