"""One compiled program for every sequence length of a family (``dynamic_seq``, the default).

Dynamo traces a graph with a symbolic sequence length once it has seen two lengths; tspc's
passes need concrete shapes, so without ``dynamic_seq`` every new length runs the passes and the
inner compiler again (``tspc/backend.py``, ``_PerShapeCompiler``). With it the first
length ``S`` of such a graph that is a multiple of 2D is compiled for the whole family instead:

1. the pipeline runs at ``S`` (the real compile: its report, its weight shards) and, as probes
   on a scratch copy of the shard store, at two more lengths (``S + 2D`` and ``2S + 2D``);
2. ``passes/generalize_length.py`` checks the three rewritten graphs are one graph whose
   length-dependent numbers are ``a * (S / 2D) + b`` and writes them as arithmetic on the
   graph's length input;
3. aot_autograd (and Inductor) trace that graph once on fake inputs whose sequence dims are one
   symbol of a fresh ``ShapeEnv``; the guards that trace recorded say which lengths its code
   is valid for.

A later length ``S'`` runs that program with no pass and no inner compile when every other
size (batch, the 0-d values the graph bakes in) is the same, ``S'`` is a multiple of 2D, and
every guard holds at ``S'`` (``LengthFamily.covers``). Anything else (a length to pad, a graph
the passes build differently per length, a trace that specialised the length) compiles per
length as before, and the compile log says why.

What is trusted, not proven: the passes decide the same way at every length of the family as at
the three probed ones. Their decisions that depend on the length are the padding (excluded:
multiples of 2D only), coincidences of the length with another size (which change the graph at
a probe, and are refused), and a mask's window dropped as at least as wide as the sequence: the
mask report says up to which length that holds (``longest``), the probes stay within it, and a
family serves no length beyond it (a longer length gets a second program). A threshold no probe
crosses that the passes do not report would not be seen; ``dynamic_seq=False`` compiles every
length on its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx as fx

from tspc.passes.generalize_length import LengthNotGeneralizable, generalize_sequence_length
from tspc.passes.specialize import specialize
from tspc.runtime.compat import shape_env_guards, symbolic_fake_mode
from tspc.runtime.shard_store import STORE

from . import compiles

__all__ = ["LengthFamily", "LengthNotGeneralizable", "LengthProbe", "sequence_input"]


@dataclass(frozen=True)
class SequenceInput:
    """Where the sequence length enters a Dynamo graph: the positions of its int inputs (Dynamo
    may give each input's sequence dim a symbol of its own: ``input_ids``, ``attention_mask``,
    ``labels``) and, per tensor input, the dims that are one of them."""

    indices: tuple[int, ...]
    dims: dict[int, tuple[int, ...]]

    @property
    def index(self) -> int:
        """The int input the generalised graph computes its lengths from."""
        return self.indices[0]


def _example(node: fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


def sequence_input(gm: fx.GraphModule, args: list[Any], seq_len: int | None) -> SequenceInput:
    """The int inputs of Dynamo's symbolic graph that have the value of the sequence length
    ``seq_len`` (the attention's query length the passes found), and the tensor dims that are
    exactly one of them. ``LengthNotGeneralizable`` when there is none, or a tensor dim is some
    other expression of them. All of them are taken to be the sequence length: the family's
    program runs only calls where they are all equal (``LengthFamily.covers``)."""
    if not seq_len:
        raise LengthNotGeneralizable("no self-attention: no sequence length to generalise over")
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    indices = tuple(
        i
        for i, (n, a) in enumerate(zip(placeholders, args))
        if isinstance(a, int)
        and not isinstance(a, bool)
        and a == seq_len
        and isinstance(_example(n), torch.SymInt)
    )
    if not indices:
        raise LengthNotGeneralizable(f"no symbolic size input has the sequence length {seq_len}")
    symbols = {_example(placeholders[i]).node.expr for i in indices}
    dims: dict[int, tuple[int, ...]] = {}
    for i, n in enumerate(placeholders):
        ex = _example(n)
        if not isinstance(ex, torch.Tensor):
            continue
        these = []
        for d, size in enumerate(ex.shape):
            if not isinstance(size, torch.SymInt):
                continue
            expr = size.node.expr
            if expr in symbols:
                these.append(d)
            elif symbols & expr.free_symbols:
                raise LengthNotGeneralizable(
                    f"input {n.name} has size {expr} in dim {d}: only dims that are the "
                    "sequence length itself are supported"
                )
        if these:
            if not isinstance(args[i], torch.Tensor) or not args[i].is_contiguous():
                raise LengthNotGeneralizable(f"input {n.name} is not a contiguous tensor")
            dims[i] = tuple(these)
    return SequenceInput(indices, dims)


def family_key(args: tuple | list, baked: set[int], seq: SequenceInput) -> tuple:
    """``compiles.shape_key`` with the sequence length left out: what one program of the
    family is specific to."""
    key = list(compiles.shape_key(tuple(args), baked))
    for i in seq.indices:
        key[i] = None
    for i, dims in seq.dims.items():
        key[i] = tuple(None if d in dims else s for d, s in enumerate(key[i]))
    return tuple(key)


def _with_length(args: list[Any], seq: SequenceInput, length: int) -> list[Any]:
    """The inputs at another length (zeros where a sequence dim grew: the passes see shapes
    only)."""
    out = list(args)
    for i in seq.indices:
        out[i] = length
    for i, dims in seq.dims.items():
        t = args[i]
        shape = [length if d in dims else s for d, s in enumerate(t.shape)]
        out[i] = torch.zeros(shape, dtype=t.dtype, device=t.device).requires_grad_(t.requires_grad)
    return out


@dataclass
class LengthProbe:
    """One attempt at a family program, handed to ``_compile_static``: ``prepare`` turns the
    pipeline's result at the call's length into the generalised graph and its symbolic
    inputs, or raises ``LengthNotGeneralizable``."""

    gm: fx.GraphModule  # Dynamo's symbolic graph
    args: list[Any]
    seq: SequenceInput
    chunks: int  # 2D
    run_pipeline: Callable  # tspc.pipeline.run_pipeline (passed in: no import cycle)
    lengths: tuple[int, ...] = ()
    shape_env: Any = None
    symbol: Any = None
    failed: str | None = None  # why the family program was not made (None: it was)
    # the longest length the passes' decisions hold at (a mask's window dropped as at least as
    # wide as the sequence: ``longest`` of the report's masks); None: no bound known
    longest: int | None = None

    def prepare(self, result, full_inputs: list[Any], group, opts, level: str):
        length = self.args[self.seq.index]
        if length % self.chunks:
            raise LengthNotGeneralizable(f"length {length} is padded to a multiple of 2D")
        self.longest = _longest(result.report)
        # the probes: longer lengths only (a shorter one could be below 2D), spread out so that
        # a length-dependent decision of the passes is likelier to show between them, and no
        # longer than the passes' decisions at this length hold
        far = 2 * length + self.chunks
        if self.longest is not None:
            far = min(far, self.longest // self.chunks * self.chunks)
        if far <= length + self.chunks:
            raise LengthNotGeneralizable(
                f"the mask's meaning at length {length} holds up to length {self.longest} only"
            )
        self.lengths = (length, length + self.chunks, far)
        graphs = [_copy(result.gm)]
        for probe in self.lengths[1:]:
            args = _with_length(self.args, self.seq, probe)
            try:
                res = run_pipeline_quietly(self.run_pipeline, self.gm, args, group, opts, level)
            except Exception as e:  # noqa: BLE001 - this length compiles alone instead
                raise LengthNotGeneralizable(
                    f"the passes failed at length {probe}: {type(e).__name__}: {e}"
                ) from e
            if res.report.level != level:
                raise LengthNotGeneralizable(f"the pipeline fell back at length {probe}")
            if _longest(res.report) != self.longest:
                raise LengthNotGeneralizable(
                    f"the masks' longest valid length is {_longest(res.report)} at length "
                    f"{probe}, {self.longest} at {length}"
                )
            graphs.append(res.gm)
            result.runtime.chains.update(res.runtime.chains)  # the general graph calls them
        name = [n.name for n in self.gm.graph.nodes if n.op == "placeholder"][self.seq.index]
        general = generalize_sequence_length(graphs, self.lengths, name, self.chunks)
        mode, self.shape_env, symint = symbolic_fake_mode(length, "tspc_sequence_length")
        self.symbol = symint.node.expr
        inputs = []
        for i, x in enumerate(full_inputs):
            if i in self.seq.indices:
                inputs.append(symint)
            elif i in self.seq.dims:
                shape = [symint if d in self.seq.dims[i] else s for d, s in enumerate(x.shape)]
                with mode:
                    t = torch.empty(shape, dtype=x.dtype, device=x.device)
                inputs.append(t.requires_grad_(x.requires_grad))
            elif isinstance(x, torch.Tensor):  # parameters, weight shards, 0-d values
                inputs.append(mode.from_tensor(x, static_shapes=True))
            else:
                inputs.append(x)
        return general, inputs


def _longest(report) -> int | None:
    """The longest length at which every mask of the report keeps its meaning."""
    return min((m["longest"] for m in report.masks if m.get("longest")), default=None)


def run_pipeline_quietly(run_pipeline, gm, args, group, opts, level):
    """The pipeline at another length, writing no dump and declaring its shards in a scratch
    copy of the runtime's store (the compile's own declarations are there already; shards of
    weights already released are read from their DTensors), and repeating no warning of a
    module left out (the compile at this length gave it)."""
    import warnings
    from dataclasses import replace

    from .errors import FallbackWarning

    static = specialize(gm, args)
    store = STORE.scratch_copy(args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FallbackWarning)
        return run_pipeline(static, args, group, replace(opts, dump_dir=None), level, -1, store)


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of a rewritten graph (same root: its attributes), node metadata shared."""
    graph = fx.Graph()
    out = graph.graph_copy(gm.graph, {})
    graph.output(out)
    return fx.GraphModule(gm, graph)


@dataclass
class LengthFamily:
    """A compiled program that serves every length of a family (module docstring)."""

    fn: Callable
    graph_id: int
    seq: SequenceInput
    chunks: int
    key: tuple
    baked: set[int]
    shape_env: Any
    symbol: Any
    lengths: tuple[int, ...]
    longest: int | None  # the longest length it serves (``LengthProbe.longest``)

    def covers(self, args: tuple) -> bool:
        length = args[self.seq.index]
        if not isinstance(length, int) or length <= 0 or length % self.chunks:
            return False
        if self.longest is not None and length > self.longest:
            return False
        if any(args[i] != length for i in self.seq.indices):
            return False
        if family_key(args, self.baked, self.seq) != self.key:
            return False
        at = {self.symbol: sympy.Integer(length)}
        for expr in shape_env_guards(self.shape_env):
            try:
                if not bool(expr.xreplace(at)):
                    return False
            except TypeError:  # a guard on another symbol (none expected): not decidable here
                return False
        return True
