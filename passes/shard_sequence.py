"""Pass 3 — shard the sequence: run the graph on this rank's zigzag tokens.

A propagation over the graph, not a list of special cases. Every value is replicated or
``Sharded`` (``passes/layout.py``) along the dimension that carries the tokens. User inputs are
cut to the local zigzag tokens where they enter; from there each operation either keeps the split
(token-wise operations: elementwise math, projections, norms over the hidden size, reshapes that
keep the token factor whole) with its shape arguments rewritten for the local length, or gets
what it needs:

* a replicated value meeting a sharded one along the tokens (RoPE tables built from
  ``arange(S)``, position ids, the query rows of a mask) is *sliced* to the local positions — no
  communication, always exact;
* an operation that needs every token (the keys of attention, a shift-by-one, a cumulative op,
  any operation not known here) gets a *gather* first (zigzag all-gather, back in true order);
* a sum or mean over the tokens, and token-level losses, reduce locally and all-reduce one value.

Correctness never depends on which dimension the inputs are cut along: every rule is exact for
whatever dimension is split, and unknown operations fall back to a gather. The choice only
decides how much work and memory is saved.

Gradient convention (the runtime's ops implement it): the gradient a rank holds for a replicated
value is a partial sum over ranks. Hence: slicing's adjoint scatters into zeros (no
communication); a gather's adjoint reduce-scatters; replicated parameters and inputs all-reduce
their gradient where they enter (``sync_replicated_grad``); replicated outputs hand the user's
(identical) gradient over as a partial (``replicated_output``); and an *output* gather, whose
consumers hold identical gradients on every rank, adjoins to "take my slice".

Any length: a sequence of S tokens that does not split into 2D zigzag chunks runs padded to P,
the next multiple of 2D, with the padding at its end (``runtime/zigzag.py``). Sharded values
carry the padding (``Sharded(n=S, n_local=P/D)``: shape arguments become ``P/D`` per S), and
only they do — a replicated value is always exactly the one-process value:

* a replicated value cut to the local tokens is padded with copies of its last token first, so
  padding tokens hold values real tokens hold (valid ids and positions, finite numbers, a mask
  row that sees some key) and nothing they compute is NaN;
* every gather drops the padding again (``drop_padding``), so an operation that needs every
  token, the keys of attention included, never sees it: no real query attends to padding, and
  the zigzag kernel cuts its blocks at the last real key;
* sums and means over the tokens and token losses set the padding to zero or to the loss's
  ``ignore_index`` first (``fill_padding``); a mean divides by the true count.

Padding rows are computed and dropped; their gradient is zero everywhere (nothing real reads
them), so gradients are exact too.

Attention: keys and values are gathered where they leave the computation from local tokens —
before any grouped-query head repetition, so only the KV heads move — and the queries stay
local. ``is_causal`` becomes the zigzag causal kernel (no mask tensor at all); an explicit mask is
cut to the local query rows.

Files: this one is the entry point (``shard_sequence``): it hands the walk
(``seq_propagate.py``) its rules as a table; which op is which, by identity, ``seq_ops.py``; the
rules ``seq_rules_math.py`` (elementwise, reductions, projections, norms), ``seq_rules_shape.py``
(views, indexing, cat/split) and ``seq_rules_attention.py`` (attention, token losses); walk and
rules meet in ``seq_rule_api.py`` (what a rule sees of the walk) and import neither each other.
"""

from __future__ import annotations

import torch.fx as fx

from tspc.runtime.group import TSPGroup
from tspc.runtime.zigzag import padded_length

from .analyse import GraphInfo
from .graph_utils import eliminate_dead_code, shape
from .match_attention import sdpa_args
from .seq_ops import ATTENTION, in_table, resolve, rule_table
from .seq_propagate import SequenceWalk
from .seq_rule_api import RuleTable, SeqShardReport
from .seq_rules_attention import RULES as ATTENTION_RULES
from .seq_rules_attention import sdpa_local_queries
from .seq_rules_math import RULES as MATH_RULES
from .seq_rules_math import rule_along_dim, rule_elementwise, rule_reduction
from .seq_rules_moe import RULES as MOE_RULES
from .seq_rules_random import RULES as RANDOM_RULES
from .seq_rules_shape import RULES as SHAPE_RULES

__all__ = ["SeqShardReport", "find_sequence_length", "sdpa_local_queries", "shard_sequence"]


# Rules for named ops; elementwise, along-a-dim and reduction ops go by their tables.
RULES = RuleTable(
    named=rule_table(MATH_RULES, SHAPE_RULES, ATTENTION_RULES, RANDOM_RULES, MOE_RULES),
    elementwise=rule_elementwise,
    along_dim=rule_along_dim,
    reduction=rule_reduction,
)


def find_sequence_length(gm: fx.GraphModule) -> int | None:
    """The query length of the graph's self-attention calls (their common value); with none,
    the length of square ``[B, H, S, S]`` scores a softmax reads (eager attention the passes
    left as math, e.g. for its dropout)."""
    lengths = []
    for n in gm.graph.nodes:
        if in_table(n, ATTENTION):
            a = sdpa_args(n)
            try:
                qs, ks = shape(a["query"]), shape(a["key"])
            except (ValueError, TypeError):
                continue
            if len(qs) >= 2 and qs[-2] == ks[-2]:
                lengths.append(qs[-2])
    if not lengths:  # eager attention left as math (its dropout in training): square scores
        lengths = [
            shape(n.args[0])[-1]
            for n in gm.graph.nodes
            if in_table(n, _SOFTMAX)
            and len(_shape_or_empty(n.args[0])) == 4
            and shape(n.args[0])[-1] == shape(n.args[0])[-2]
        ]
    if not lengths:
        return None
    return max(set(lengths), key=lengths.count)


_SOFTMAX = resolve(["softmax", "_softmax"])


def _shape_or_empty(x) -> tuple:
    try:
        return tuple(shape(x))
    except (ValueError, TypeError, AttributeError):
        return ()


def padding_note(seq_len: int, padded: int, world: int, gather_outputs: bool) -> str:
    """The report's line for a padded sequence: by how much, and what a user must know."""
    pad = padded - seq_len
    note = (
        f"sequence length {seq_len} padded to {padded} (+{pad} token{'s' * (pad != 1)}) to "
        f"split into 2D = {2 * world} zigzag chunks; the padding is never attended to and "
        "counts in no sum or loss"
    )
    if not gather_outputs:
        note += (
            f"; outputs left sharded hold {padded // world} tokens per rank, the last {pad} "
            "of the padded sequence being padding"
        )
    return note


def shard_sequence(
    gm: fx.GraphModule,
    info: GraphInfo,
    group: TSPGroup,
    seq_len: int,
    *,
    gather_outputs: bool = True,
    tags: dict[fx.Node, str] | None = None,
) -> SeqShardReport:
    """Rewrite ``gm`` in place to run on this rank's zigzag tokens. ``tags`` names SDPA nodes
    after their attention module, so their K/V gathers are counted under that name."""
    report = SeqShardReport(seq_len=seq_len, world=group.size)
    if group.size == 1:
        report.notes.append("D = 1: nothing to shard")
        return report
    report.padded_len = padded_length(seq_len, group.size)
    if report.padded_len != seq_len:
        report.notes.append(padding_note(seq_len, report.padded_len, group.size, gather_outputs))
    prop = SequenceWalk(gm, info, seq_len, group, gather_outputs, tags or {}, report, RULES)
    prop.run()
    eliminate_dead_code(gm.graph)
    gm.graph.lint()
    gm.recompile()
    return report
