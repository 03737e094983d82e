"""Shared fixtures: graph-only runs on the ``fake`` process group, Dynamo graph capture."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist


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
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
