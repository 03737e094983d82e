"""Write what the compiler did, per rank and per compiled graph, where a user can read it.

``options={"dump_dir": DIR}`` (or ``TSPC_DUMP_DIR=DIR``) makes every rank write
``DIR/rank<r>/graph<id>/`` (r: the global rank; the report also names the TSP-group rank):

=======================  ===================================================================
``NN_<pass>.py``         Dynamo's graph as captured (``00_captured.py``) and after each pass,
                         as Python
``forward.py``           the forward and backward graphs aot_autograd produced, after
``backward.py``          scheduling, with shapes (the backward once it is compiled)
``<g>_NN_<pass>.py``     aot_autograd's joint graph (``joint_00_traced.py``), forward graph
                         (``forward_00_partitioned.py``) and backward graph as their phase
                         of ``tspc/pipeline.py`` got them and after each of its passes
``collectives.txt``      every collective in issue order with its arguments; nothing in it
                         depends on the rank, so ``diff`` between two ranks' files is empty
                         unless they would issue different collectives (the cause of a hang)
``schedule.txt``         this rank's schedule: where each collective is issued and waited,
                         the bytes it receives and the compute it overlaps (EXPOSED: none)
``report.json``          matched / skipped modules, collectives per kind, bytes per kind and
                         per layer from the schedule beside the paper's formula, the runtime's
                         measured counters, the compile report
``schedule.html``        the schedule as a picture (``tspc/schedule_view.py``), opens offline
``summary.txt``          what ``tspc dump`` prints
=======================  ===================================================================

When the files are written: at compile time (so a run that hangs in its first step still leaves
the graphs and the schedule), again after the graph's first call (with the collectives the
runtime measured in it), and after the backward's first call (what the runtime measured in it;
the backward graph itself is compiled with the forward, ``tspc/inner.py``). The refreshes are
hooks on the callable the backend returns and on the compiled backward
(``AotGraphs.on_backward_compiled``, applied at its first call); after those first calls they
cost one flag test per call.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from fractions import Fraction
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from tspc.passes.analyse import analyse
from tspc.runtime.compat import keep_boxed_call
from tspc.runtime.counters import COUNTER, KINDS
from tspc.runtime.shard_store import STORE

from .graph_comm import GraphSchedule, read_schedule
from .schedule_view import SchedulePage, Table, render_page

if TYPE_CHECKING:
    from tspc.runtime.group import TSPGroup

    from .inner import AotGraphs
    from .options import TSPOptions
    from .pipeline import PipelineResult

log = logging.getLogger("tspc")

BYTES_CONVENTION = (
    "bytes this rank receives, by the convention of runtime/counters.py: broadcast numel "
    "(0 on the source); all_gather (D-1) parts; reduce_scatter (D-1)/D of the input; reduce "
    "(D-1) buffers on the destination, 0 elsewhere; ring one buffer per hop; all_reduce "
    "2(D-1)/D of the buffer"
)
FORMULA = {
    "attention forward": "(D-1)/D * beta * (P_attn + 2*B*S*h_kv)",
    "mlp forward": "(D-1)/D * beta * P_mlp",
    "layer forward (PAPER_NOTES)": "(D-1)/D * beta * (P_attn + P_mlp + 2*B*S*h_kv)",
    "backward": (
        "2x the forward: weights re-streamed (beta) and their gradients reduced to the owner "
        "(beta_grad = beta); K/V re-gathered and dK/dV reduce-scattered (tspc recomputes K/V "
        "instead of stashing it)"
    ),
    "terms": (
        "P = elements of the module's weight matrices that the schedule shards (biases "
        "excluded, as in the paper); "
        "beta = their element size; S = full sequence; B = batch (dims before the sequence dim "
        "of the sharded input); h_kv = kv_heads * head_dim"
    ),
}

DUMPS: list[GraphDump] = []
"""Every dump written in this process, oldest first (``tspc dump`` reads its own from here)."""


def _number(x: Fraction) -> int | float:
    return int(x) if x.denominator == 1 else float(x)


def _counter_delta(before: dict, after: dict) -> dict:
    """What the runtime recorded between two ``COUNTER.snapshot()`` calls."""

    def sub(a: dict, b: dict) -> dict:
        return {f: a[f] - b.get(f, 0) for f in ("calls", "recv_bytes", "sent_bytes")}

    per_kind = {k: sub(v, before["by_kind"].get(k, {})) for k, v in after["by_kind"].items()}
    per_layer = {}
    for tag, kinds in after["by_tag"].items():
        old = before["by_tag"].get(tag, {})
        recv = sum(sub(v, old.get(k, {}))["recv_bytes"] for k, v in kinds.items())
        calls = sum(sub(v, old.get(k, {}))["calls"] for k, v in kinds.items())
        if calls:
            per_layer[tag] = recv
    per_kind = {k: v for k, v in per_kind.items() if v["calls"]}
    return {
        "per_kind": per_kind,
        "per_layer": per_layer,
        "total": sum(v["recv_bytes"] for v in per_kind.values()),
    }


def _bytes_section(s: GraphSchedule) -> dict:
    return {
        "per_kind": s.bytes_by_kind(),
        "per_layer": s.bytes_by_tag(),
        "total": sum(t.recv_bytes for t in s.transfers),
    }


class GraphDump:
    """The dump of one compiled graph on this rank; ``write`` (re)writes all of its files."""

    def __init__(
        self,
        root: str,
        result: PipelineResult,
        graphs: AotGraphs,
        group: TSPGroup,
        example_inputs: list[Any],
        opts: TSPOptions,
    ):
        self.result = result
        self.report = result.report
        self.graphs = graphs
        self.group = group
        self.inner = opts.inner
        self.overlap = opts.overlap
        initialised = dist.is_available() and dist.is_initialized()
        self.global_rank = dist.get_rank() if initialised else group.rank
        self.pg_backend = str(dist.get_backend()) if initialised else None
        self.dir = os.path.join(root, f"rank{self.global_rank}", f"graph{self.report.graph_id}")
        self.measured: dict[str, dict] = {}
        self._params, self.batch = self._model_facts(example_inputs)
        self._snapshots_written = False
        self._aot_written: set[str] = set()

    def _model_facts(self, example_inputs: list[Any]) -> tuple[dict, int | None]:
        """Parameter sizes by FQN and the batch size: the formula's terms, read once at
        compile time (only metadata: a released parameter still knows its shape)."""
        info = analyse(self.result.gm, example_inputs)
        # The matched weights are the parameters the rewrites sharded: those in the shard store.
        params = {
            i.fqn: (i.example.numel(), i.example.dim(), i.example.element_size())
            for i in info.inputs
            if i.kind == "parameter" and i.example in STORE
        }
        batch = None
        shapes = {i.node.name: getattr(i.example, "shape", None) for i in info.inputs}
        for name, dim in self.report.sharded_inputs:
            shape = shapes.get(name)
            if shape is not None and dim > 0:
                batch = 1
                for d in shape[:dim]:
                    batch *= int(d)
                break
        return params, batch

    # ------------------------------------------------------------------ what the graphs hold

    def schedules(self) -> list[GraphSchedule]:
        rank = self.group.rank
        if self.inner == "eager":  # no aot graphs: the pipeline's graph is what runs
            return [read_schedule(self.result.gm, rank, "graph")]
        out = []
        for label, gms in (
            ("forward", self.graphs.forward_gms),
            ("backward", self.graphs.backward_gms),
        ):
            for i, gm in enumerate(gms):
                out.append(read_schedule(gm, rank, label if i == 0 else f"{label} {i}"))
        return out

    def formula(self) -> dict:
        """The paper's per-layer bytes for every matched module, forward and backward."""
        D = self.report.world
        # the tokens the K/V gathers move: a padded sequence moves its padding too
        S = self.report.padded_seq_len or self.report.seq_len
        terms, per_layer = {}, {}
        kinds_of: dict[str, set[str]] = {}
        for e in self.report.matched:
            kinds_of.setdefault(e.module, set()).add(e.kind)
        for e in self.report.matched:
            if len(kinds_of[e.module]) > 1:
                terms[e.module] = {"note": "attention and MLP share this module: P cannot be split"}
                continue
            prefix = f"{e.module}." if e.module else ""  # "" is the root module
            mats = [v for k, v in self._params.items() if k.startswith(prefix) and v[1] >= 2]
            if not mats:
                continue
            beta = mats[0][2]
            p = sum(v[0] for v in mats)
            t = {"D": D, "beta": beta, "P": p}
            volume = p
            if e.kind == "attention":
                h_kv = e.details.get("kv_heads", 0) * e.details.get("head_dim", 0)
                if self.batch is None or not S or not h_kv:
                    continue
                t.update(B=self.batch, S=S, h_kv=h_kv)
                volume = p + 2 * self.batch * S * h_kv
                if e.details.get("kv_heads", 0) % D:
                    t["note"] = (
                        "kv_heads is not a multiple of D: the schedule gathers K/V per KV head, "
                        "the formula assumes D head groups"
                    )
            fwd = Fraction((D - 1) * beta * volume, D)
            terms[e.module] = t
            per_layer[e.module] = {"forward": _number(fwd), "backward": _number(2 * fwd)}
        total = {d: sum(v[d] for v in per_layer.values()) for d in ("forward", "backward")}
        return {"expression": FORMULA, "terms": terms, "per_layer": per_layer, "total": total}

    def notes(self, has_backward: bool) -> list[str]:
        """What the dump cannot show, said where the numbers are read."""
        if self.inner == "eager":
            return [
                "inner='eager': there are no aot graphs; the schedule is the pipeline's graph, "
                "where each MLP ring is one opaque ring_mlp call (its hops are in 'measured' "
                "only), and the backward runs as autograd's adjoints, not as a graph"
            ]
        notes = []
        if self.inner == "inductor":
            notes.append(
                "inner='inductor': forward.py / backward.py are the graphs Inductor received; "
                "the kernels it generates may run the compute in another order "
                "(TORCH_LOGS=output_code shows it)"
            )
        if not has_backward:
            notes.append(
                "no backward graph: nothing of this graph needs a gradient (tspc compiles the "
                "backward with the forward, tspc/inner.py)"
            )
        return notes

    def report_dict(self, schedules: list[GraphSchedule] | None = None) -> dict:
        schedules = self.schedules() if schedules is None else schedules
        rep = self.report.to_dict()
        by_label = {s.label: s for s in schedules}
        forward = by_label.get("forward") or by_label.get("graph")
        backward = by_label.get("backward")
        per_kind = dict.fromkeys(KINDS, 0)
        bytes_kind = dict.fromkeys(KINDS, 0)
        per_layer: dict[str, int] = {}
        for s in schedules:
            for k, n in s.counts().items():
                per_kind[k] += n
            for k, b in s.bytes_by_kind().items():
                bytes_kind[k] += b
            for tag, b in s.bytes_by_tag().items():
                per_layer[tag] = per_layer.get(tag, 0) + b
        return {
            "graph_id": self.report.graph_id,
            "rank": self.global_rank,
            "tsp_rank": self.group.rank,
            "world_size": self.report.world,
            "process_group": self.pg_backend,
            "level": self.report.level,
            "inner": self.inner,
            "overlap": self.overlap,
            "seq_len": self.report.seq_len,
            "padded_seq_len": self.report.padded_seq_len,
            "batch": self.batch,
            "matched": rep["matched"],
            "skipped": rep["skipped"],
            "collectives": per_kind,
            "collectives_by_graph": {s.label: s.counts() for s in schedules},
            "collectives_by_layer": {s.label: s.counts_by_tag() for s in schedules},
            "comm_bytes": {
                "convention": BYTES_CONVENTION,
                "per_kind": bytes_kind,
                "per_layer": per_layer,
                "total": sum(bytes_kind.values()),
                "forward": _bytes_section(forward) if forward else None,
                "backward": _bytes_section(backward) if backward else None,
                "formula": self.formula(),
                "rewrite_prediction": dict(self.report.predicted_recv_bytes),
            },
            "measured": dict(self.measured, process_group=self.pg_backend)
            if self.measured
            else None,
            "backward_compiled": backward is not None,
            "dump_notes": self.notes(backward is not None),
            "issue_order_digest": {s.label: s.issue_order_hash() for s in schedules},
            "transfers": {s.label: [t.to_dict() for t in s.transfers] for s in schedules},
            # everything else the compile recorded (entries with details, gathers, notes, ...)
            "compile_report": {k: v for k, v in rep.items() if k not in ("matched", "skipped")},
        }

    # ------------------------------------------------------------------ files

    def _write(self, name: str, text: str) -> None:
        with open(os.path.join(self.dir, name), "w") as f:
            f.write(text)

    def _header(self, what: str) -> str:
        r = self.report
        return (
            f"# tspc dump: graph {r.graph_id}, rank {self.group.rank} of {r.world}, "
            f"pipeline level '{r.level}': {what}\n"
        )

    def write(self) -> str:
        os.makedirs(self.dir, exist_ok=True)
        if not self._snapshots_written:
            for i, (name, code) in enumerate(self.result.snapshots):
                what = "Dynamo's graph as captured" if i == 0 else f"after pass '{name}'"
                self._write(f"{i:02d}_{name}.py", self._header(what) + code)
            self._snapshots_written = True
        for label, snapshots in self.graphs.snapshots:  # the inner compiler's phases
            if f"{label}_NN" in self._aot_written:
                continue
            for i, (name, code) in enumerate(snapshots):
                what = f"aot_autograd {label} graph " + (
                    f"before its passes ('{name}')" if i == 0 else f"after pass '{name}'"
                )
                self._write(f"{label}_{i:02d}_{name}.py", self._header(what) + code)
            self._aot_written.add(f"{label}_NN")
        for label, gms in (
            ("forward", self.graphs.forward_gms),
            ("backward", self.graphs.backward_gms),
        ):
            for i, gm in enumerate(gms):
                name = label if i == 0 else f"{label}_{i}"
                if name in self._aot_written:  # compiled graphs do not change: written once
                    continue
                code = gm.print_readable(print_output=False, include_stride=False)
                self._write(f"{name}.py", self._header(f"aot_autograd {label} graph") + code)
                self._aot_written.add(name)
        schedules = self.schedules()
        data = self.report_dict(schedules)
        self._write("report.json", json.dumps(data, indent=2, default=str) + "\n")
        self._write("collectives.txt", collectives_text(schedules))
        self._write("schedule.txt", schedule_text(schedules))
        self._write("summary.txt", summary_text(data))
        self._write("schedule.html", render_page(schedule_page(data, schedules)))
        return self.dir

    def refresh(self) -> None:
        """Rewrite after a first call; a failure is logged, never raised into the user's step."""
        try:
            self.write()
        except Exception as e:  # noqa: BLE001 - a dump must not break training
            log.warning("tspc: could not update the dump in %s: %s", self.dir, e)

    def wrap_forward(self, fn: Callable) -> Callable:
        return _MeasureFirstCall(fn, self, "forward")

    def wrap_backward(self, fn: Callable) -> Callable:
        self.refresh()  # the backward graph exists now, before it first runs
        return _MeasureFirstCall(fn, self, "backward")


class _MeasureFirstCall:
    """Calls ``fn``; around its first call, records what the runtime's counters saw and
    rewrites the dump. Keeps ``fn``'s calling convention (aot's boxed calls)."""

    def __init__(self, fn: Callable, dump: GraphDump, label: str):
        self.fn = fn
        self.dump = dump
        self.label = label
        self.done = False
        keep_boxed_call(fn, self)

    def __call__(self, *args):
        if self.done:
            return self.fn(*args)
        self.done = True
        before = COUNTER.snapshot()
        out = self.fn(*args)
        self.dump.measured[self.label] = _counter_delta(before, COUNTER.snapshot())
        self.dump.refresh()
        return out


def write_dump(
    root: str,
    result: PipelineResult,
    graphs: AotGraphs,
    group: TSPGroup,
    compiled: Callable,
    example_inputs: list[Any],
    opts: TSPOptions,
) -> Callable:
    """Write the dump of a freshly compiled graph; return ``compiled`` wrapped so that the
    dump is refreshed after its first call and around its first backward."""
    dump = GraphDump(root, result, graphs, group, example_inputs, opts)
    DUMPS.append(dump)
    dump.write()
    log.info("tspc: graph %d dumped to %s", result.report.graph_id, dump.dir)
    graphs.on_backward_compiled = dump.wrap_backward
    return dump.wrap_forward(compiled)


# ---------------------------------------------------------------------- text and page


def collectives_text(schedules: list[GraphSchedule]) -> str:
    """The collectives in issue order with their rank-independent arguments only: equal on every
    rank of a correct program, so ``diff`` between two ranks' files shows where they diverge."""
    lines = [
        "# every collective in issue order: kind, layer (tag) and the op's other arguments.",
        "# Nothing here depends on the rank: diff this file between ranks to find a divergence",
        "# (ranks that issue different collectives hang). Positions and overlap: schedule.txt.",
    ]
    for s in schedules:
        lines.append(
            f"\n## {s.label}: {len(s.transfers)} collectives, digest {s.issue_order_hash()}"
        )
        tag_w = max((len(t.tag) for t in s.transfers), default=0)
        for i, t in enumerate(s.transfers):
            args = " ".join(a for a in t.signature[1:] if not a.startswith("tag="))
            lines.append(f"{i:5d}  {t.kind:14s} {t.tag:{tag_w}s}  {args}")
    return "\n".join(lines) + "\n"


def schedule_text(schedules: list[GraphSchedule]) -> str:
    """This rank's schedule: where each transfer is issued and waited, and what it overlaps."""
    lines = [
        "# every collective: its position among the graph's ops (#), start node, kind, layer, the",
        "# buffer it sends, bytes this rank receives, its wait, and the compute issued in between",
        "# (heavy: GEMMs and attention kernels). Positions differ between ranks where the local",
        "# compute does (zigzag chunks); the collectives' order does not (collectives.txt).",
    ]
    for s in schedules:
        lines.append(f"\n## {s.label}: {len(s.steps)} ops, {len(s.transfers)} collectives")
        name_w = max((len(t.start) for t in s.transfers), default=0)
        tag_w = max((len(t.tag) for t in s.transfers), default=0)
        buf_w = max((len(t.buffer) for t in s.transfers), default=0)
        for t in s.transfers:
            waited = f"waited #{t.wait_pos} {t.wait}" if t.wait else "NEVER WAITED"
            heavy = f" ({len(t.heavy_overlapped)} heavy)" if t.heavy_overlapped else ""
            exposed = "  EXPOSED" if t.wait and not t.overlapped else ""
            lines.append(
                f"#{t.start_pos:<5d} {t.start:{name_w}s}  {t.kind:14s} {t.tag:{tag_w}s}  "
                f"{t.buffer:{buf_w}s} {t.recv_bytes:>10d} B  {waited}, overlaps "
                f"{len(t.overlapped)} compute{heavy}{exposed}"
            )
    return "\n".join(lines) + "\n"


def _layer_rows(data: dict) -> list[list]:
    """Per layer: (layer, fwd schedule, fwd formula, fwd measured, bwd ...); the matched modules
    first, then the output gather, then everything else in one row."""
    cb = data["comm_bytes"]
    formula = cb["formula"]["per_layer"]
    measured = data["measured"] or {}
    fwd = (cb["forward"] or {}).get("per_layer", {})
    bwd = (cb["backward"] or {}).get("per_layer", {}) if cb["backward"] else None
    mf = (measured.get("forward") or {}).get("per_layer") if "forward" in measured else None
    mb = (measured.get("backward") or {}).get("per_layer") if "backward" in measured else None
    layers = [m["module"] for m in data["matched"]]
    tags = set(fwd) | set(bwd or {}) | set(mf or {}) | set(mb or {})
    named = layers + (["output"] if "output" in tags else [])
    rest = sorted(tags - set(named))

    def get(d, keys):
        return None if d is None else sum(d.get(k, 0) for k in keys)

    rows = []
    for label, keys in [(t, [t]) for t in named] + (
        [(f"other ({len(rest)} tags)", rest)] if rest else []
    ):
        f = formula.get(keys[0], {}) if len(keys) == 1 else {}
        rows.append(
            [
                label,
                get(fwd, keys),
                f.get("forward"),
                get(mf, keys),
                get(bwd, keys),
                f.get("backward"),
                get(mb, keys),
            ]
        )
    return rows


def _padded(data: dict) -> str:
    """' (padded to P)' for a sequence the ranks ran padded, else ''."""
    p = data.get("padded_seq_len")
    return f" (padded to {p})" if p and p != data.get("seq_len") else ""


def summary_text(data: dict) -> str:
    def cell(v) -> str:
        return "-" if v is None else f"{v:g}" if isinstance(v, float) else str(v)

    lines = [
        f"graph {data['graph_id']} on rank {data['tsp_rank']} of {data['world_size']} "
        f"(process group: {data['process_group'] or 'none'}): ran '{data['level']}', "
        f"sequence {data['seq_len']}{_padded(data)}, batch {data['batch']}"
    ]
    for m in data["matched"]:
        lines.append(f"  {m['kind']:9s} matched  {m['module']}")
    for m in data["skipped"]:
        lines.append(f"  {m['kind']:9s} skipped  {m['module']}: {m['reason']}")
    compile_report = data["compile_report"]
    for f in compile_report.get("fallbacks", []):
        lines.append(f"  fallback: {f}")
    # what each attention mask ran as, one line per distinct meaning (layers alike collapse)
    masks: dict[tuple, list[str]] = {}
    for m in compile_report.get("masks", []):
        key = (m.get("recognised"), m.get("kind", "?"), m.get("detail", ""))
        masks.setdefault(key, []).append(m.get("module") or m.get("sdpa") or "?")
    for (recognised, kind, detail), where in masks.items():
        state = kind if recognised else "not recognised (each rank cuts its mask rows)"
        lines.append(f"  mask {state} x{len(where)} (first {where[0]}): {detail}")
    # where the sequence had to be gathered, and the passes' notes: what a mismatch hunt needs
    extra = [
        f"gather {g.get('value')} for {g.get('op')}: {g.get('reason')}"
        for g in compile_report.get("gathers", [])
    ]
    extra += [f"note: {n}" for n in compile_report.get("notes", [])]
    lines += [f"  {line}" for line in extra[:6]]
    if len(extra) > 6:
        lines.append(f"  ... {len(extra) - 6} more in report.json (compile_report)")
    labels = list(data["collectives_by_graph"])
    lines.append("")
    lines.append("collectives (calls):  " + "".join(f"{lb:>10s}" for lb in labels))
    for k in KINDS:
        counts = [data["collectives_by_graph"][lb][k] for lb in labels]
        if any(counts):
            lines.append(f"  {k:19s} " + "".join(f"{c:10d}" for c in counts))
    lines.append("")
    lines.append("bytes received per layer:          forward                          backward")
    lines.append(
        f"  {'layer':28s}{'schedule':>10s}{'formula':>10s}{'measured':>10s}"
        f"  {'schedule':>10s}{'formula':>10s}{'measured':>10s}"
    )
    for row in _layer_rows(data):
        lines.append(
            f"  {row[0]:28s}"
            + "".join(f"{cell(v):>10s}" for v in row[1:4])
            + "  "
            + "".join(f"{cell(v):>10s}" for v in row[4:])
        )
    lines += [f"  note: {n}" for n in data["dump_notes"]]
    digest = ", ".join(f"{k} {v}" for k, v in data["issue_order_digest"].items())
    lines.append(f"\nissue-order digest (equal on every rank): {digest}")
    return "\n".join(lines) + "\n"


def schedule_page(data: dict, schedules: list[GraphSchedule]) -> SchedulePage:
    collectives = Table(
        "collectives (calls) per graph",
        ["kind", *data["collectives_by_graph"]],
        [
            [k, *(data["collectives_by_graph"][lb][k] for lb in data["collectives_by_graph"])]
            for k in KINDS
        ],
    )
    layers = Table(
        "bytes received by this rank per layer: from the schedule, the paper's formula, and "
        "measured by the runtime",
        [
            "layer",
            "forward schedule",
            "forward formula",
            "forward measured",
            "backward schedule",
            "backward formula",
            "backward measured",
        ],
        _layer_rows(data),
    )
    modules = Table(
        "modules",
        ["kind", "module", "status", "reason"],
        [[m["kind"], m["module"], "matched", ""] for m in data["matched"]]
        + [[m["kind"], m["module"], "skipped", m["reason"]] for m in data["skipped"]],
    )
    return SchedulePage(
        title=(
            f"tspc schedule: graph {data['graph_id']}, rank {data['tsp_rank']} of "
            f"{data['world_size']} (level '{data['level']}')"
        ),
        lines=[
            f"sequence {data['seq_len']}{_padded(data)}, batch {data['batch']}, inner compiler "
            f"{data['inner']}, overlap {data['overlap']}, process group "
            f"{data['process_group'] or 'none'}",
            data["comm_bytes"]["convention"] + ".",
        ],
        tables=[modules, collectives, layers],
        schedules=schedules,
        layers=[m["module"] for m in data["matched"]],
    )
