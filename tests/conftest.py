"""Shared fixtures: graph-only runs on the ``fake`` process group, Dynamo graph capture."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

# Multi-process tests reuse their worker processes between tests of the same world size
# (tspc/launch.py): a new worker's imports cost more than most tests' work.
os.environ.setdefault("TSPC_SPAWN_POOL", "1")
# The backend's default inner compiler is Inductor; the tests compile with aot_eager (the same
# aot_autograd graphs, run op by op: a fraction of Inductor's compile time) unless they ask for
# Inductor by option. Spawned ranks inherit the variable.
os.environ.setdefault("TSPC_INNER", "aot_eager")


@pytest.fixture
def fake_group():
    """A factory: ``fake_group(rank, world)`` initialises the fake process-group backend (no
    communication, no peers) as that rank, so passes and compiled graphs run in this process."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def make(rank: int, world: int):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        from tspc.runtime.group import resolve_group

        return resolve_group()

    yield make
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch.compiler.reset()
    yield
    torch.compiler.reset()


# The files that take longest (their tests' ``--durations`` summed, 2026-12-07), longest first.
_RUN_FIRST = {
    name: i
    for i, name in enumerate(
        (
            "test_zoo.py",
            "test_peer_zoo.py",
            "test_masks.py",
            "test_any_length.py",
            "test_fsdp_2d.py",
            "test_peer_forms.py",
            "test_reliability.py",
            "test_training_idioms.py",
            "test_recompute.py",
            "test_trust_masks.py",
            "test_trust_ranks.py",
            "test_equivalence_forward.py",
            "test_moe.py",
            "test_graph_schedules.py",
            "test_generate_moe.py",
            "test_training.py",
            "test_moe_checkpoint.py",
            "test_prefill_buckets.py",
            "test_dynamic_seq.py",
            "test_plan_measure.py",
            "test_hf_models.py",
            "test_trust_fallback.py",
        )
    )
}


def pytest_collection_modifyitems(config, items):
    """Tiers. ``slow``: multi-process runs, Inductor, and every test that compiles a whole
    model in this process (it uses the ``fake_group`` fixture: Dynamo, the passes and
    aot_autograd, seconds each); ``-m "not slow"`` is the pass-level tier on small traced
    graphs. The extended tier (marker ``extended``: D = 4 repeats of feature tests, the memory
    bench's quick run) runs only with TSPC_EXTENDED=1, so the README's test command stays within
    its time budget; see docs/testing.md."""
    for item in items:
        if "fake_group" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
    # The longest files first: with the README's two pytest processes (``-n 2 --dist
    # loadfile``) a long file handed out last would run alone while the other process idles.
    # A stable sort: every process computes the same order, and a file's tests keep theirs.
    items.sort(key=lambda item: _RUN_FIRST.get(item.path.name, len(_RUN_FIRST)))
    if os.environ.get("TSPC_EXTENDED") == "1":
        return
    skip = pytest.mark.skip(reason="extended tier: TSPC_EXTENDED=1 python -m pytest -m extended")
    for item in items:
        if "extended" in item.keywords:
            item.add_marker(skip)
