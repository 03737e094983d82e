"""The sequence-sharding propagation engine (pass 3's walk; entry point ``shard_sequence.py``).

One forward walk over the graph. Inputs with a dimension of the sequence length are cut to the
local zigzag tokens; every node then gets a layout from the rule for its op (looked up by
identity, ``seq_ops.py``; rules in ``seq_rules_math.py``, ``seq_rules_shape.py``,
``seq_rules_attention.py``, handed in as a ``RuleTable`` — the walk and its rules meet in
``seq_rule_api.py`` and import neither each other), or — no rule, or a rule that declines — its sharded inputs are
gathered and it runs replicated. The engine owns what rules share: the layout table, gathers
(zigzag all-gather, padding dropped), slices of replicated values to the local tokens, padding
fills, the K/V gather points of attention and the outputs' gathers.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from tspc.runtime.autograd_glue import replicated_output, sync_replicated_grad
from tspc.runtime.group import TSPGroup
from tspc.runtime.zigzag import drop_padding, fill_padding, padded_length, zigzag_slice

from .analyse import GraphInfo
from .gqa import head_repeat_chain
from .graph_utils import (
    is_getitem,
    node_module_fqn,
    op_name,
    replace_input,
    set_fake_value,
    shape,
    tensor_inputs,
    tensor_val,
)
from .layout import Sharded
from .match_attention import sdpa_args
from .seq_ops import (
    ALONG_DIM,
    ATTENTION,
    FACTORIES,
    NO_VALUE,
    REDUCTIONS,
    in_table,
    is_elementwise,
    lookup,
)
from .seq_rule_api import RuleTable, SeqShardReport


class SequenceWalk:
    """The walk: a layout for every value (replicated or ``Sharded``), the op rules
    (``rules``, from ``seq_rules_*.py``) choosing each node's, and the gathers and slices they
    ask for. It is what ``seq_rule_api.SequencePropagator`` describes to the rules."""

    def __init__(
        self,
        gm: fx.GraphModule,
        info: GraphInfo,
        seq_len: int,
        group: TSPGroup,
        gather_outputs: bool,
        tags: dict[fx.Node, str],
        report: SeqShardReport,
        rules: RuleTable,
    ):
        self.gm = gm
        self.g = gm.graph
        self.info = info
        self.S = seq_len
        self.D = group.size
        # A length that does not split into 2D chunks runs padded to P: the padding tokens are
        # the last ones of the sequence. Sharded values carry them (n = S true tokens, n_local
        # = P/D local ones); replicated values never do (see the module docstring).
        self.P = padded_length(seq_len, group.size)
        self.rank = group.rank
        self.group = group.name
        self.gather_outputs = gather_outputs
        self.tags = tags
        self.report = report
        self.rules = rules
        self.layout: dict[fx.Node, object] = {}
        self._gathered: dict[fx.Node, fx.Node] = {}
        self._sliced: dict[tuple, fx.Node] = {}
        self.kv_roots: dict[fx.Node, tuple[fx.Node, fx.Node]] = {}  # root -> (chain user, sdpa)

    # ------------------------------------------------------------------ helpers
    def L(self, x):  # noqa: N802 - short name for the layout lookup used everywhere
        return self.layout.get(x) if isinstance(x, fx.Node) else None

    def tag_for(self, node: fx.Node) -> str:
        return self.tags.get(node) or node_module_fqn(node) or "sequence"

    def gather(self, x: fx.Node, consumer: fx.Node, reason: str, tag: str | None = None):
        """A replicated (all-gathered, true-order) version of sharded ``x``; cached."""
        if x in self._gathered:
            return self._gathered[x]
        sh: Sharded = self.L(x)
        tag = tag or self.tag_for(consumer)
        with self.g.inserting_after(x):
            start = self.g.call_function(
                torch.ops.tspc.all_gather_start.default,
                (x, sh.dim, sh.outer, sh.inner, True, self.group, self.D, tag),
            )
        with self.g.inserting_after(start):
            wait = self.g.call_function(
                torch.ops.tspc.all_gather_wait.default,
                (start, x, sh.dim, sh.outer, sh.inner, True, self.group, self.D, tag),
            )
        # Rules reason in *global* shapes: a gathered value has its input's global shape.
        set_fake_value(start)
        wait.meta["val"] = x.meta["val"]
        wait.meta["tspc_role"] = "seq_gather"
        wait.meta["tspc_gather_of"] = x
        self.layout[start] = None
        self.layout[wait] = None
        whole = self.unpad(wait, sh)
        self._gathered[x] = whole
        self.report.gathers.append(
            {"value": x.name, "for": consumer.name, "op": op_name(consumer), "reason": reason}
        )
        return whole

    def unpad(self, gathered: fx.Node, sh: Sharded) -> fx.Node:
        """The gathered value cut back to the true sequence length: replicated values never
        hold padding, so whatever reads them sees exactly what one process computes — and the
        padding tokens never become keys of any attention."""
        if self.P == self.S:
            return gathered
        with self.g.inserting_after(gathered):
            node = self.g.call_function(
                drop_padding, (gathered, sh.dim, sh.outer, sh.inner, self.S)
            )
        node.meta["val"] = gathered.meta["val"]
        node.meta["tspc_role"] = "seq_unpad"
        gathered.meta["tspc_unpad"] = node
        self.layout[node] = None
        return node

    def slice(self, x: fx.Node, dim: int, like: Sharded) -> fx.Node:
        """This rank's zigzag part of replicated ``x`` along ``dim`` (structured like ``like``)."""
        key = (x, dim, like.n, like.outer, like.inner)
        if key in self._sliced:
            return self._sliced[key]
        with self.g.inserting_after(x):
            node = self.g.call_function(
                zigzag_slice, (x, dim, self.rank, self.D, like.outer, like.inner, self.P)
            )
        node.meta["val"] = x.meta["val"]  # global shape, like every value the rules see
        node.meta["tspc_role"] = "seq_slice"
        self.layout[node] = like.with_dim(dim)
        self._sliced[key] = node
        return node

    def fill_padding(self, x: fx.Node, value) -> fx.Node:
        """``x`` with its padding tokens set to ``value``, for an operation that combines this
        rank's tokens into one result (a sum, a loss): padding must count for nothing."""
        if self.P == self.S:
            return x
        sh: Sharded = self.L(x)
        with self.g.inserting_after(x):
            node = self.g.call_function(
                fill_padding,
                (x, sh.dim, sh.outer, sh.inner, self.S, self.rank, self.D, value),
            )
        node.meta["val"] = x.meta["val"]
        node.meta["tspc_role"] = "seq_fill_padding"
        self.layout[node] = sh
        return node

    def make_replicated(self, node: fx.Node, reason: str) -> None:
        for i in list(self.tensor_args(node)):
            if isinstance(self.L(i), Sharded):
                replace_input(node, i, self.gather(i, node, reason))
        self.layout[node] = None

    def tensor_args(self, node):
        return tensor_inputs(node)

    # ------------------------------------------------------------------ seeds
    def seed_inputs(self) -> None:
        """Parameters stay whole; user inputs with a dimension of the sequence length are cut
        to the local zigzag tokens where they enter. Inputs that require grad get their
        gradient all-reduced (see the module docstring)."""
        first = next(n for n in self.g.nodes if n.op != "placeholder")
        for inp in self.info.inputs:
            node = inp.node
            self.layout[node] = None
            ex = inp.example
            if not isinstance(ex, torch.Tensor) or not node.users:
                continue
            src = node
            if ex.requires_grad and self.D > 1:
                with self.g.inserting_before(first):
                    src = self.g.call_function(
                        sync_replicated_grad, (node, self.group, self.D, inp.fqn)
                    )
                sync = src
                # identity in forward: its value is the parameter's (no fake run per parameter)
                sync.meta["val"] = node.meta["val"]
                node.replace_all_uses_with(sync, delete_user_cb=lambda u, s=sync: u is not s)
                self.layout[src] = None
            if inp.kind != "input":
                continue
            shp = tuple(ex.shape)
            if len(shp) >= 2 and shp[1] == self.S:
                dim = 1
            elif shp and shp[0] == self.S:
                dim = 0
            else:
                continue
            # values that must stay whole (the key padding of causal attention) keep the input
            users = [u for u in src.users if not u.meta.get("tspc_keep_full")]
            with self.g.inserting_before(first):
                sl = self.g.call_function(zigzag_slice, (src, dim, self.rank, self.D, 1, 1, self.P))
            sl.meta["val"] = src.meta["val"]  # global shape, like every value the rules see
            sl.meta["tspc_role"] = "seq_slice"
            for u in users:
                replace_input(u, src, sl)
            self.layout[sl] = Sharded(dim, self.S, self.P // self.D)
            self.report.sharded_inputs.append((inp.fqn, dim))

    # ------------------------------------------------------------------ kv gather points
    def find_kv_roots(self) -> None:
        for n in self.g.nodes:
            if not in_table(n, ATTENTION):
                continue
            a = sdpa_args(n)
            q = a["query"]
            if not isinstance(q, fx.Node):
                continue
            heads = shape(q)[1] if len(shape(q)) == 4 else None
            for which in ("key", "value"):
                kv = a[which]
                if not isinstance(kv, fx.Node) or heads is None:
                    continue
                root, chain = head_repeat_chain(kv, heads)
                if chain:
                    self.kv_roots[root] = (chain[-1], n)

    # ------------------------------------------------------------------ the walk
    def run(self) -> None:
        self.find_kv_roots()
        self.seed_inputs()
        for node in list(self.g.nodes):
            if node.op in ("placeholder", "output") or node in self.layout:
                continue
            if node.op == "get_attr":
                self.layout[node] = None
                continue
            self.visit(node)
            root_use = self.kv_roots.get(node)
            if root_use is not None and isinstance(self.L(node), Sharded):
                chain_user, sdpa = root_use
                g = self.gather(
                    node, sdpa, "attention keys/values need every token", self.tags.get(sdpa)
                )
                wait = g.args[0] if g.meta.get("tspc_role") == "seq_unpad" else g
                wait.meta["tspc_role"] = "kv_gather"
                wait.meta["tspc_sdpa"] = sdpa
                replace_input(chain_user, node, g)
        self.finish_outputs()

    def visit(self, node: fx.Node) -> None:
        ins = self.tensor_args(node)
        if not any(isinstance(self.L(i), Sharded) for i in ins) and not (
            is_getitem(node) and isinstance(self.L(node.args[0]), tuple)
        ):
            # Nothing sharded flows in: the op runs as in the original graph (replicated).
            self.layout[node] = None
            return
        if node.op == "call_function" and in_table(node, NO_VALUE):
            self.layout[node] = None
            return
        rule = lookup(node, self.rules.named)
        if rule is None:
            if is_elementwise(node):
                rule = self.rules.elementwise
            elif in_table(node, FACTORIES):
                self.layout[node] = None
                return
            elif in_table(node, ALONG_DIM):
                rule = self.rules.along_dim
            elif in_table(node, REDUCTIONS):
                rule = self.rules.reduction
        if rule is None or rule(self, node) is False:
            name = op_name(node) or str(node.target)
            self.make_replicated(node, f"'{name}' is not known to keep tokens independent")

    # ------------------------------------------------------------------ outputs
    def finish_outputs(self) -> None:
        out = next(n for n in self.g.nodes if n.op == "output")
        done: dict[fx.Node, fx.Node] = {}

        def fix(a):
            if not isinstance(a, fx.Node):
                return a
            if a not in done:
                done[a] = _fix(a)
            return done[a]

        def _fix(a):
            sl = self.L(a)
            if isinstance(sl, Sharded):
                if not self.gather_outputs:
                    return a
                with self.g.inserting_before(out):
                    start = self.g.call_function(
                        torch.ops.tspc.all_gather_start.default,
                        (a, sl.dim, sl.outer, sl.inner, False, self.group, self.D, "output"),
                    )
                    wait = self.g.call_function(
                        torch.ops.tspc.all_gather_wait.default,
                        (start, a, sl.dim, sl.outer, sl.inner, False, self.group, self.D, "output"),
                    )
                wait.meta["tspc_role"] = "output_gather"
                if self.P == self.S:
                    return wait
                with self.g.inserting_before(out):
                    return self.g.call_function(
                        drop_padding, (wait, sl.dim, sl.outer, sl.inner, self.S)
                    )
            tv = tensor_val(a)
            if tv is not None and tv.requires_grad and self.D > 1:
                with self.g.inserting_before(out):
                    return self.g.call_function(replicated_output, (a, self.rank))
            return a

        out.args = fx.node.map_aggregate(out.args, fix)
