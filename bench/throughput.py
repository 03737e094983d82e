"""Throughput: TSP against one process and against TP / TP+SP, and how much overlap hides.

    python bench/throughput.py                  # the README table (~10 min on 2 cores)
    python bench/throughput.py --quick          # a smoke run (tiny shapes, ~2 min)
    python bench/throughput.py --inner inductor # TSP's inner compiler (and the baselines')
    python bench/throughput.py --device cuda    # section (a) on a GPU (one process)

One model (the reference Llama-style model with its cross-entropy loss inside the compiled
program), one global batch and sequence per row; every rank is given the full batch, as a
user would (TSP takes its zigzag tokens, TP+SP its sequence slice, TP all of it). A step is
forward + backward of the loss (no optimizer: its cost is the same elementwise update on 1/D of
the weights for TSP, TP and TP+SP). Each configuration is compiled once (its first call is not
timed), then all configurations of a section take turns, step by step, ``--iters`` times after
``--warmup`` steps, with a barrier before each step; a step's time is the slowest rank's, and a
row's figure is the median over steps. Taking turns means a slow patch of the machine (other
processes) hits every configuration alike instead of one.

Sections (one table):

(a) one process, D = 1: eager, ``torch.compile`` (Inductor), ``torch.compile(backend=
    "aot_eager")``, ``backend="tsp"`` with its default options (inner Inductor) and with inner
    ``aot_eager``. The ratio is throughput relative to Inductor (its time / the row's): the
    rewrite must cost nothing at D = 1. Two models: the reference model below, and an
    elementwise-heavy one (h=256, 8 heads / 2 KV, SwiGLU, RoPE, 4 layers, B=2, S=256), whose
    time is not almost all GEMMs. Each model runs ``a_repeats`` times, each time in a fresh
    process (the machine is shared: ratios are taken inside one process, where the
    configurations take turns, and the median over the processes is reported). All processes
    of a model share one new Inductor cache directory, so the first process compiles cold and
    the later ones warm (Inductor's FX graph cache, AOTAutograd's cache): the note gives both
    compile times and the cache hits of the warm ones.
(b) D = 2 and 4 on gloo, for a token count B·S well above 8h and one below it: TSP (default
    options), TP+SP and TP (``bench/baselines.py``: torch's ``parallelize_module`` plans),
    compiled with the same compiler as TSP's inner one. Ratio: TSP's throughput over each.
(c) the long shape at D = 2 and 4: TSP with overlap on, with ``overlap=False`` (every transfer
    next to its use), and with communication removed (every rank on its own ``fake`` process
    group — collectives do nothing; the compute-only lower bound). Exposed communication is a
    configuration's time minus the lower bound; the hidden fraction is
    ``(off - on) / (off - no comm)``: the share of the communication that overlap-off exposes
    and overlap-on hides.
(d) compile time of a 32-layer model (small hidden size): the first forward + backward with
    ``backend="tsp"`` (inner ``aot_eager``) against ``backend="aot_eager"``, one process
    (D = 1) and as rank 0 of 2 on the ``fake`` process group. tspc's own share is timed
    separately: the pass pipeline (``tspc.pipeline.run_pipeline``), the schedule pass on the
    forward and backward graphs aot_autograd makes, the partitioner tags, and the release of
    the full weights after the first call. The rest is Dynamo and aot_autograd (tracing the
    rewritten graph, which has about D times the nodes per layer, and partitioning it).

Threads: every process runs one intra-op thread (``tspc.launch``). At D = 4 four processes
share the machine's cores; on a 2-core machine each rank gets half a core, so a D = 4 step is
about twice as long as its work, communication included (gloo's threads compete for the same
cores), and overlap can only hide what is left over. Denormals are flushed in every process:
the no-communication rows compute on buffers no collective filled.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch
import torch.nn.functional as F
from torch import nn

from tspc.tools.plan import ModelShape

# --------------------------------------------------------------------------------------------
# What is measured
# --------------------------------------------------------------------------------------------


def describe(model: ModelShape) -> str:
    return (
        f"h={model.hidden}, {model.heads} heads ({model.kv_heads} KV), F={model.intermediate}, "
        f"{model.layers} layers, vocab {model.vocab}"
    )


@dataclass(frozen=True)
class Tokens:
    name: str
    batch: int
    seq: int

    @property
    def count(self) -> int:
        return self.batch * self.seq

    def describe(self, hidden: int) -> str:
        rel = "above" if self.count > 8 * hidden else "below"
        return f"B·S = {self.batch}x{self.seq} = {self.count} ({rel} 8h = {8 * hidden})"


@dataclass(frozen=True)
class Plan:
    model: ModelShape
    long: Tokens
    short: Tokens
    devices: tuple[int, ...] = (2, 4)
    warmup: int = 2
    iters: int = 7
    inner: str = "aot_eager"
    compile_layers: int = 32
    compile_model: ModelShape = ModelShape(
        hidden=64, layers=32, heads=4, kv_heads=2, intermediate=128, vocab=256
    )
    compile_tokens: Tokens = Tokens("compile", 2, 64)
    device: str = "cpu"
    sections: tuple[str, ...] = ("a", "b", "c", "d")
    # section (a)'s second model (the first is ``model`` at ``long``) and its repeats
    a_model: ModelShape = ModelShape(
        hidden=256, layers=4, heads=8, kv_heads=2, intermediate=704, vocab=512
    )
    a_tokens: Tokens = Tokens("elementwise", 2, 256)
    a_repeats: int = 3


FULL = Plan(
    model=ModelShape(hidden=128, layers=2, heads=8, kv_heads=4, intermediate=384, vocab=512),
    long=Tokens("long", 2, 2048),  # 4096 tokens: 4 x 8h
    short=Tokens("short", 1, 256),  # 256 tokens: 8h / 4
)
QUICK = Plan(
    model=ModelShape(hidden=64, layers=2, heads=4, kv_heads=4, intermediate=128, vocab=256),
    long=Tokens("long", 2, 512),  # 1024 tokens: 2 x 8h
    short=Tokens("short", 1, 64),  # 64 tokens: 8h / 8
    warmup=1,
    iters=3,
    compile_model=ModelShape(hidden=64, layers=8, heads=4, kv_heads=2, intermediate=128, vocab=256),
    compile_layers=8,
    a_model=ModelShape(hidden=64, layers=2, heads=8, kv_heads=2, intermediate=192, vocab=256),
    a_tokens=Tokens("elementwise", 2, 64),
    a_repeats=2,
)


class LossModel(nn.Module):
    """``model(ids) -> logits`` plus the token-level cross-entropy, compiled as one program
    (TSP then reduces the loss over its local tokens instead of gathering the logits)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(self.model(ids).flatten(0, 1).float(), targets.flatten())


def _data(tokens: Tokens, vocab: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (tokens.batch, tokens.seq), generator=g)
    targets = torch.randint(0, vocab, (tokens.batch, tokens.seq), generator=g)
    return ids.to(device), targets.to(device)


# --------------------------------------------------------------------------------------------
# Configurations, as built inside a process
# --------------------------------------------------------------------------------------------


@dataclass
class Runner:
    """One configuration: a compiled loss and the parameters whose gradients a step clears."""

    key: str
    loss: Callable[..., torch.Tensor]
    params: Callable[[], list[torch.Tensor]]
    compile_s: float = 0.0
    times: list[float] = field(default_factory=list)
    cache: dict[str, int] = field(default_factory=dict)  # cache counters of its compile

    def step(self, ids: torch.Tensor, targets: torch.Tensor) -> None:
        for p in self.params():
            p.grad = None
        self.loss(ids, targets).backward()


def _compiler_for(inner: str) -> dict[str, Any]:
    """The torch.compile arguments of a baseline compiled like TSP's inner compiler."""
    backend = {"inductor": "inductor", "aot_eager": "aot_eager", "eager": "eager"}[inner]
    return {"backend": backend, "dynamic": False}


def build_runner(key: str, model_shape: ModelShape, inner: str, fake_group=None) -> Runner:
    """``key``: eager, inductor, aot_eager, tsp[:inner], tsp_no_overlap, tsp_no_comm, tp_sp, tp."""
    from bench.baselines import build_tp, build_tp_sp
    from tspc.tools.measure import reference_model

    base = reference_model(model_shape)
    if key == "tp":
        base = build_tp(base)
    elif key == "tp_sp":
        base = build_tp_sp(base)
    model = LossModel(base)
    plain = lambda: list(model.parameters())  # noqa: E731
    if key == "eager":
        return Runner(key, model, plain)
    if key in ("inductor", "aot_eager"):
        return Runner(key, torch.compile(model, backend=key, dynamic=False), plain)
    if key in ("tp", "tp_sp"):
        return Runner(key, torch.compile(model, **_compiler_for(inner)), plain)
    options: dict[str, Any] = {"inner": inner}
    if key == "tsp:default":
        options = {}
    elif key.startswith("tsp:"):
        options["inner"] = key.split(":", 1)[1]
    elif key == "tsp_no_overlap":
        options["overlap"] = False
    elif key == "tsp_no_comm":
        options["group"] = fake_group
    elif key != "tsp":
        raise ValueError(f"unknown configuration {key!r}")
    compiled = torch.compile(model, backend="tsp", options=options, dynamic=False)
    return Runner(key, compiled, lambda: list(model.parameters()))


def _prepare_process() -> None:
    torch.manual_seed(0)
    torch.set_flush_denormal(True)
    # Several compiled configurations of the same model class live in one process: keep Dynamo
    # from falling back to eager after its default number of cache entries per code object.
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 256)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _cache_counters() -> dict[str, int]:
    """Inductor's FX graph cache and AOTAutograd's cache: hits, misses, bypasses so far."""
    from torch._dynamo.utils import counters

    out = {}
    for group, names in (
        ("inductor", ("fxgraph_cache_hit", "fxgraph_cache_miss", "fxgraph_cache_bypass")),
        ("aot_autograd", ("autograd_cache_hit", "autograd_cache_miss", "autograd_cache_bypass")),
    ):
        for n in names:
            out[n] = counters[group][n]
    return out


def time_round_robin(
    runners: list[Runner], tokens: Tokens, vocab: int, plan: Plan, barrier: Callable[[], None]
) -> None:
    """Compile each runner (first call, timed apart), then time them step by step in turns."""
    ids, targets = _data(tokens, vocab, plan.device)
    for r in runners:
        barrier()
        before = _cache_counters()
        t = time.perf_counter()
        r.step(ids, targets)
        _sync(plan.device)
        r.compile_s = time.perf_counter() - t
        after = _cache_counters()
        r.cache = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
        r.times = []
    for i in range(plan.warmup + plan.iters):
        for r in runners:
            barrier()
            t = time.perf_counter()
            r.step(ids, targets)
            _sync(plan.device)
            if i >= plan.warmup:
                r.times.append(time.perf_counter() - t)


# --------------------------------------------------------------------------------------------
# Workers (spawned processes; they return plain data)
# --------------------------------------------------------------------------------------------


def one_process_worker(
    rank: int, world: int, plan: Plan, keys: list[str], model: ModelShape, tokens: Tokens
) -> dict[str, Any]:
    """Section (a): every D = 1 configuration of one model in one process, taking turns."""
    _prepare_process()
    runners = [build_runner(k, model, plan.inner) for k in keys]
    if plan.device != "cpu":
        for r in runners:
            r.loss.to(plan.device)  # type: ignore[union-attr]
    time_round_robin(runners, tokens, model.vocab, plan, barrier=lambda: None)
    return {r.key: {"times": r.times, "compile_s": r.compile_s, "cache": r.cache} for r in runners}


def parallel_worker(rank: int, world: int, plan: Plan) -> dict[str, Any]:
    """Sections (b) and (c) at one D: every configuration in the same D processes."""
    import torch.distributed as dist
    import torch.testing._internal.distributed.fake_pg  # noqa: F401 - registers "fake"

    _prepare_process()
    # Every rank on its own group whose collectives do nothing: the compute-only lower bound.
    fake_group = dist.new_group(backend="fake")
    out: dict[str, Any] = {}
    for tokens, keys in (
        (plan.long, ["tsp", "tsp_no_overlap", "tsp_no_comm", "tp_sp", "tp"]),
        (plan.short, ["tsp", "tp_sp", "tp"]),
    ):
        torch.compiler.reset()
        runners = [build_runner(k, plan.model, plan.inner, fake_group) for k in keys]
        time_round_robin(runners, tokens, plan.model.vocab, plan, barrier=dist.barrier)
        out[tokens.name] = {r.key: {"times": r.times, "compile_s": r.compile_s} for r in runners}
    return out


def compile_time_worker(queue, plan: Plan, world: int) -> None:
    """Section (d), in a fresh process: first forward + backward of tsp vs aot_eager."""
    import torch.distributed as dist

    import tspc.backend
    import tspc.inner
    from tspc.tools.measure import reference_model

    torch.set_num_threads(1)
    if world > 1:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    spent = {"passes": 0.0}

    def timed(module: Any, name: str) -> None:
        fn = getattr(module, name)

        def run(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent["passes"] += time.perf_counter() - t

        setattr(module, name, run)

    # everything tspc itself does while compiling and at the first call (not nested)
    timed(tspc.backend, "run_pipeline")
    timed(tspc.backend, "create_sharded_dparam")  # the first call cuts the shards
    timed(tspc.inner, "run_passes")  # the joint, forward/backward and post-grad phases
    ids, targets = _data(plan.compile_tokens, plan.compile_model.vocab)
    result: dict[str, float] = {}
    for key in ("aot_eager", "tsp", "aot_eager_again", "tsp_again"):
        torch.compiler.reset()
        model = LossModel(reference_model(plan.compile_model))
        if key.startswith("tsp"):
            run = torch.compile(model, backend="tsp", options={"inner": "aot_eager"})
        else:
            run = torch.compile(model, backend="aot_eager")
        spent["passes"] = 0.0
        t = time.perf_counter()
        run(ids, targets).backward()
        result[key] = time.perf_counter() - t
        if key.startswith("tsp"):
            result[key + "_passes"] = spent["passes"]
    if dist.is_initialized():
        dist.destroy_process_group()
    queue.put(result)


def run_isolated(fn: Callable, *args: Any, timeout: float = 1200.0) -> Any:
    """``fn(queue, *args)`` in a fresh spawned process (no process group of ours)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    proc = ctx.Process(target=fn, args=(queue, *args))
    proc.start()
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        raise RuntimeError(f"{fn.__name__} did not finish within {timeout:.0f} s")
    if queue.empty():
        raise RuntimeError(f"{fn.__name__} failed (exit code {proc.exitcode})")
    return queue.get()


# --------------------------------------------------------------------------------------------
# Rows
# --------------------------------------------------------------------------------------------


@dataclass
class Row:
    section: str
    label: str
    devices: int
    tokens: str
    ms: float  # median step time (slowest rank); for (d): seconds of the first step
    ratio: float | None = None
    note: str = ""


def step_ms(per_rank: list[dict[str, Any]], key: str) -> float:
    """Median over steps of the slowest rank's time, in ms."""
    steps = zip(*(r[key]["times"] for r in per_rank))
    return 1000 * statistics.median(max(s) for s in steps)


LABELS = {
    "eager": "one process, eager",
    "inductor": "one process, torch.compile (Inductor)",
    "aot_eager": "one process, torch.compile (aot_eager)",
    "tsp": "TSP",
    "tsp_no_overlap": "TSP, overlap=False",
    "tsp_no_comm": "TSP, no communication (fake group)",
    "tp_sp": "TP+SP (parallelize_module)",
    "tp": "TP (parallelize_module)",
}


def _label(key: str) -> str:
    if key == "tsp:default":
        from tspc.options import TSPOptions

        return f'backend="tsp", default options (inner {TSPOptions().inner})'
    if key.startswith("tsp:"):
        return f'backend="tsp", inner={key.split(":", 1)[1]}'
    return LABELS[key]


def _cache_note(cache: dict[str, int]) -> str:
    short = {
        "fxgraph_cache_hit": "FX hit",
        "fxgraph_cache_miss": "FX miss",
        "fxgraph_cache_bypass": "FX bypass",
        "autograd_cache_hit": "AOT hit",
        "autograd_cache_miss": "AOT miss",
        "autograd_cache_bypass": "AOT bypass",
    }
    return " ".join(f"{short[k]} {v}" for k, v in cache.items() if v) or "no cache"


def section_a(plan: Plan, progress: Callable[[str], None]) -> tuple[list[Row], dict]:
    import tempfile

    from tspc.launch import spawn

    keys = ["eager", "inductor", "aot_eager", "tsp:aot_eager", "tsp:default"]
    if plan.device != "cpu":
        keys = ["eager", "inductor", "tsp:default"]
    rows, raw = [], {}
    for model, tokens in ((plan.model, plan.long), (plan.a_model, plan.a_tokens)):
        cache_dir = tempfile.mkdtemp(prefix="tspc-bench-inductor-")
        env = {"TORCHINDUCTOR_CACHE_DIR": cache_dir, "TSPC_INNER": ""}
        runs = []
        for rep in range(plan.a_repeats):
            progress(
                f"(a) D = 1 on {plan.device}, {describe(model)}, B x S = {tokens.batch} x "
                f"{tokens.seq}: process {rep + 1}/{plan.a_repeats} "
                f"({'cold' if rep == 0 else 'warm'} caches)"
            )
            (res,) = spawn(one_process_worker, 1, plan, keys, model, tokens, timeout=3600, env=env)
            runs.append(res)
        raw[f"{describe(model)} {tokens.name}"] = runs
        desc = f"{describe(model)}; {tokens.describe(model.hidden)}"
        for k in keys:
            ms = statistics.median(step_ms([r], k) for r in runs)
            ratio = statistics.median(step_ms([r], "inductor") / step_ms([r], k) for r in runs)
            ratios = ", ".join(f"{step_ms([r], 'inductor') / step_ms([r], k):.2f}" for r in runs)
            note = f"ratios {ratios}; compile cold {runs[0][k]['compile_s']:.1f} s"
            if len(runs) > 1:
                warm = statistics.median(r[k]["compile_s"] for r in runs[1:])
                note += f", warm {warm:.1f} s ({_cache_note(runs[-1][k]['cache'])})"
            if plan.device != "cpu":
                note += f"; {plan.device}"
            rows.append(Row("a", _label(k), 1, desc, ms, ratio, note))
    return rows, raw


def section_bc(plan: Plan, progress: Callable[[str], None]) -> tuple[list[Row], dict]:
    from tspc.launch import spawn

    rows: list[Row] = []
    raw: dict = {}
    for d in plan.devices:
        progress(f"(b, c) D = {d}: TSP, TP+SP, TP (long and short); TSP overlap off, no comm")
        t = time.perf_counter()
        per_rank = spawn(parallel_worker, d, plan, timeout=3600)
        progress(f"   D = {d} took {time.perf_counter() - t:.0f} s")
        raw[d] = per_rank
        for tokens in (plan.long, plan.short):
            res = [r[tokens.name] for r in per_rank]
            desc = tokens.describe(plan.model.hidden)
            tsp = step_ms(res, "tsp")
            compile_note = f"compile {max(r['tsp']['compile_s'] for r in res):.1f} s"
            rows.append(Row("b", "TSP", d, desc, tsp, None, compile_note))
            for base in ("tp_sp", "tp"):
                ms = step_ms(res, base)
                rows.append(Row("b", f"{_label(base)}: TSP speed-up", d, desc, ms, ms / tsp))
            if tokens is plan.long:
                off, none = step_ms(res, "tsp_no_overlap"), step_ms(res, "tsp_no_comm")
                exposed_on, exposed_off = tsp - none, off - none
                hidden = (off - tsp) / exposed_off if exposed_off > 0 else float("nan")
                rows += [
                    Row("c", "TSP, overlap on", d, desc, tsp, none / tsp, "exposed comm "
                        f"{exposed_on:.1f} ms"),
                    Row("c", "TSP, overlap off", d, desc, off, none / off, "exposed comm "
                        f"{exposed_off:.1f} ms"),
                    Row("c", "TSP, no communication", d, desc, none, 1.0, "compute-only bound"),
                    Row("c", "communication hidden by overlap", d, desc, float("nan"), hidden,
                        "(off - on) / (off - no comm)"),
                ]  # fmt: skip
    return rows, raw


def section_d(plan: Plan, progress: Callable[[str], None]) -> tuple[list[Row], dict]:
    rows, raw = [], {}
    m = plan.compile_model
    desc = f"{m.layers} layers, h={m.hidden}, B·S = {plan.compile_tokens.count}"
    for world in (1, 2):
        progress(f"(d) compile time, {m.layers} layers, D = {world}")
        res = run_isolated(compile_time_worker, plan, world)
        raw[world] = res
        # the second compile of each (warm imports and caches) is the one compared
        base, tsp, passes = res["aot_eager_again"], res["tsp_again"], res["tsp_again_passes"]
        who = "one process" if world == 1 else "rank 0 of 2 (fake group)"
        rows += [
            Row("d", f'backend="aot_eager", first step ({who})', world, desc, 1000 * base, 1.0),
            Row("d", f'backend="tsp", first step ({who})', world, desc, 1000 * tsp, tsp / base,
                f"tspc's passes {passes:.1f} s = {100 * passes / base:.0f}% of aot_eager"),
        ]  # fmt: skip
    return rows, raw


# --------------------------------------------------------------------------------------------
# The table
# --------------------------------------------------------------------------------------------

SECTION_TITLES = {
    "a": "(a) one process: ratio = throughput relative to torch.compile (Inductor), median over "
    "processes",
    "b": "(b) TSP vs TP+SP and TP on gloo: ratio = TSP throughput / baseline throughput",
    "c": "(c) overlap: ratio = compute-only bound / step time (1.0 = all communication hidden)",
    "d": "(d) compile time of the first step (ms): ratio = tsp / aot_eager",
}


def _fmt(x: float | None, spec: str) -> str:
    if x is None or x != x:  # None or NaN
        return "-"
    return format(x, spec)


def format_table(rows: list[Row], markdown: bool = False) -> str:
    header = ["configuration", "D", "tokens", "ms", "ratio", "note"]
    body = []
    for section in "abcd":
        part = [r for r in rows if r.section == section]
        if not part:
            continue
        body.append([SECTION_TITLES[section], "", "", "", "", ""])
        for r in part:
            body.append(
                [r.label, str(r.devices), r.tokens, _fmt(r.ms, ".1f"), _fmt(r.ratio, ".2f"), r.note]
            )
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for cells in body:
            if cells[1] == "":
                lines.append(f"| **{cells[0]}** |  |  |  |  |  |")
            else:
                lines.append("| " + " | ".join(cells) + " |")
        return "\n".join(lines)
    widths = [max(len(c[i]) for c in body + [header]) for i in range(len(header))]
    widths[0] = max(len(c[0]) for c in body if c[1]) if body else widths[0]
    out = []
    for cells in [header] + body:
        if cells[1] == "" and cells is not header:
            out.append(cells[0])
            continue
        out.append("  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip())
    return "\n".join(out)


def summary(rows: list[Row]) -> list[str]:
    lines = []
    for r in rows:
        if r.section == "a" and r.label.startswith('backend="tsp"'):
            model = r.tokens.split(";")[0]
            lines.append(f"D = 1, {model}: {r.label} runs at {r.ratio:.2f}x Inductor")
    for r in rows:
        if r.section == "c" and r.label.startswith("communication hidden"):
            lines.append(
                f"D = {r.devices}: overlap hides {100 * r.ratio:.0f}% of the communication"
            )
        if r.section == "d" and r.label.startswith('backend="tsp"'):
            lines.append(
                f"D = {r.devices}: compile overhead {100 * (r.ratio - 1):+.0f}% ({r.note})"
            )
    return lines


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python bench/throughput.py",
        description="Step time of TSP against one process, TP+SP and TP; overlap; compile time.",
    )
    p.add_argument("--quick", action="store_true", help="tiny shapes and few steps (smoke run)")
    p.add_argument(
        "--inner", choices=("aot_eager", "inductor"), default=None,
        help="TSP's inner compiler in (b, c) and the baselines' compiler (default: tspc's)",
    )  # fmt: skip
    p.add_argument("--sections", default="abcd", help="which sections to run (abcd)")
    p.add_argument("--devices", type=int, nargs="+", default=None, help="D values for (b, c)")
    p.add_argument("--iters", type=int, default=None, help="timed steps per configuration")
    p.add_argument("--repeats", type=int, default=None, help="processes per model in (a)")
    p.add_argument("--device", default="cpu", help="device of section (a): cpu or cuda")
    p.add_argument("--json", type=Path, default=None, help="also write every timing here")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown too")
    return p


def plan_from_args(args: argparse.Namespace) -> Plan:
    from tspc.options import TSPOptions

    plan = QUICK if args.quick else FULL
    changes: dict[str, Any] = {"inner": args.inner or TSPOptions().inner, "device": args.device}
    changes["sections"] = tuple(s for s in "abcd" if s in args.sections)
    if args.devices:
        changes["devices"] = tuple(args.devices)
    if args.iters:
        changes["iters"] = args.iters
    if args.repeats:
        changes["a_repeats"] = args.repeats
    if args.device != "cpu":
        changes["sections"] = ("a",)  # the parallel sections run on gloo (CPU)
    return replace(plan, **changes)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    plan = plan_from_args(args)
    cmd = "python bench/throughput.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"$ {cmd.strip()}")
    print(f"model: {describe(plan.model)}; TSP inner compiler and baselines: {plan.inner}")
    print(f"{plan.warmup} warm-up + {plan.iters} timed steps per row (median of the slowest rank)")

    def progress(msg: str) -> None:
        print(msg, flush=True)

    started = time.perf_counter()
    rows: list[Row] = []
    raw: dict[str, Any] = {}
    for section, run in (("a", section_a), ("b", section_bc), ("d", section_d)):
        if section not in plan.sections and not (section == "b" and "c" in plan.sections):
            continue
        part, raw[section] = run(plan, progress)
        rows += [r for r in part if r.section in plan.sections]
    print()
    print(format_table(rows))
    print()
    for line in summary(rows):
        print(line)
    print(f"(total {time.perf_counter() - started:.0f} s)")
    if args.markdown:
        print()
        print(format_table(rows, markdown=True))
    if args.json:
        payload = {"plan": asdict(plan), "rows": [asdict(r) for r in rows], "raw": raw}
        args.json.write_text(json.dumps(payload, indent=1, default=str))
    return 0


if __name__ == "__main__":
    # Run the importable module's main, so that what is pickled for the spawned ranks refers to
    # ``bench.throughput`` rather than to this script's ``__main__``.
    from bench.throughput import main as _main

    sys.exit(_main())
