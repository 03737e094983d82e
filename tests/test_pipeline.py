"""The pass pipeline as a registry (``tspc/pipeline.py``): one loop runs every listed pass in
order, and the rewrites declare the weights' slices in the store they are given — none of it
lands in the runtime's process-wide store. Graph-only, rank 0 of 2 on the fake group."""

from __future__ import annotations

import torch

from samples.reference_model import build_reference_model
from tests.helpers import capture
from tspc.options import TSPOptions
from tspc.pipeline import PIPELINE, run_pipeline
from tspc.runtime.shard_store import STORE, ShardStore


def test_every_pass_runs_in_order_and_shards_go_to_the_given_store(fake_group, tmp_path):
    group = fake_group(0, 2)
    model = build_reference_model(num_layers=1)
    gm, inputs = capture(model, torch.randint(0, 256, (2, 16)))
    store = ShardStore()
    opts = TSPOptions(dump_dir=str(tmp_path))  # snapshots are kept only for a dump
    res = run_pipeline(gm, inputs, group, opts, store=store)
    assert [name for name, _ in res.snapshots] == ["captured"] + [p.name for p in PIPELINE]
    assert sorted((e.kind, e.status) for e in res.report.entries) == [
        ("attention", "matched"),
        ("mlp", "matched"),
    ]
    params = [t for t in inputs if isinstance(t, torch.nn.Parameter)]
    sharded = [p for p in params if p in store]
    # q, k, v, o and gate, up, down: declared in the given store, not in the runtime's
    assert len(sharded) == 7, len(sharded)
    assert not any(p in STORE for p in params)
    assert len(res.shard_inputs) >= 7
