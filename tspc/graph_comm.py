"""What a scheduled graph communicates: its transfers in issue order and the bytes each moves.

Reads any FX graph that uses the tspc collectives (``runtime/comm.py``): the pipeline's graphs
and the forward / backward graphs aot_autograd produces. A transfer is a ``tspc::<kind>_start``
node and the wait that consumes the buffer it returns (``tspc::<kind>_wait`` in the pipeline's
graphs, ``_c10d_functional.wait_tensor`` in traced ones); the nodes issued between the two are the
compute the transfer overlaps. Nothing here runs the graph: sizes come from each start input's
fake value (``node.meta['val']``).

Bytes are what *this rank receives*, by the convention of ``runtime/counters.py``, so the bytes
a dump predicts from the schedule and the runtime's measured counters compare one to one
(x is the start's input, D the group size, ``itemsize`` its element size):

=================  ========================================================================
broadcast          numel * itemsize on every rank but the source, which receives 0
                   (numel is the op's ``numel`` argument: the source's buffer)
all_gather         (D-1) * numel(x) * itemsize — x is this rank's part
reduce_scatter     (D-1) * numel(x) / D * itemsize — x is the full buffer, 1/D of it is mine
reduce             (D-1) * numel(x) * itemsize on the destination, 0 elsewhere
ring               numel(x) * itemsize — one hop receives a buffer shaped like the one sent
all_reduce         2 (D-1) / D * numel(x) * itemsize — a reduce-scatter then an all-gather
=================  ========================================================================
"""

from __future__ import annotations

import hashlib
import json
import operator
import re
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import guarding_hint_or_throw

from tspc.runtime.comm import START_KIND, is_transfer_start, is_transfer_wait, wait_of
from tspc.runtime.compat import OpOverload, op_base_name, op_schema
from tspc.runtime.counters import KINDS, message_bytes, received_and_sent

# Ops that do the work a transfer should hide behind: GEMMs and attention kernels.
_HEAVY = re.compile(
    r"^(mm|addmm|bmm|baddbmm|matmul|linear|convolution\w*|_?scaled_dot_product\w*|\w*attention\w*)$"
)
_FREE_FUNCTIONS = {operator.getitem}


@dataclass
class Step:
    """One node of the graph in issue order (call_function nodes only)."""

    pos: int  # index among the graph's call_function nodes: the issue order
    name: str  # the node's name, as in the dumped Python
    op: str  # e.g. "aten.mm", "tspc.broadcast_start"
    role: str  # "start" | "wait" | "compute" | "view"
    heavy: bool = False
    tag: str = ""  # the layer a start/wait belongs to
    context: str = ""  # the layer whose transfer arrived last (where compute is "at")


@dataclass
class Transfer:
    """One collective: its start node, its wait node, and what it overlaps."""

    kind: str
    tag: str
    start: str
    start_pos: int
    wait: str | None
    wait_pos: int | None
    recv_bytes: int
    buffer: str  # dtype and shape of the start's input, e.g. "f32[6144]"
    signature: tuple  # the op and its non-tensor arguments: equal on every rank
    overlapped: list[str] = field(default_factory=list)  # compute issued between start and wait
    heavy_overlapped: list[str] = field(default_factory=list)

    @property
    def span(self) -> int:
        return 0 if self.wait_pos is None else self.wait_pos - self.start_pos

    def to_dict(self) -> dict:
        return {
            "kind": self.kind,
            "tag": self.tag,
            "start": self.start,
            "start_pos": self.start_pos,
            "wait": self.wait,
            "wait_pos": self.wait_pos,
            "recv_bytes": self.recv_bytes,
            "buffer": self.buffer,
            "overlapped_compute": len(self.overlapped),
            "overlapped_heavy": self.heavy_overlapped,
        }


@dataclass
class GraphSchedule:
    """The issue order of one graph: every step and every transfer."""

    label: str  # "forward", "backward" or "graph"
    steps: list[Step]
    transfers: list[Transfer]

    def counts(self) -> dict[str, int]:
        c = Counter(t.kind for t in self.transfers)
        return {k: c.get(k, 0) for k in KINDS}

    def bytes_by_kind(self) -> dict[str, int]:
        out = dict.fromkeys(KINDS, 0)
        for t in self.transfers:
            out[t.kind] += t.recv_bytes
        return out

    def bytes_by_tag(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.transfers:
            out[t.tag] = out.get(t.tag, 0) + t.recv_bytes
        return out

    def counts_by_tag(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for t in self.transfers:
            per = out.setdefault(t.tag, {})
            per[t.kind] = per.get(t.kind, 0) + 1
        return out

    def issue_order(self) -> list[tuple]:
        return [t.signature for t in self.transfers]

    def issue_order_hash(self) -> str:
        """A digest of the collectives' order and arguments: equal on every rank, or they hang."""
        text = json.dumps(self.issue_order(), default=str)
        return hashlib.sha1(text.encode()).hexdigest()[:16]


def _op_name(target) -> str:
    if isinstance(target, OpOverload):
        return f"{target.namespace}.{op_base_name(target)}"
    return getattr(target, "__name__", str(target))


def _role(n: fx.Node) -> str:
    if is_transfer_start(n):
        return "start"
    if is_transfer_wait(n):
        return "wait"
    if n.target in _FREE_FUNCTIONS or getattr(n.target, "is_view", False):
        return "view"
    return "compute"


def _is_heavy(n: fx.Node) -> bool:
    return bool(_HEAVY.match(_op_name(n.target).rsplit(".", 1)[-1]))


def _bind(n: fx.Node) -> dict:
    """The op's arguments by name (custom ops may be called positionally or by keyword)."""
    schema = op_schema(n.target)
    bound = {a.name: v for a, v in zip(schema.arguments, n.args)}
    bound.update(n.kwargs)
    return bound


def _fake(v) -> torch.Tensor:
    val = v.meta.get("val") if isinstance(v, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        raise ValueError(
            f"tspc dump: no fake value for '{getattr(v, 'name', v)}'; the graph lacks shape "
            "metadata (meta['val'])"
        )
    return val


def recv_bytes(kind: str, args: dict, rank: int) -> int:
    """Bytes this rank receives for one collective (``runtime/counters.py``'s table); ``args``
    are the start op's arguments, tensors given as (fake) tensors."""
    x = args["x"]
    world = int(args["world"])
    numel = _concrete(args["numel"] if kind == "broadcast" else x.numel())
    root = {"broadcast": "src", "reduce": "dst"}.get(kind)
    is_root = root is not None and rank == args[root]
    message = message_bytes(kind, numel, x.dtype, world, args.get("op", "sum"))
    return received_and_sent(kind, message, world, is_root)[0]


_DTYPE_SHORT = {
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.float64: "f64",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.bool: "b8",
}


def _concrete(size: int | torch.SymInt) -> int:
    """A size of the graph as a number. The program compiled for every length
    (``tspc/length_family.py``) has sizes in the sequence length's symbol: its schedule is read
    at the length it was compiled at (the symbol's hint)."""
    return size if isinstance(size, int) else int(guarding_hint_or_throw(size))


def describe(t: torch.Tensor) -> str:
    return f"{_DTYPE_SHORT.get(t.dtype, str(t.dtype))}{[_concrete(d) for d in t.shape]}"


def read_schedule(gm: fx.GraphModule, rank: int, label: str) -> GraphSchedule:
    """The issue order of ``gm`` as this rank runs it, with every transfer's bytes and overlap."""
    steps: list[Step] = []
    pos_of: dict[fx.Node, int] = {}
    starts: list[fx.Node] = []
    context = ""
    for n in gm.graph.nodes:
        if n.op != "call_function":
            continue
        role = _role(n)
        tag = ""
        if role == "start":
            tag = _bind(n).get("tag", "")
        elif role == "wait":  # a traced graph's wait_tensor has no tag: its start's
            tag = _bind(n.args[0]).get("tag", "")
        if role == "wait":
            context = tag
        pos_of[n] = len(steps)
        steps.append(
            Step(
                len(steps),
                n.name,
                _op_name(n.target),
                role,
                role == "compute" and _is_heavy(n),
                tag,
                context,
            )
        )
        if role == "start":
            starts.append(n)

    transfers = []
    for s in starts:
        kind = START_KIND[s.target]
        args = _bind(s)
        fake_args = {k: (_fake(v) if isinstance(v, fx.Node) else v) for k, v in args.items()}
        wait = wait_of(s)
        lo = pos_of[s]
        hi = pos_of[wait] if wait is not None else lo
        between = [st for st in steps[lo + 1 : hi] if st.role == "compute"]
        signature = (
            op_base_name(s.target),
            *(f"{k}={v}" for k, v in args.items() if k != "x" and not isinstance(v, fx.Node)),
        )
        transfers.append(
            Transfer(
                kind=kind,
                tag=args.get("tag", ""),
                start=s.name,
                start_pos=lo,
                wait=wait.name if wait is not None else None,
                wait_pos=pos_of[wait] if wait is not None else None,
                recv_bytes=recv_bytes(kind, fake_args, rank),
                buffer=describe(fake_args["x"]),
                signature=signature,
                overlapped=[st.name for st in between],
                heavy_overlapped=[st.name for st in between if st.heavy],
            )
        )
    return GraphSchedule(label, steps, transfers)
