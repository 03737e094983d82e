"""Where the sequence walk (``seq_propagate.py``) and its op rules (``seq_rules_*.py``) meet.

The walk does not import its rules and the rules do not import the walk: both import this
module. A rule is ``rule(p, node)`` over the walk ``p`` as ``SequencePropagator`` describes it;
it sets ``p.layout[node]`` and returns None, or returns False when the op does not keep the
tokens independent (the walk then gathers its inputs). The entry point (``shard_sequence.py``)
gathers the rules into a ``RuleTable`` and hands it to the walk.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch.fx as fx

from .layout import Sharded


@dataclass
class SeqShardReport:
    seq_len: int = 0
    world: int = 1
    padded_len: int = 0  # the length the ranks run: seq_len, or padded to a multiple of 2D
    sharded_inputs: list[tuple[str, int]] = field(default_factory=list)
    gathers: list[dict] = field(default_factory=list)  # what was gathered, for which op, why
    notes: list[str] = field(default_factory=list)


class SequencePropagator(Protocol):
    """What a rule sees of the walk: the layout of every value so far, the lengths and the
    group, and the gathers, slices and padding fills it may ask for."""

    S: int  # the true sequence length
    D: int  # ranks in the TSP group
    rank: int
    group: str  # the group's name, as the runtime ops take it
    tags: dict[fx.Node, str]
    layout: dict[fx.Node, object]

    def L(self, x) -> object: ...  # noqa: N802 - the layout of x (None: replicated)

    def tag_for(self, node: fx.Node) -> str: ...

    def gather(
        self, x: fx.Node, consumer: fx.Node, reason: str, tag: str | None = None
    ) -> fx.Node: ...

    def slice(self, x: fx.Node, dim: int, like: Sharded) -> fx.Node: ...

    def fill_padding(self, x: fx.Node, value) -> fx.Node: ...

    def tensor_args(self, node: fx.Node) -> list[fx.Node]: ...


Rule = Callable[[SequencePropagator, fx.Node], "bool | None"]


@dataclass(frozen=True)
class RuleTable:
    """The rules the walk applies: ``named`` by op object (``seq_ops.rule_table``), and the
    ones for whole families of ops (``seq_ops``'s elementwise, along-a-dim and reduction
    tables) that have no named rule."""

    named: dict[object, Rule]
    elementwise: Rule
    along_dim: Rule
    reduction: Rule
