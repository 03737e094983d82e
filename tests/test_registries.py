"""Process-wide registries are owned by what they describe: the TSP group's DeviceMesh lives
while something made on it does, and goes with it (``runtime/tsp_params.py``)."""

from __future__ import annotations

import gc
import weakref

import torch
from torch.distributed.tensor import DTensor, Replicate

from tspc.runtime.tsp_params import mesh_of


def test_the_mesh_lives_with_what_is_made_on_it(fake_group):
    group = fake_group(0, 2)
    mesh = mesh_of(group.name, torch.device("cpu"))
    assert mesh_of(group.name, torch.device("cpu")) is mesh  # one mesh while it is in use
    param = DTensor.from_local(torch.ones(4), mesh, [Replicate()], run_check=False)
    gone = weakref.ref(mesh)
    del mesh
    gc.collect()
    assert gone() is param.device_mesh  # the parameter keeps it
    del param
    gc.collect()
    assert gone() is None  # nothing on it any more: not kept by tspc


def test_a_new_group_under_an_old_name_gets_a_new_mesh(fake_group):
    first = fake_group(0, 2)
    mesh = mesh_of(first.name, torch.device("cpu"))
    second = fake_group(1, 2)
    again = mesh_of(second.name, torch.device("cpu"))
    assert first.name == second.name and again is not mesh
