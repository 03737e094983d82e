"""Every rank of the TSP group holds the same module states and passes the same inputs, or
every rank raises a clear error before any transfer.

TSP cuts each weight from the full tensor of the rank that holds it (``DTensor.from_local(...,
run_check=False)``) and each rank takes its zigzag part of the inputs: ranks that disagree
would silently train a model mixed from different weights, compute on a batch mixed from
different batches, or (different shapes) hand gloo/NCCL transfers of different sizes, which
abort the process on one rank and hang the other. ``RankCheck`` runs before a graph that
communicates, on every rank alike:

* module states (parameters and buffers) at their first call, before any is sharded or
  released: a bit-exact checksum per tensor, all gathered in one ``all_gather_object``; a
  difference raises ``ModuleStateMismatchError`` naming the first differing tensor, or, with
  ``sync_module_states``, the differing tensors are broadcast from the group's rank 0 (FSDP2's
  ``sync_module_states``);
* input shapes and dtypes (and integer inputs such as a symbolic length) at the graph's first
  call and whenever this rank's shapes differ from its previous call (``check_inputs="shapes"``,
  the default); with ``check_inputs=True`` also a checksum of the inputs' values, every call;
* the program itself, at the first call: each module's status in the report (sharded or
  skipped) and the graph's transfers in order (kind and layer). The passes are meant to decide
  alike on every rank, but a pass that fails on some ranks only (a rank-dependent bug) would
  leave the ranks running different schedules, whose transfers do not match: a gloo abort or
  an NCCL hang. ``ProgramMismatchError`` names the module and what each rank did with it.

The gathered payload is the same on every rank, so every rank reaches the same verdict and
raises the same error: no rank is left waiting in a collective.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .comm import is_transfer
from .compat import FakeTensor
from .group import TSPGroup, process_group
from .release import ReleasedParameter


class RanksDisagreeError(RuntimeError):
    """The ranks of the TSP group hold different module states or pass different inputs."""


class InputMismatchError(RanksDisagreeError):
    """The ranks passed inputs of different shapes, dtypes or (``check_inputs=True``) values."""


class ModuleStateMismatchError(RanksDisagreeError):
    """The ranks hold different parameters or buffers at the model's first call."""


class ProgramMismatchError(RanksDisagreeError):
    """The ranks compiled different programs for the same graph (a pass that failed on some
    ranks only): their transfers would not match."""


def communicates(gm: torch.fx.GraphModule) -> bool:
    """Whether a rewritten graph transfers anything: only then can ranks that disagree make it
    wrong or make it hang."""
    return any(is_transfer(n) for n in gm.graph.nodes)


_CHUNK = 1 << 22  # bytes widened to int64 at a time (32 MiB)


def checksum(t: torch.Tensor) -> tuple[int, int]:
    """Two sums over the tensor's bytes (plain, and weighted by position modulo a prime), in
    int64 arithmetic: bit-exact, and the same in any summation order, so equal tensors give
    equal checksums on every rank whatever its thread count."""
    x = t.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    raw = x.contiguous().reshape(-1).view(torch.uint8)
    plain = weighted = 0
    for start in range(0, raw.numel(), _CHUNK):
        v = raw[start : start + _CHUNK].to(torch.int64)
        w = torch.arange(start, start + v.numel(), device=v.device, dtype=torch.int64) % 65521
        plain += int(v.sum())
        weighted += int((v * (w + 1)).sum())
    return plain, weighted


def _signature(value: Any) -> tuple:
    if isinstance(value, torch.Tensor):
        return (tuple(value.shape), str(value.dtype))
    return (value,) if isinstance(value, (int, float, bool)) else (type(value).__name__,)


def _is_checkable_state(t: Any) -> bool:
    """A plain tensor holding its data: not a DTensor or a released / storage-less stand-in
    (those were checked before tspc replaced them)."""
    if not isinstance(t, torch.Tensor) or isinstance(t, (DTensor, ReleasedParameter)):
        return False
    return t.numel() == 0 or t.untyped_storage().nbytes() > 0


class _Checked:
    """The module states already checked, by identity (a tensor's ``==`` is elementwise, so no
    WeakSet)."""

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref] = {}

    def __contains__(self, t: torch.Tensor) -> bool:
        ref = self._refs.get(id(t))
        return ref is not None and ref() is t

    def add(self, t: torch.Tensor) -> None:
        key = id(t)
        self._refs[key] = weakref.ref(t, lambda _, key=key: self._refs.pop(key, None))


CHECKED = _Checked()


@dataclass
class RankCheck:
    """The checks one compiled graph runs before its calls (module docstring).

    inputs: (position, name) of the user inputs among the graph's arguments (tensors, and the
        integers Dynamo passes for symbolic sizes); states: (position, FQN) of its parameters
        and buffers; values: compare the inputs' checksums every call; sync: broadcast
        differing module states from the group's rank 0 instead of raising."""

    group: TSPGroup
    inputs: list[tuple[int, str]]
    states: list[tuple[int, str]]
    values: bool = False
    sync: bool = False
    checks_inputs: bool = True
    # (the compared signature, {module: why} for the error): see ``program_signature``
    program: tuple = ((), {})
    last: tuple | None = field(default=None, init=False)
    _program_checked: bool = field(default=False, init=False)

    @classmethod
    def of_graph(
        cls,
        group: TSPGroup,
        inputs: list[tuple[str, str]],
        check_inputs: bool | str,
        sync: bool,
    ) -> RankCheck:
        """The check of a graph whose inputs are ``(kind, name)`` by position (kinds of
        ``passes/analyse.py``; a parameter's or buffer's name is its FQN). Tensor inputs are
        compared before integers (a symbolic length), so an error names the tensor."""
        tensors = [(i, n) for i, (kind, n) in enumerate(inputs) if kind == "input"]
        ints = [(i, n) for i, (kind, n) in enumerate(inputs) if kind == "symint"]
        states = [(i, n) for i, (kind, n) in enumerate(inputs) if kind in ("parameter", "buffer")]
        return cls(
            group,
            tensors + ints,
            states,
            check_inputs is True,
            sync,
            check_inputs is not False,
        )

    def __call__(self, args: list[Any]) -> None:
        if self.group.size == 1:
            return
        if dist.get_backend(process_group(self.group.name)) == "fake" or any(
            isinstance(a, FakeTensor) for a in args
        ):
            # torch's fake process group has no peers to disagree with, and fake tensors
            # (tspc dump, tspc plan --measure) have no data to checksum
            return
        states = [
            (name, args[i])
            for i, name in self.states
            if _is_checkable_state(args[i]) and args[i] not in CHECKED
        ]
        shapes = tuple((name, _signature(args[i])) for i, name in self.inputs)
        if not self.checks_inputs:
            shapes = ()
        if not states and not self.values and shapes == self.last and self._program_checked:
            return
        payload = {
            "program": None if self._program_checked else self.program,
            "inputs": shapes,
            "values": [checksum(args[i]) for i, _ in self.inputs if _tensor(args[i])]
            if self.values
            else None,
            "states": [(n, _signature(t), checksum(t)) for n, t in states],
        }
        everyone: list[Any] = [None] * self.group.size
        dist.all_gather_object(everyone, payload, group=process_group(self.group.name))
        _compare_inputs(everyone, self.inputs, self.values)
        _compare_programs(everyone)
        self._program_checked = True
        differing = _compare_states(everyone, self.sync)
        if differing:
            _broadcast_from_first(
                [t for (n, t) in states if n in differing], process_group(self.group.name)
            )
        for _, t in states:
            CHECKED.add(t)
        self.last = shapes


def _tensor(v: Any) -> bool:
    return isinstance(v, torch.Tensor)


def _ranks_differing(everyone: list[Any], pick) -> list[int]:
    return [r for r in range(1, len(everyone)) if pick(everyone[r]) != pick(everyone[0])]


def _compare_inputs(everyone: list[Any], inputs: list[tuple[int, str]], values: bool) -> None:
    mine = everyone[0]["inputs"]
    for k, (name, sig) in enumerate(mine):
        ranks = _ranks_differing(
            everyone, lambda p, k=k: p["inputs"][k] if k < len(p["inputs"]) else None
        )
        if ranks:
            other = (
                everyone[ranks[0]]["inputs"][k][1]
                if k < len(everyone[ranks[0]]["inputs"])
                else None
            )
            raise InputMismatchError(
                f"tspc: input '{name}' differs between ranks: rank(s) {ranks} passed "
                f"{_describe(other)}, rank 0 {_describe(sig)}. Every rank of the TSP group must "
                "pass the same full batch (the graph takes each rank's zigzag part of it): "
                "feed all ranks of one TSP group the same data (no DistributedSampler over the "
                "TSP ranks; see docs/guarantees.md)."
            )
    if values:
        names = [name for name, sig in mine if len(sig) == 2 and isinstance(sig[0], tuple)]
        for k, name in enumerate(names):
            ranks = _ranks_differing(everyone, lambda p, k=k: p["values"][k])
            if ranks:
                raise InputMismatchError(
                    f"tspc (check_inputs): input '{name}' differs between ranks: rank(s) "
                    f"{ranks} passed different values than rank 0. Every rank of the TSP group "
                    "must pass the same full batch (the graph takes each rank's zigzag part)."
                )


def program_signature(entries, transfers) -> tuple:
    """What the ranks compare at a graph's first call: ``((module statuses, transfers),
    reasons)``, from the report's entries (kind, module, status) and the graph's transfers
    (kind, layer) in issue order (``passes.schedule.transfers``). The reasons only explain a
    difference (their wording may name a rank)."""
    statuses = tuple((e.kind, e.module, e.status) for e in entries)
    reasons = {f"{e.kind} {e.module}": e.reason for e in entries}
    return (statuses, tuple((t.kind, t.tag) for t in transfers)), reasons


def _compare_programs(everyone: list[Any]) -> None:
    if everyone[0]["program"] is None:
        return
    ranks = _ranks_differing(everyone, lambda p: p["program"][0])
    if not ranks:
        return
    (mine, my_transfers), my_reasons = everyone[0]["program"]
    (theirs, their_transfers), their_reasons = everyone[ranks[0]]["program"]
    diff = next(((a, b) for a, b in zip(mine, theirs) if a != b), None)
    if diff is not None:
        (kind, module, status), (_, other_module, other_status) = diff
        what = (
            f"{kind} '{module}' is {status} on rank 0 "
            f"({my_reasons.get(f'{kind} {module}') or 'no reason given'}) but "
            f"{kind} '{other_module}' is {other_status} on rank {ranks[0]} "
            f"({their_reasons.get(f'{kind} {other_module}') or 'no reason given'})"
        )
    elif len(mine) != len(theirs):
        what = f"rank 0 reports {len(mine)} modules, rank {ranks[0]} {len(theirs)}"
    else:
        what = (
            f"the same modules, but rank 0 issues {len(my_transfers)} transfers and rank "
            f"{ranks[0]} {len(their_transfers)}, first differing at "
            f"{next((a, b) for a, b in zip(my_transfers + ((),), their_transfers + ((),)) if a != b)}"
        )
    raise ProgramMismatchError(
        f"tspc: the ranks compiled different programs for this graph: {what}. Their transfers "
        "would not match (a crash or a hang), so no rank runs it. This is a tspc bug: please "
        "report it with this message and the log (TORCH_LOGS=+tspc). Meanwhile "
        "options={'schedules': 'sp'} shards the sequence only, or a D that divides the model's "
        "sizes may avoid the failing pass."
    )


def _describe(sig: Any) -> str:
    if isinstance(sig, tuple) and len(sig) == 2 and isinstance(sig[0], tuple):
        return f"shape {sig[0]} dtype {sig[1].replace('torch.', '')}"
    return f"the value {sig[0]!r}" if isinstance(sig, tuple) and sig else repr(sig)


def _compare_states(everyone: list[Any], sync: bool) -> set[str]:
    """The names of the states whose values differ from rank 0's (to broadcast, with
    ``sync``); raises for states the ranks do not share, or differing ones without ``sync``."""
    mine = everyone[0]["states"]
    names = [s[0] for s in mine]
    ranks = _ranks_differing(everyone, lambda p: [(s[0], s[1]) for s in p["states"]])
    if ranks:
        theirs = everyone[ranks[0]]["states"]
        k = next(
            (k for k, (a, b) in enumerate(zip(mine, theirs)) if a[:2] != b[:2]),
            min(len(mine), len(theirs)),
        )
        what = (
            f"'{mine[k][0]}' ({_describe(mine[k][1])} on rank 0, {_describe(theirs[k][1])} on "
            f"rank {ranks[0]})"
            if k < len(mine) and k < len(theirs)
            else f"a different number of tensors ({len(mine)} on rank 0, {len(theirs)} on rank "
            f"{ranks[0]})"
        )
        raise ModuleStateMismatchError(
            f"tspc: the ranks of the TSP group hold differently shaped module states: {what}. "
            "Every rank must build the same model."
        )
    differing = [
        k for k in range(len(mine)) if _ranks_differing(everyone, lambda p, k=k: p["states"][k][2])
    ]
    if not differing or sync:
        return {names[k] for k in differing}
    k = differing[0]
    ranks = _ranks_differing(everyone, lambda p: p["states"][k][2])
    raise ModuleStateMismatchError(
        f"tspc: parameter or buffer '{names[k]}' differs between ranks: rank(s) {ranks} hold "
        f"other values than rank 0 ({len(differing)} of {len(names)} tensors differ). TSP cuts "
        "each rank's shard from its own copy, so the ranks would train a model mixed from "
        "different weights. Initialise the model with the same seed on every rank (or load the "
        "same checkpoint), or pass options={'sync_module_states': True} to broadcast rank 0's "
        "values at the first call."
    )


def _broadcast_from_first(tensors: list[torch.Tensor], pg: dist.ProcessGroup) -> None:
    with torch.no_grad():
        for t in tensors:
            dst = t.detach()
            buf = dst if dst.is_contiguous() else dst.contiguous()
            dist.broadcast(buf, group_src=0, group=pg)
            if buf is not dst:
                dst.copy_(buf)
