"""``runtime/release.owner_modules_of``: which modules get the released-parameter guards.

Release runs inside the compiled model's call, so the owners are looked for first among the
modules on the call stack, then through the GC graph for parameters not found there."""

from __future__ import annotations

import types

from torch import nn

from tspc.runtime import release
from tspc.runtime.release import owner_modules_of


def test_owners_on_the_call_stack_include_tied_weights_and_skip_the_heap_scan(monkeypatch):
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    model[1].weight = model[0].weight  # tied: two owners
    monkeypatch.setattr(release, "_modules_referring_to", _must_not_scan)
    owners = owner_modules_of([model[0].weight])
    assert {id(m) for m in owners[id(model[0].weight)]} == {id(model[0]), id(model[1])}


def _must_not_scan(params):
    raise AssertionError("every owner was on the stack: no heap scan expected")


def test_owners_off_the_stack_are_found_through_the_heap(monkeypatch):
    scans = []
    scan = release._modules_referring_to
    monkeypatch.setattr(release, "_modules_referring_to", lambda ps: scans.append(ps) or scan(ps))
    holder = types.SimpleNamespace()

    def build() -> None:  # the module is a local only of this frame, which returns
        holder.layer = nn.Linear(3, 3)

    build()
    params = [holder.layer.weight, holder.layer.bias]
    owners = owner_modules_of(params)
    for p in params:
        assert [id(m) for m in owners[id(p)]] == [id(holder.layer)]
    assert len(scans) == 1  # one lookup for both parameters
