"""Random ops keyed by global position, so that every D draws the same numbers for a token.

torch's generator hands each rank the next numbers of one sequence: on a rank's slice of the
tokens, ``dropout`` draws a mask that depends on which tokens the rank holds, and at D > 1 every
rank starts from the same state, so the ranks' masks are copies of one another. This pass, run
on Dynamo's graph before the sequence is sharded (at every D, D = 1 included, so that D = 1 draws
what D = 2 and D = 4 draw), replaces

* ``F.dropout`` / ``torch.dropout`` in training (``nn.Dropout`` included: Dynamo inlines it)
  by ``tspc::keyed_dropout``;
* ``torch.rand_like`` / ``torch.randn_like`` by ``tspc::keyed_rand``;
* SDPA with ``dropout_p > 0`` by its math — ``softmax(q k^T * scale + mask)``, keyed dropout of
  the probabilities, ``@ v`` — so that each probability's mask is keyed by (batch, head, global
  query index, key index). The matcher has already reported such an attention as skipped (its
  weights stay whole); the sequence pass runs it on the local queries against gathered keys.

Each keyed op takes its index among the graph's random ops as its key, and one seed per graph
call: two words drawn from torch's default generator on the ops' device at the start of the
graph (so successive steps differ and ``torch.manual_seed`` reproduces a run), broadcast from
rank 0 at D > 1 (ranks seeded differently, as many data-parallel scripts do, still draw one
mask). The sequence pass (``seq_rules_random.py``) gives each keyed op on a sharded value the
global positions of its local elements.

Other random ops (``bernoulli``, ``normal_``, ``multinomial``, a dropout whose ``p`` is a graph
value, ...) are not keyed: the sequence pass does not count them as token-wise, so their sharded
inputs are gathered and they run on the whole value, every rank drawing what one process draws
from the same generator state (exact, not 1/D).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from tspc.ops.keyed_random import SEED_TAG  # and defines tspc::keyed_dropout, keyed_rand
from tspc.runtime.comm import broadcast

from .graph_utils import arg, op_name, tensor_val
from .match_attention import sdpa_args
from .seq_ops import in_table, resolve

_DROPOUT = resolve(["dropout", "dropout_"])
_RAND_LIKE = resolve(["rand_like"])
_RANDN_LIKE = resolve(["randn_like"])
_SDPA = resolve(["scaled_dot_product_attention"])
# Random ops this pass does not key (listed in the report as drawn from torch's generator).
_OTHER_RANDOM = resolve(
    (
        "bernoulli bernoulli_ normal normal_ uniform_ multinomial poisson randint_like "
        "exponential_ geometric_ cauchy_ log_normal_ random_ alpha_dropout alpha_dropout_ "
        "feature_alpha_dropout feature_alpha_dropout_ dropout1d dropout2d dropout3d rrelu"
    ).split()
)
SEED_WORDS = 2


@dataclass
class KeyedRandomReport:
    keyed: list[str] = field(default_factory=list)  # "<op> (<node>)" per replaced op
    left: list[str] = field(default_factory=list)  # random ops left to torch's generator

    def notes(self) -> list[str]:
        out = []
        if self.keyed:
            out.append(
                f"keyed random draws replaced torch's generator for {len(self.keyed)} op(s) "
                f"({', '.join(self.keyed[:4])}{' ...' if len(self.keyed) > 4 else ''}): the same "
                "numbers at every D, not torch's own (docs/guarantees.md, 'Random ops under "
                "sharding')"
            )
        if self.left:
            out.append(
                f"random op(s) not keyed, drawn from torch's generator on whole values (their "
                f"sharded inputs gathered): {', '.join(self.left[:4])}"
            )
        return out


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


class _Keyer:
    def __init__(self, gm: fx.GraphModule, group_name: str, world: int):
        self.g = gm.graph
        self.group_name = group_name
        self.world = world
        self.seed: fx.Node | None = None
        self.count = 0
        self.report = KeyedRandomReport()

    def seed_node(self, device: torch.device) -> fx.Node:
        """The per-call seed: drawn once at the start of the graph (rank 0's at D > 1)."""
        if self.seed is None:
            first = next(n for n in self.g.nodes if n.op != "placeholder")
            with self.g.inserting_before(first):
                s = self.g.call_function(
                    torch.randint,
                    (0, 2**31 - 1, (SEED_WORDS,)),
                    {"dtype": torch.int64, "device": device},
                )
                if self.world > 1:
                    s = self.g.call_function(
                        broadcast, (s, 0, SEED_WORDS, self.group_name, self.world, SEED_TAG)
                    )
            s.meta["tspc_role"] = "rng_seed"
            self.seed = s
        return self.seed

    def next_key(self) -> int:
        self.count += 1
        return self.count - 1

    def dropout(self, n: fx.Node) -> bool:
        x = n.args[0] if n.args else n.kwargs.get("input")
        p = arg(n, 1, "p", 0.5)
        training = arg(n, 2, "train" if "train" in n.kwargs else "training", True)
        inplace = op_name(n).endswith("_") or bool(arg(n, 3, "inplace", False))
        if not isinstance(x, fx.Node) or not _number(p) or not isinstance(training, bool):
            return False
        if not training or p == 0:  # the identity: token-wise (seq_rules_random.py); left in
            return True  # place, as a matched MLP's chain may hold it
        if p >= 1:  # all zeros: torch's op draws nothing that matters; keep it
            return False
        xv = tensor_val(x)
        with self.g.inserting_before(n):
            new = self.g.call_function(
                torch.ops.tspc.keyed_dropout.default,
                (x, self.seed_node(xv.device), self.next_key(), float(p), 0, None, 0),
            )
        self.replace(n, new, inplace, x)
        self.report.keyed.append(f"dropout ({n.name})")
        return True

    def rand_like(self, n: fx.Node, normal: bool) -> bool:
        x = n.args[0] if n.args else n.kwargs.get("input")
        extra = {k: v for k, v in n.kwargs.items() if k not in ("input", "dtype")}
        if (
            not isinstance(x, fx.Node)
            or len(n.args) > 1
            or any(v is not None for v in extra.values())
        ):
            return False  # a device, layout or grad flag: left to torch (gathered)
        xv = tensor_val(x)
        dtype = n.kwargs.get("dtype")
        with self.g.inserting_before(n):
            new = self.g.call_function(
                torch.ops.tspc.keyed_rand.default,
                (x, self.seed_node(xv.device), self.next_key(), normal, 0, None, 0, dtype),
            )
        self.replace(n, new)
        self.report.keyed.append(f"{'randn' if normal else 'rand'}_like ({n.name})")
        return True

    def sdpa(self, n: fx.Node) -> bool:
        a = sdpa_args(n)
        p = a["dropout_p"]
        if not _number(p) or p == 0:
            return False
        q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
        if not all(isinstance(t, fx.Node) for t in (q, k, v)) or p >= 1:
            return False
        qv, kv = tensor_val(q), tensor_val(k)
        g = self.g
        scale = a["scale"] if a["scale"] is not None else 1.0 / math.sqrt(qv.shape[-1])
        with g.inserting_before(n):
            if a["enable_gqa"] and kv.dim() >= 3 and kv.shape[-3] != qv.shape[-3]:
                rep = qv.shape[-3] // kv.shape[-3]
                k = g.call_function(torch.repeat_interleave, (k, rep), {"dim": -3})
                v = g.call_function(torch.repeat_interleave, (v, rep), {"dim": -3})
            s = g.call_function(torch.matmul, (q, g.call_function(torch.transpose, (k, -2, -1))))
            s = g.call_function(torch.mul, (s, scale))
            if a["is_causal"]:
                ones = g.call_function(
                    torch.ones,
                    ((qv.shape[-2], kv.shape[-2]),),
                    {"dtype": torch.bool, "device": qv.device},
                )
                see = g.call_function(torch.tril, (ones,))
                s = g.call_function(
                    torch.masked_fill, (s, g.call_function(torch.logical_not, (see,)), -math.inf)
                )
            if isinstance(mask, fx.Node):
                if tensor_val(mask).dtype == torch.bool:
                    hide = g.call_function(torch.logical_not, (mask,))
                    s = g.call_function(torch.masked_fill, (s, hide, -math.inf))
                else:
                    s = g.call_function(torch.add, (s, mask))
            # SDPA's safe softmax: a row hidden from every key (left padding) is 0, not NaN;
            # its scores become 0 first, so no NaN reaches the backward either
            dead = g.call_function(
                torch.all, (g.call_function(torch.isneginf, (s,)),), {"dim": -1, "keepdim": True}
            )
            s = g.call_function(torch.masked_fill, (s, dead, 0.0))
            probs = g.call_function(torch.softmax, (s, -1))
            probs = g.call_function(torch.masked_fill, (probs, dead, 0.0))
            probs = g.call_function(
                torch.ops.tspc.keyed_dropout.default,
                (probs, self.seed_node(qv.device), self.next_key(), float(p), 0, None, 0),
            )
            out = g.call_function(torch.matmul, (probs, v))
        self.replace(n, out)
        self.report.keyed.append(f"sdpa dropout_p ({n.name})")
        return True

    def replace(self, n: fx.Node, new: fx.Node, inplace: bool = False, x: fx.Node | None = None):
        if new.meta.get("nn_module_stack") is None and "nn_module_stack" in n.meta:
            new.meta["nn_module_stack"] = n.meta["nn_module_stack"]
        n.replace_all_uses_with(new)
        if inplace and x is not None:  # later readers of x saw the dropped-out values
            for u in list(x.users):
                if u is not new and n < u:
                    u.replace_input_with(x, new)
        self.g.erase_node(n)


def key_random_ops(gm: fx.GraphModule, group_name: str = "", world: int = 1) -> KeyedRandomReport:
    """Replace ``gm``'s dropout, ``rand_like``/``randn_like`` and SDPA dropout by keyed draws
    (module docstring); returns what was replaced. New nodes have no ``meta['val']`` yet: the
    caller propagates shapes."""
    k = _Keyer(gm, group_name, world)
    for n in list(gm.graph.nodes):
        if n.op not in ("call_function", "call_method"):
            continue
        if in_table(n, _DROPOUT):
            done = k.dropout(n)
        elif in_table(n, _RAND_LIKE) or in_table(n, _RANDN_LIKE):
            done = k.rand_like(n, in_table(n, _RANDN_LIKE))
        elif in_table(n, _SDPA):
            done = k.sdpa(n) or arg(n, 4, "dropout_p", 0.0) in (0, 0.0)
        elif in_table(n, _OTHER_RANDOM):
            done = False
        else:
            continue
        if not done:
            k.report.left.append(f"{op_name(n)} ({n.name})")
    if k.count or k.report.keyed:
        gm.graph.lint()
        gm.recompile()
    return k.report
