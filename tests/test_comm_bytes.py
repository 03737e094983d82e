"""Bytes received per layer per rank, measured by the runtime's counters, against the formula

    (D-1)/D * beta * (P_attn + P_mlp + 2 * B * S * h_kv)          (PAPER_NOTES.md)

with P_attn = 2 h^2 + 2 h h_kv (q, o and k, v projections), P_mlp = 3 h F, in the model's
dtype (fp32 here: beta = 4). The total is also counted from torch's own profiler records of the
gloo operations (``received_bytes_from_profiler``), independently of tspc's counters.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import D4_EXTENDED
from tspc.launch import spawn


def received_bytes_from_profiler(events, rank: int, element_size: int) -> int:
    """Bytes this rank received, read off torch's profiler records of the c10d/gloo ops:
    a broadcast's tensor unless this rank is its root (the root from c10d's record, the size
    from gloo's, in issue order), an all-gather's output less this rank's input, a receive's
    tensor. Any other collective fails the count (none runs in a forward)."""

    def numel(shape) -> int:
        return math.prod(shape)

    events = sorted(events, key=lambda e: e.time_range.start)
    roots = [e.concrete_inputs[2] for e in events if e.name == "c10d::broadcast_"]
    sizes = [numel(e.input_shapes[0]) for e in events if e.name == "gloo:broadcast"]
    assert len(roots) == len(sizes), (roots, sizes)
    total = sum(n for root, n in zip(roots, sizes) if root != rank)
    for e in events:
        if e.name == "c10d::_allgather_base_":
            total += numel(e.input_shapes[0]) - numel(e.input_shapes[1])
        elif e.name == "gloo:recv":
            total += numel(e.input_shapes[0])
        elif e.name.startswith("c10d::") and e.name not in (
            "c10d::broadcast_",
            "c10d::send",
            "c10d::recv_",
        ):
            raise AssertionError(f"unexpected collective {e.name}")
    return total * element_size


def bytes_worker(rank: int, world: int, cases: list[dict]) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    import tspc
    from samples.reference_model import build_reference_model
    from tspc.runtime.counters import COUNTER

    out = []
    for case in cases:
        torch.compiler.reset()
        model = build_reference_model(seed=0, **case["model"])
        ids = torch.randint(0, 256, (case["batch"], case["seq"]))
        compiled = torch.compile(model, backend="tsp")
        with torch.no_grad():
            compiled(ids)  # compiled outside the measurement
            COUNTER.reset()
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                compiled(ids)
        snap = COUNTER.snapshot()["by_tag"]
        events = [e for e in prof.events() if e.name.startswith(("c10d::", "gloo:"))]
        out.append(
            {
                "profiled": received_bytes_from_profiler(events, rank, 4),
                "recv": {t: sum(k["recv_bytes"] for k in v.values()) for t, v in snap.items()},
                "predicted": dict(tspc.last_report().predicted_recv_bytes),
            }
        )
    return out


CASES = [
    {
        "batch": 2,
        "seq": 32,
        "model": {
            "hidden_size": 64,
            "num_heads": 4,
            "num_kv_heads": 4,
            "intermediate_size": 160,
            "num_layers": 2,
        },
    },
    {
        "batch": 1,
        "seq": 48,
        "model": {
            "hidden_size": 128,
            "num_heads": 8,
            "num_kv_heads": 4,
            "intermediate_size": 256,
            "num_layers": 1,
        },
    },
    # fewer KV heads than ranks at D = 4: checked against the schedule's own prediction
    {
        "batch": 2,
        "seq": 16,
        "model": {
            "hidden_size": 64,
            "num_heads": 4,
            "num_kv_heads": 2,
            "intermediate_size": 96,
            "num_layers": 1,
        },
    },
]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, D4_EXTENDED])
def test_bytes_received_per_layer_match_formula(world):
    results = spawn(bytes_worker, world, CASES, timeout=600)
    beta = 4  # fp32
    for rank, per_case in enumerate(results):
        for case, res in zip(CASES, per_case):
            # everything tspc's counters saw (layers and the output gather) = torch's records
            assert sum(res["recv"].values()) == res["profiled"], (rank, case, res)
            m = case["model"]
            h, f = m["hidden_size"], m["intermediate_size"]
            h_kv = h * m["num_kv_heads"] // m["num_heads"]
            b, s = case["batch"], case["seq"]
            p_attn = 2 * h * h + 2 * h * h_kv
            p_mlp = 3 * h * f
            for layer in range(m["num_layers"]):
                attn = res["recv"][f"layers.{layer}.attn"]
                mlp = res["recv"][f"layers.{layer}.mlp"]
                # the runtime measured what the schedule predicted, on every rank
                assert attn == res["predicted"][f"layers.{layer}.attn"], (rank, case)
                assert mlp == res["predicted"][f"layers.{layer}.mlp"], (rank, case)
                if m["num_kv_heads"] % world == 0:
                    want = (world - 1) * beta * (p_attn + p_mlp + 2 * b * s * h_kv) // world
                    assert attn + mlp == want, (rank, case, attn, mlp, want)
