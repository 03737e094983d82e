"""Pass 2b — match MLPs for the ring schedule: ``down(act(up_1(x), ..., up_k(x)))``.

What the math allows: the ring splits the intermediate dimension F, which is exact whenever
everything between the up projections and the down projection is elementwise over F. So the
matcher is anchored on a *down* projection and walks back from its input over elementwise ops
and leading-dims reshapes (``passes/elementwise.py``) until it reaches projections of one ``x``
into F. One projection is a plain MLP (GPT-NeoX, GPT-2: ``gelu(up(x))``, ReLU², ...), two are a
gated one (``act(gate(x)) * up(x)`` in either operand order). Projections are Linear
(``linear(x, W[F, h], b)``) or Conv1D (``addmm(b, x, W[h, F])``, ``x @ W``), whole layers or
slices of a fused ``gate_up`` (``chunk``/``split``/last-dim slices, either order).

A candidate that is an MLP — a projection h -> F of the down projection's own module reaches it
— but that the ring cannot run is reported as skipped with the reason: a non-elementwise op in
between, a tensor read from outside, an intermediate used elsewhere, random ops, projections of
different inputs. Mixture-of-experts blocks (a router feeding ``topk``, experts stacked in one
3-D parameter) are reported as skipped, never matched.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from tspc.runtime.errors import TSPConfigError

from .analyse import GraphInfo
from .elementwise import Nature, is_reshape, nature
from .graph_utils import (
    arg,
    is_getitem,
    module_fqn_of_param,
    op_name,
    projection_module,
    shape,
    tensor_inputs,
    val,
)
from .held_whole import size_fix
from .match_attention import Skip, failed
from .match_moe import applied_by_matmul, einsum_projection_only
from .projection import Linear, as_linear

_ATTENTION = ("sdpa", "softmax", "flex_attention")
_ROUTING = ("topk", "argmax", "argsort", "sort")
# how far back from a down projection the search for its up projection looks (nodes)
_SEARCH_LIMIT = 64


@dataclass
class UpProjection:
    """Output features ``[start, stop)`` of a projection into F: a whole layer or one part of a
    fused one. ``out`` is the node whose value it is (the projection, or its slice)."""

    proj: Linear
    start: int
    stop: int
    out: fx.Node
    path: list[fx.Node] = field(default_factory=list)  # reshapes/slices from proj to out

    @property
    def width(self) -> int:
        return self.stop - self.start

    def key(self) -> tuple:
        return (self.proj.node, self.start, self.stop)


@dataclass
class MlpMatch:
    module: str
    x: fx.Node
    ups: list[UpProjection]  # in the order the chain takes them
    chain: list[fx.Node]  # the elementwise ops and reshapes between, in graph order
    chain_out: fx.Node  # the value the down projection reads
    down: Linear
    intermediate: int
    activation: str  # the chain as an expression of the ups' names, for the report
    reshapes: set[fx.Node] = field(default_factory=set)  # chain nodes that only regroup tokens

    @property
    def gated(self) -> bool:
        return len(self.ups) > 1

    @property
    def down_weight(self) -> fx.Node:
        return self.down.weight

    @property
    def down_bias(self) -> fx.Node | None:
        return self.down.bias


# --------------------------------------------------------------------------- projections


def _through_reshapes(node: fx.Node, path: list[fx.Node]) -> fx.Node:
    while isinstance(node, fx.Node) and is_reshape(node):
        path.append(node)
        node = node.all_input_nodes[0]
    return node


def as_up_projection(node: fx.Node, params) -> UpProjection | None:
    """``node`` as (part of) a projection's output, seen through leading-dims reshapes: the
    projection itself, a last-dim slice of it, or one item of its ``chunk``/``split``."""
    path: list[fx.Node] = []
    src = _through_reshapes(node, path)
    lin = as_linear(src, params)
    if lin is not None:
        return UpProjection(lin, 0, lin.out_features, node, path)
    part = _last_dim_part(src)
    if part is None:
        return None
    whole, start, stop = part
    path.append(src)
    if is_getitem(src) and op_name(whole) in ("chunk", "split", "split_with_sizes"):
        path.append(whole)
        whole = whole.args[0]
    lin = as_linear(_through_reshapes(whole, path), params)
    if lin is None:
        return None
    return UpProjection(lin, start, stop, node, path)


def _last_dim_part(node: fx.Node) -> tuple[fx.Node, int, int] | None:
    """(the sliced tensor, start, stop) when ``node`` takes a last-dim range of a tensor."""
    if not isinstance(node, fx.Node) or not node.all_input_nodes:
        return None
    src = node.args[0]
    if not isinstance(src, fx.Node):
        return None
    if is_getitem(node) and op_name(src) in ("chunk", "split", "split_with_sizes"):
        items, i = val(src), node.args[1]
        if not isinstance(i, int) or not all(isinstance(t, torch.Tensor) for t in items):
            return None
        dim = arg(src, 2, "dim", 0)
        ndim = len(items[0].shape)
        if ndim == 0 or dim not in (-1, ndim - 1):
            return None
        start = sum(int(t.shape[-1]) for t in items[:i])
        return src, start, start + int(items[i].shape[-1])
    full = val(src)
    if not isinstance(full, torch.Tensor) or full.dim() == 0:
        return None
    width, ndim = int(full.shape[-1]), full.dim()
    if is_getitem(node) and isinstance(node.args[1], tuple):
        idx = node.args[1]
        last, lead = idx[-1], idx[:-1]
        lead_ok = all(i is Ellipsis or i == slice(None) for i in lead) and (
            Ellipsis in lead or len(idx) == ndim
        )
        if isinstance(last, slice) and lead_ok and last.step in (None, 1):
            start, stop = last.start or 0, width if last.stop is None else min(last.stop, width)
            if 0 <= start < stop:
                return src, start, stop
        return None
    if op_name(node) == "narrow" and arg(node, 1, "dim") in (-1, ndim - 1):
        start, length = arg(node, 2, "start"), arg(node, 3, "length")
        if isinstance(start, int) and isinstance(length, int) and start >= 0:
            return src, start, start + length
    return None


# --------------------------------------------------------------------------- the walk back


@dataclass
class _Region:
    """What lies behind a down projection's input: the elementwise region reached without
    crossing anything else (``chain``, its ``leaves`` and ``outside`` inputs, the ``blockers``
    that stop it), and beyond the blockers, the projections the search still found."""

    chain: list[fx.Node] = field(default_factory=list)
    natures: dict[fx.Node, Nature] = field(default_factory=dict)
    leaves: list[UpProjection] = field(default_factory=list)
    outside: list[fx.Node] = field(default_factory=list)
    blockers: list[fx.Node] = field(default_factory=list)
    beyond: list[UpProjection] = field(default_factory=list)
    attention: bool = False


def _walk_back(
    down: Linear, params, natures: dict[fx.Node, Nature], limit: int = _SEARCH_LIMIT
) -> _Region:
    r = _Region()
    seen: set[fx.Node] = set()
    work: list[tuple[fx.Node, bool]] = [(down.x, True)]  # (node, reached over the chain only)
    while work and len(seen) < limit:
        node, clean = work.pop(0)
        if node in seen:
            continue
        seen.add(node)
        up = as_up_projection(node, params)
        if up is not None:
            (r.leaves if clean else r.beyond).append(up)
            continue
        if node.op not in ("call_function", "call_method"):
            if clean:
                r.outside.append(node)
            continue
        if op_name(node) in _ATTENTION:
            r.attention = True
        if clean:  # beyond a blocker only the projections matter: no need to classify
            if node not in natures:
                natures[node] = nature(node)
            r.natures[node] = nat = natures[node]
            if nat.kind == "other":
                r.blockers.append(node)
                clean = False
            else:
                r.chain.append(node)
        work += [(i, clean) for i in tensor_inputs(node, include_tuples=True)]
    return r


# --------------------------------------------------------------------------- mixture of experts


def find_moe_blocks(gm: fx.GraphModule, params) -> dict[str, str]:
    """{module: reason} for mixture-of-experts blocks: experts stacked in one 3-D parameter that
    a matmul applies per token group, or a router (a projection whose scores reach ``topk``).
    A block inside another is folded into the outer one (the experts inside the router's)."""
    found: dict[str, list[str]] = {}
    for node in gm.graph.nodes:
        if node.op == "placeholder" and node in params and len(shape(node)) == 3:
            mm = None if einsum_projection_only(node) else applied_by_matmul(node)
            if mm is not None:
                fqn = params[node].fqn
                found.setdefault(fqn.rsplit(".", 1)[0], []).append(
                    f"{fqn} {list(shape(node))} stacks the experts' weights and "
                    f"{op_name(mm)} applies them per expert"
                )
        lin = as_linear(node, params)
        if lin is not None and _reaches(node, _ROUTING, depth=4):
            fqn = params[lin.weight].fqn
            found.setdefault(module_fqn_of_param(fqn), []).append(
                f"the router {fqn} picks each token's experts ({_ROUTING[0]})"
            )
    blocks: dict[str, str] = {}
    for module in sorted(found, key=len):
        outer = _in_block(module, blocks)
        if outer is None:
            blocks[module] = "mixture of experts: " + "; ".join(found[module])
        else:
            blocks[outer[0]] += "; " + "; ".join(found[module])
    return blocks


def _reaches(node: fx.Node, names: tuple[str, ...], depth: int) -> bool:
    for u in node.users:
        if op_name(u) in names or (depth > 1 and _reaches(u, names, depth - 1)):
            return True
    return False


def _in_block(module: str, blocks: dict[str, str]) -> tuple[str, str] | None:
    """(block, reason) when ``module`` lies in a mixture-of-experts block."""
    for block, reason in blocks.items():
        if block == "" or module == block or module.startswith(block + "."):
            return block, reason
    return None


# --------------------------------------------------------------------------- the matcher


def match_mlp(
    gm: fx.GraphModule,
    info: GraphInfo,
    world: int,
    claimed: set[fx.Node] = frozenset(),
    moe_blocks: dict[str, Skip | None] | None = None,
) -> tuple[list[MlpMatch], list[Skip]]:
    """Find MLPs the ring can run; ``claimed`` holds projections already owned by attention.
    ``moe_blocks`` (``passes/match_moe.py``): MoE blocks whose experts run expert-parallel
    (None: the MLPs inside them, shared experts, are matched as usual) or the reason they
    cannot (reported instead of the generic one)."""
    params = info.params
    matches: list[MlpMatch] = []
    skips: list[Skip] = []
    used: set[fx.Node] = set(claimed)
    moe = find_moe_blocks(gm, params)
    fixes: dict[str, str] = {}
    for block, why in (moe_blocks or {}).items():
        related = [b for b in moe if _nested(b, block)]
        for b in related:
            del moe[b]
        if why is not None:  # reported once, under the outermost name of the block
            name = min([block, *related], key=len)
            moe[name] = why.reason
            fixes[name] = why.fix
    natures: dict[fx.Node, Nature] = {}  # each node classified once per graph
    skips += [
        Skip("mlp", module, reason, fix=fixes.get(module, "")) for module, reason in moe.items()
    ]
    reported = set(moe)
    for node in list(gm.graph.nodes):
        down = as_linear(node, params)
        if down is None or node in used:
            continue
        try:
            out = _match_at(down, params, world, moe, natures)
        except TSPConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - this MLP alone is skipped and reported
            out = failed("mlp", _module(down, params), "match", e)
        if out is None:
            continue
        if isinstance(out, Skip):
            out.anchor = node
            if out.module not in reported:
                skips.append(out)
                reported.add(out.module)
            continue
        nodes = {u.proj.node for u in out.ups} | {down.node}
        if nodes & used:
            continue
        used |= nodes
        matches.append(out)
    return matches, skips


def _nested(a: str, b: str) -> bool:
    """One module is the other or lies inside it."""
    return a == b or a.startswith(b + ".") or b.startswith(a + ".") or "" in (a, b)


def _module(lin: Linear, params) -> str:
    return projection_module(params[lin.weight].fqn)


def _name(lin: Linear, params) -> str:
    return params[lin.weight].fqn.rsplit(".", 2)[-2] if "." in params[lin.weight].fqn else "up"


def _match_at(
    down: Linear, params, world: int, moe: dict[str, str], natures: dict[fx.Node, Nature]
) -> MlpMatch | Skip | None:
    """The MLP ending at ``down``, a Skip saying why the ring cannot run it, or None when
    ``down`` ends no MLP."""
    module = _module(down, params)
    region = _walk_back(down, params, natures)

    def of_this_mlp(u: UpProjection) -> bool:
        # the same module, or a direct child of it: x-transformers' ``FeedForward`` is a
        # ``Sequential(GLU(proj), ..., Linear)``, its up projection inside the GLU child. Not
        # any descendant: a tied LM head (module ``model``) would claim every layer's MLP.
        up = _module(u.proj, params)
        child = bool(module) and up.startswith(module + ".") and "." not in up[len(module) + 1 :]
        return (
            (up == module or child)
            and u.proj.in_features == down.out_features
            and u.width == down.in_features
        )

    if region.attention or not any(of_this_mlp(u) for u in region.leaves + region.beyond):
        return None  # no projection of this module into F behind it: not an MLP

    def skip(reason: str, fix: str = "") -> Skip:
        return Skip("mlp", module, reason, fix=fix)

    up_names = "/".join(sorted({_name(u.proj, params) for u in region.leaves + region.beyond}))
    between = f"between {up_names} and {_name(down, params)}"
    if (block := _in_block(module, moe)) is not None:
        return Skip("mlp", *block)  # an expert (or the shared expert) of a MoE block
    if region.blockers:
        b = region.blockers[0]
        nat = region.natures[b]
        if nat.random:
            return skip(
                f"{b.name} {between} draws random numbers (dropout in training mode?): each "
                "F-slice of the ring would draw its own; it runs with replicated weights"
            )
        return skip(
            f"{b.name} {between}: {nat.why}, so the intermediate dim cannot be split; "
            "it runs with replicated weights on the local tokens"
        )
    foreign = [u for u in region.leaves if not of_this_mlp(u)]
    outside = region.outside + [u.out for u in foreign]
    if outside:
        name = params[outside[0]].fqn if outside[0] in params else outside[0].name
        return skip(
            f"the activation {between} reads {name}, a tensor from outside the MLP; "
            "it runs with replicated weights on the local tokens"
        )
    if len({u.key() for u in region.leaves}) != len(region.leaves):
        return skip(f"one projection reaches the activation {between} along two paths")
    ups = sorted(region.leaves, key=lambda u: (u.proj.node, u.start))
    if len({u.proj.x for u in ups}) != 1:
        return skip(f"the projections {between} read different inputs")
    if (used_elsewhere := _escaping(ups, region.chain, down)) is not None:
        return skip(
            f"{used_elsewhere.name} {between} is also used outside the MLP; the ring does not "
            "materialise the intermediate values"
        )
    inter = down.in_features
    if world > inter:
        raise TSPConfigError(
            f"{module}: D={world} ranks is more than its intermediate size {inter}; "
            f"use a TSP group of at most {inter} ranks"
        )
    if inter % world:
        return skip(
            f"intermediate size {inter} not divisible by D={world}",
            size_fix("intermediate size", inter),
        )
    chain = sorted(region.chain)  # fx nodes order by their place in the graph
    reshapes = {n for n in chain if region.natures[n].kind == "reshape"}
    return MlpMatch(
        module=module,
        x=ups[0].proj.x,
        ups=ups,
        chain=chain,
        chain_out=down.x,
        down=down,
        intermediate=inter,
        activation=describe_chain(ups, chain, reshapes, down.x, params),
        reshapes=reshapes,
    )


def _escaping(ups: list[UpProjection], chain: list[fx.Node], down: Linear) -> fx.Node | None:
    """A value of the MLP (projection, slice, chain op) that something else also reads."""
    inside = set(chain) | {down.node} | {u.out for u in ups}
    for u in ups:
        inside |= set(u.path) | {u.proj.node}
    for n in (
        chain + [u.out for u in ups] + [n for u in ups for n in u.path] + [u.proj.node for u in ups]
    ):
        for user in n.users:
            if user not in inside:
                return n
    return None


# --------------------------------------------------------------------------- the chain itself


def chain_module(m: MlpMatch) -> fx.GraphModule:
    """The activation chain as a function of the ups' values (each ``[N, F/D]`` on a shard):
    the chain's ops copied into a graph of their own, leading-dims reshapes dropped (they only
    regroup tokens, and the ring works on ``[tokens, F]``)."""
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, u in enumerate(m.ups):
        env[u.out] = g.placeholder(f"p{i}")
    for n in m.chain:
        if n in m.reshapes:
            env[n] = env[n.all_input_nodes[0]]
            continue
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(env[m.chain_out])
    return fx.GraphModule(torch.nn.Module(), g)


def chain_key(m: MlpMatch, gm: fx.GraphModule) -> str:
    """The ring's name for the chain: readable, and unique to its code."""
    digest = hashlib.sha1(gm.code.encode()).hexdigest()[:10]
    return f"{m.activation}#{digest}"


def describe_chain(ups, chain, reshapes, out, params) -> str:
    """``gelu(up)``, ``mul(silu(gate), up)``: the chain with each input named by its layer."""
    names = {}
    for u in ups:
        base = _name(u.proj, params)
        names[u.out] = (
            base
            if len(ups) == 1 or u.width == u.proj.out_features
            else (f"{base}[{u.start}:{u.stop}]")
        )
    text: dict[fx.Node, str] = dict(names)
    for n in chain:
        if n in text:
            continue
        if n in reshapes:
            text[n] = text.get(n.all_input_nodes[0], "?")
            continue
        args = [text.get(a, "?") if isinstance(a, fx.Node) else repr(a) for a in n.args]
        kwargs = [f"{k}={v!r}" for k, v in n.kwargs.items() if not isinstance(v, fx.Node)]
        text[n] = f"{op_name(n)}({', '.join(args + kwargs)})"
    return text.get(out, "?")
