"""A matched attention or MLP held whole on every rank for a reason the user can change warns at
compile time — not only in the report — naming the module, the reason and the D values that would
shard it; once per module per compile, never per call. Graph-only runs (the fake process group)."""

from __future__ import annotations

import warnings

import torch

from samples.reference_model import build_reference_model
from tspc import TSPHeldWholeWarning


def _warnings_of(model, calls: int = 2) -> list[str]:
    """The TSPHeldWholeWarning messages of compiling ``model`` and calling it ``calls`` times
    (every warning recorded, none deduplicated)."""
    compiled = torch.compile(model, backend="tsp")
    ids = torch.randint(0, 256, (1, 32))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            for _ in range(calls):
                compiled(ids)
    return [str(w.message) for w in caught if issubclass(w.category, TSPHeldWholeWarning)]


def test_heads_and_intermediate_size_that_d_does_not_divide_warn(fake_group):
    fake_group(0, 4)
    # 6 heads (2 KV heads) and an intermediate size of 90: D = 4 divides neither
    model = build_reference_model(
        num_layers=1, hidden_size=96, num_heads=6, num_kv_heads=2, intermediate_size=90
    )
    messages = _warnings_of(model)
    assert len(messages) == 2, messages  # one per module, though the model ran twice
    attn, mlp = sorted(messages)
    assert "attention layers.0.attn is not sharded" in attn, attn
    assert "6 query heads are not divisible by D=4" in attn, attn
    assert "1, 2, 6" in attn and "each of the 4 ranks" in attn, attn
    assert "mlp layers.0.mlp is not sharded" in mlp, mlp
    assert "intermediate size 90 not divisible by D=4" in mlp, mlp
    assert "divides its intermediate size 90: 1, 2, 3, 5, 6, 9, 10, 15, 18, 30, 45, 90" in mlp


def test_fewer_kv_heads_than_d_warns_for_the_kv_projections(fake_group):
    fake_group(0, 2)
    model = build_reference_model(num_layers=1, num_heads=4, num_kv_heads=1)
    (message,) = _warnings_of(model)  # its MLP fits D = 2: no warning for it
    assert "attention layers.0.attn: its 1 key/value heads are fewer than D=2" in message
    assert "(layers.0.attn.k_proj.weight, layers.0.attn.v_proj.weight) are held whole" in message
    assert "A D that divides its 1 key/value heads (1) shards them" in message, message
