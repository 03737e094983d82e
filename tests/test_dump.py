"""`tspc dump` (graph-only, fake process group) and the dumps a real run writes.

The dump's numbers are checked against what the model *is* — its layer count, D, its sizes —
never against the dump's own arithmetic: per attention layer and direction D weight broadcasts
and 2g K/V gathers (g = K/V head groups), in backward D gradient reduces and 2g reduce-scatters;
per MLP D-1 ring hops forward and 2(D-1) backward; one all-reduce per replicated parameter; bytes
per layer equal to (D-1)/D * beta * (P_attn + P_mlp + 2 B S h_kv) with P from the config.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import shutil
import struct
import subprocess
import zlib
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.helpers import capture, count_collectives
from tspc.dump import DUMPS
from tspc.pipeline import AOT_GRAPH_PIPELINE, JOINT_PIPELINE, PIPELINE
from tspc.tools import cli
from tspc.tools.dump_cli import load_target

pytestmark = pytest.mark.slow  # whole-model compiles in this process: seconds each

REPO = Path(__file__).resolve().parents[1]
REF_TARGET = f"{REPO / 'samples' / 'reference_model.py'}:build_reference_model"
WORLD, LAYERS, SEQ, BATCH = 2, 2, 32, 2
# one file per pass: the captured graph, then the graph after each pass of the pipeline
PASS_FILES = ["00_captured.py"] + [f"{i:02d}_{p.name}.py" for i, p in enumerate(PIPELINE, 1)]


def phase_files(label: str, first: str, passes) -> list[str]:
    """The inner compiler's graph ``label`` before its phase, then after each of its passes."""
    return [f"{label}_00_{first}.py"] + [
        f"{label}_{i:02d}_{p.name}.py" for i, p in enumerate(passes, 1)
    ]


AOT_PASS_FILES = [
    *phase_files("joint", "traced", JOINT_PIPELINE),
    *phase_files("forward", "partitioned", AOT_GRAPH_PIPELINE),
    *phase_files("backward", "partitioned", AOT_GRAPH_PIPELINE),
]
ALL_FILES = {
    *PASS_FILES,
    *AOT_PASS_FILES,
    "forward.py",
    "backward.py",
    "collectives.txt",
    "schedule.txt",
    "report.json",
    "schedule.html",
    "summary.txt",
}


def run_cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = cli.main(["dump", *argv])
    return rc, out.getvalue(), err.getvalue()


def load_report(graph_dir: Path) -> dict:
    return json.loads((graph_dir / "report.json").read_text())


def nonzero(d: dict) -> dict:
    return {k: v for k, v in d.items() if v}


def expected_per_layer(world: int, kv_heads: int) -> dict:
    """Collectives one attention / one MLP layer must issue, per graph."""
    g = world if kv_heads % world == 0 else kv_heads  # K/V head groups gathered
    return {
        ("attention", "forward"): {"broadcast": world, "all_gather": 2 * g},
        ("attention", "backward"): {
            "broadcast": world,  # weights re-streamed, not saved
            "reduce": world,  # each shard's gradient to its owner
            "all_gather": 2 * g,  # K/V re-gathered
            "reduce_scatter": 2 * g,  # dK/dV back to the token owners
        },
        ("mlp", "forward"): {"ring": world - 1},
        ("mlp", "backward"): {"ring": 2 * (world - 1)},  # weights + gradient accumulators
    }


def paper_bytes(world: int, beta: int, h: int, heads: int, kv_heads: int, f: int) -> dict:
    h_kv = h * kv_heads // heads
    p_attn, p_mlp = 2 * h * h + 2 * h * h_kv, 3 * h * f
    fwd_attn = (world - 1) * beta * (p_attn + 2 * BATCH * SEQ * h_kv) // world
    fwd_mlp = (world - 1) * beta * p_mlp // world
    return {"attention": fwd_attn, "mlp": fwd_mlp}


def check_dump(
    rep: dict,
    layers: list[tuple[str, str]],
    world: int,
    kv_heads: int,
    replicated: set[str],
    paper: dict,
) -> None:
    """Everything a dump of an L-layer model on D ranks must say, from L, D and the config."""
    L = len(layers)
    assert rep["world_size"] == world and rep["level"] == "tsp"
    want = [{"kind": "attention", "module": a} for a, _ in layers]
    want += [{"kind": "mlp", "module": m} for _, m in layers]
    key = lambda e: (e["module"], e["kind"])  # noqa: E731
    assert sorted(rep["matched"], key=key) == sorted(want, key=key)
    assert rep["skipped"] == []
    assert rep["backward_compiled"]

    # per layer, per graph: exactly the schedule's collectives
    per_layer = expected_per_layer(world, kv_heads)
    for graph in ("forward", "backward"):
        by_layer = rep["collectives_by_layer"][graph]
        for attn, mlp in layers:
            assert by_layer[attn] == nonzero(per_layer[("attention", graph)]), (graph, attn)
            assert by_layer[mlp] == nonzero(per_layer[("mlp", graph)]), (graph, mlp)
        # one all-reduce per replicated parameter (its gradient), in backward only
        reduced = {t for t, kinds in by_layer.items() if "all_reduce" in kinds}
        assert reduced == (replicated if graph == "backward" else set()), graph

    # totals per kind: the layers' collectives, the output gather and the gradient all-reduces
    g = world if kv_heads % world == 0 else kv_heads
    assert rep["collectives"] == {
        "broadcast": 2 * world * L,
        "all_gather": 4 * g * L + 1,  # + the logits gather ("output")
        "ring": 3 * (world - 1) * L,
        "reduce": world * L,
        "reduce_scatter": 2 * g * L,
        "all_reduce": len(replicated),
    }
    assert rep["collectives_by_layer"]["forward"]["output"] == {"all_gather": 1}

    # bytes: schedule == paper formula == the rewrite's own prediction == measured (fake run)
    cb = rep["comm_bytes"]
    for attn, mlp in layers:
        for module, kind in ((attn, "attention"), (mlp, "mlp")):
            fwd = cb["forward"]["per_layer"][module]
            assert fwd == paper[kind] == cb["formula"]["per_layer"][module]["forward"], module
            assert fwd == cb["rewrite_prediction"][module], module
            bwd = cb["backward"]["per_layer"][module]
            assert bwd == 2 * paper[kind] == cb["formula"]["per_layer"][module]["backward"]
    assert cb["total"] == cb["forward"]["total"] + cb["backward"]["total"]
    assert cb["total"] == sum(cb["per_kind"].values()) == sum(cb["per_layer"].values())
    for graph in ("forward", "backward"):
        measured = rep["measured"][graph]
        assert measured["per_layer"] == nonzero(cb[graph]["per_layer"]), graph
        assert {k: v["recv_bytes"] for k, v in measured["per_kind"].items()} == nonzero(
            cb[graph]["per_kind"]
        ), graph
        assert {k: v["calls"] for k, v in measured["per_kind"].items()} == nonzero(
            rep["collectives_by_graph"][graph]
        ), graph


def check_against_graphs(rep: dict, dump) -> None:
    """The report's counts equal an independent count over the aot graphs it came from."""
    for graph, gms in (
        ("forward", dump.graphs.forward_gms),
        ("backward", dump.graphs.backward_gms),
    ):
        (gm,) = gms
        starts = Counter()
        for (op, _tag), n in count_collectives(gm).items():
            if op.endswith("_start"):
                starts[op.removesuffix("_start")] += n
        assert nonzero(rep["collectives_by_graph"][graph]) == dict(starts), graph


def check_files(graph_dir: Path) -> None:
    assert {p.name for p in graph_dir.iterdir()} == ALL_FILES
    for name in [*PASS_FILES, *AOT_PASS_FILES, "forward.py", "backward.py"]:
        source = (graph_dir / name).read_text()
        compile(source, name, "exec")  # readable Python, not a repr
        assert source.startswith("# tspc dump: graph"), name


def ref_replicated(layers: int) -> set[str]:
    norms = {
        f"layers.{i}.{n}.weight" for i in range(layers) for n in ("input_norm", "post_attn_norm")
    }
    return norms | {"embed.weight", "norm.weight", "lm_head.weight"}


# ---------------------------------------------------------------------- tspc dump, reference


@pytest.fixture(scope="module")
def ref_dump(tmp_path_factory):
    out = tmp_path_factory.mktemp("ref")
    rc, stdout, stderr = run_cli(
        REF_TARGET,
        "--world-size", str(WORLD),
        "--rank", "all",
        "--seq", str(SEQ),
        "--batch", str(BATCH),
        "--out", str(out),
        "--set", f"num_layers={LAYERS}",
    )  # fmt: skip
    return rc, out, stdout, stderr, DUMPS[-1]


def test_dump_reference_model_counts_and_bytes(ref_dump):
    rc, out, stdout, stderr, last = ref_dump
    assert rc == 0, stderr
    layers = [(f"layers.{i}.attn", f"layers.{i}.mlp") for i in range(LAYERS)]
    # RefConfig defaults: h=64, 4 heads, 2 KV heads, intermediate 160, fp32
    paper = paper_bytes(WORLD, 4, 64, 4, 2, 160)
    reports = {}
    for rank in range(WORLD):
        (graph_dir,) = (out / f"rank{rank}").iterdir()
        assert graph_dir.name == "graph0"  # each simulated rank numbers from 0, like a process
        check_files(graph_dir)
        reports[rank] = rep = load_report(graph_dir)
        assert rep["rank"] == rank and rep["process_group"] == "fake"
        assert (rep["seq_len"], rep["batch"]) == (SEQ, BATCH)
        check_dump(rep, layers, WORLD, 2, ref_replicated(LAYERS), paper)
    check_against_graphs(reports[WORLD - 1], last)
    # what differs between ranks is only who receives what, never which collectives run
    assert reports[0]["issue_order_digest"] == reports[1]["issue_order_digest"]
    texts = [(out / f"rank{r}" / "graph0" / "collectives.txt").read_text() for r in range(WORLD)]
    assert texts[0] == texts[1]
    assert "collective issue order identical on all 2 ranks" in stdout


def test_dump_prints_a_short_summary_and_logs_nothing_by_default(ref_dump):
    rc, out, stdout, stderr, _ = ref_dump
    assert "attention matched  layers.0.attn" in stdout
    assert "mlp       matched  layers.1.mlp" in stdout
    row = next(
        line.split() for line in stdout.splitlines() if line.strip().startswith("layers.0.attn")
    )
    # layer, forward schedule / formula / measured, backward schedule / formula / measured
    assert row == ["layers.0.attn", "32768", "32768", "32768", "65536", "65536", "65536"]
    assert f"wrote {out}/rank0/graph0/" in stdout
    assert len(stdout.splitlines()) < 40  # short
    assert stderr == ""  # the "tspc" logger is quiet unless configured (TORCH_LOGS=tspc)


# ---------------------------------------------------------------------- tspc dump, transformers


def test_dump_transformers_llama_config(tmp_path):
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=128,
    )  # written with use_cache=true, as a hub config.json is
    cfg.to_json_file(str(tmp_path / "config.json"))
    rc, stdout, stderr = run_cli(
        str(tmp_path / "config.json"),
        "--world-size", str(WORLD),
        "--rank", "1",
        "--seq", str(SEQ),
        "--batch", str(BATCH),
        "--out", str(tmp_path / "dump"),
    )  # fmt: skip
    assert rc == 0, stderr
    assert f"LlamaForCausalLM, {LAYERS} layers" in stdout
    graph_dir = tmp_path / "dump" / "rank1" / "graph0"
    check_files(graph_dir)
    rep = load_report(graph_dir)
    layers = [(f"model.layers.{i}.self_attn", f"model.layers.{i}.mlp") for i in range(LAYERS)]
    replicated = {f"model.layers.{i}.{n}.weight" for i in range(LAYERS) for n in ("input_layernorm", "post_attention_layernorm")}  # fmt: skip
    replicated |= {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    paper = paper_bytes(WORLD, 4, 64, 4, 2, 128)
    check_dump(rep, layers, WORLD, 2, replicated, paper)
    check_against_graphs(rep, DUMPS[-1])


def test_model_type_target_builds_a_small_training_shaped_model():
    t = load_target("llama", seq=48, batch=3, sets={"num_hidden_layers": 1})
    assert type(t.model).__name__ == "LlamaForCausalLM"
    assert t.model.config.num_hidden_layers == 1 and t.model.config.use_cache is False
    assert t.model.config._attn_implementation == "sdpa"
    (ids,) = t.args
    assert ids.shape == (3, 48) and int(ids.max()) < t.model.config.vocab_size


# ---------------------------------------------------------------------- skipped modules

PLAIN_MLP_MODEL = '''
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    """Attention (SDPA) and an MLP the ring cannot run (a cumsum over its intermediate dim),
    all in one module."""

    def __init__(self, h=32, heads=4):
        super().__init__()
        self.heads = heads
        self.q_proj, self.k_proj = nn.Linear(h, h, bias=False), nn.Linear(h, h, bias=False)
        self.v_proj, self.o_proj = nn.Linear(h, h, bias=False), nn.Linear(h, h, bias=False)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = (
            p(x).view(b, s, self.heads, -1).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(o.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(torch.cumsum(F.gelu(self.fc1(x)), -1))


def build_model_and_inputs(seq, batch):
    return nn.Sequential(Block()), torch.randn(batch, seq, 32)
'''


def test_dump_reports_skipped_modules_with_reasons(tmp_path):
    target = tmp_path / "plain_mlp.py"
    target.write_text(PLAIN_MLP_MODEL)
    rc, stdout, stderr = run_cli(
        str(target), "--world-size", "2", "--seq", str(SEQ), "--out", str(tmp_path / "d"),
        "--no-backward",
    )  # fmt: skip
    assert rc == 0, stderr
    rep = load_report(tmp_path / "d" / "rank0" / "graph0")
    assert rep["matched"] == [{"kind": "attention", "module": "0"}]
    (skip,) = rep["skipped"]
    assert skip["kind"] == "mlp" and skip["module"] == "0" and "cumsum" in skip["reason"]
    assert f"mlp       skipped  0: {skip['reason']}" in stdout
    # the backward graph is compiled with the forward (tspc/inner.py), but never ran
    assert rep["backward_compiled"] and "backward" not in rep["measured"]
    assert rep["collectives_by_layer"]["forward"]["0"] == {"broadcast": 2, "all_gather": 4}
    # P_attn counts q, k, v, o only: the unmatched MLP in the same module is not in it
    h = 32
    want = (2 - 1) * 4 * (4 * h * h + 2 * BATCH * SEQ * h) // 2
    assert rep["comm_bytes"]["forward"]["per_layer"]["0"] == want
    assert rep["comm_bytes"]["formula"]["per_layer"]["0"]["forward"] == want


@pytest.mark.parametrize(
    "argv, message",
    [
        (["lama", "--world-size", "2"], "did you mean llama"),
        (
            [f"{REPO / 'samples' / 'reference_model.py'}", "--world-size", "2"],
            "build_reference_model",
        ),
        ([REF_TARGET, "--world-size", "2", "--rank", "2"], "--rank must be 0..1"),
        ([REF_TARGET, "--world-size", "2", "--option", "dump_dir=x"], "set by tspc dump"),
        ([REF_TARGET, "--world-size", "2", "--option", "overlap=3"], "overlap must be True"),
    ],
)
def test_bad_targets_and_arguments_are_one_line_errors(argv, message):
    rc, stdout, stderr = run_cli(*argv)
    assert rc == 2 and message in stderr and stderr.startswith("tspc dump: error:")


# ---------------------------------------------------------------------- a real run's dump


def test_real_run_dump_is_written_at_compile_and_refreshed_after_first_calls(
    tmp_path, monkeypatch, fake_group
):
    """TSPC_DUMP_DIR: rank 3 of 4 writes DIR/rank3/graph<id>/ before its first step (a hang in it
    still leaves the schedule; the backward graph is compiled with the forward), then adds what
    the runtime measured in the forward and in the backward."""
    from samples.reference_model import build_reference_model
    from tspc.backend import tsp_backend

    monkeypatch.setenv("TSPC_DUMP_DIR", str(tmp_path))
    world, kv_heads = 4, 4
    model = build_reference_model(num_layers=1, num_kv_heads=kv_heads)
    ids = torch.randint(0, 256, (BATCH, SEQ))
    gm, inputs = capture(model, ids)
    fake_group(3, world)
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = records.append
    logger = logging.getLogger("tspc")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        compiled = tsp_backend(gm, inputs)  # what Dynamo calls; nothing has run yet
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)

    (graph_dir,) = (tmp_path / "rank3").iterdir()
    assert {p.name for p in graph_dir.iterdir()} == ALL_FILES
    rep = load_report(graph_dir)
    assert rep["measured"] is None and rep["backward_compiled"]
    assert rep["collectives_by_layer"]["forward"]["layers.0.attn"] == {
        "broadcast": 4,
        "all_gather": 8,
    }
    logged = "\n".join(r.getMessage() for r in records)
    assert "attention matched  layers.0.attn" in logged and f"dumped to {graph_dir}" in logged

    (logits,) = compiled(*inputs)
    rep = load_report(graph_dir)
    fwd = rep["comm_bytes"]["forward"]
    assert rep["measured"]["forward"]["per_layer"] == nonzero(fwd["per_layer"])
    assert rep["measured"]["forward"]["total"] == fwd["total"] > 0
    assert rep["measured"]["process_group"] == "fake"

    logits.float().sum().backward()
    assert (graph_dir / "backward.py").exists()
    rep = load_report(graph_dir)
    per_layer = expected_per_layer(world, kv_heads)
    assert (
        rep["collectives_by_layer"]["backward"]["layers.0.attn"]
        == per_layer[("attention", "backward")]
    )
    assert rep["collectives_by_layer"]["backward"]["layers.0.mlp"] == per_layer[("mlp", "backward")]
    bwd = rep["comm_bytes"]["backward"]
    assert rep["measured"]["backward"]["per_layer"] == nonzero(bwd["per_layer"])

    compiled(*inputs)  # later calls change nothing: the dump describes one step
    assert load_report(graph_dir)["measured"] == rep["measured"]


# ---------------------------------------------------------------------- the page in a browser


def _chromium() -> str | None:
    return (
        shutil.which("chromium")
        or shutil.which("chromium-browser")
        or shutil.which("google-chrome")
    )


def _headless(browser: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            browser,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--no-first-run",
            f"--user-data-dir={profile}",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def png_pixels(path: Path) -> tuple[int, int, Counter]:
    """Width, height and RGB histogram of an 8-bit RGB(A) PNG (no imaging library here)."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    pos, idat = 8, b""
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos : pos + 8])
        body = data[pos + 8 : pos + 8 + n]
        pos += 12 + n
        if kind == b"IHDR":
            w, h, depth, ctype, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and ctype in (2, 6) and interlace == 0
        elif kind == b"IDAT":
            idat += body
    bpp = 3 if ctype == 2 else 4
    raw, stride = zlib.decompress(idat), w * bpp
    prev, colours = bytearray(stride), Counter()
    for r in range(h):
        f = raw[r * (stride + 1)]
        cur = bytearray(raw[r * (stride + 1) + 1 : (r + 1) * (stride + 1)])
        if f == 1:  # Sub
            for i in range(bpp, stride):
                cur[i] = (cur[i] + cur[i - bpp]) & 255
        elif f == 2:  # Up
            cur = bytearray((x + b) & 255 for x, b in zip(cur, prev))
        elif f in (3, 4):  # Average, Paeth
            for i in range(stride):
                a = cur[i - bpp] if i >= bpp else 0
                b = prev[i]
                if f == 3:
                    cur[i] = (cur[i] + ((a + b) >> 1)) & 255
                    continue
                c = prev[i - bpp] if i >= bpp else 0
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                cur[i] = (cur[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        colours.update(zip(cur[0::bpp], cur[1::bpp], cur[2::bpp]))
        prev = cur
    return w, h, colours


def test_schedule_page_renders_in_a_headless_browser(ref_dump, tmp_path):
    browser = _chromium()
    if browser is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium): page not checked")
    _, out, _, _, _ = ref_dump
    page = out / "rank0" / "graph0" / "schedule.html"
    html = page.read_text()
    assert (
        "<script src" not in html
        and "<link" not in html
        and "http://" not in html.replace('xmlns="http://www.w3.org/2000/svg"', "")
    )  # self-contained: nothing to fetch
    rep = load_report(page.parent)
    graphs = list(rep["collectives_by_graph"])
    layers = [m["module"] for m in rep["matched"]]

    dom = _headless(browser, tmp_path / "profile", "--dump-dom", page.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    # written by the page's script after layout: a browser parsed, laid out and ran it
    assert f'data-tspc-charts="{len(graphs) + len(graphs) * len(layers)}"' in dom.stdout
    transfers = html.count('class="transfer"')
    assert f'data-tspc-transfers="{transfers}"' in dom.stdout
    width = int(dom.stdout.split('data-tspc-rendered-width="')[1].split('"')[0])
    assert width > 500
    assert dom.stdout.count("<svg") == html.count("<svg") > 0

    shot = tmp_path / "page.png"
    run = _headless(
        browser,
        tmp_path / "profile",
        "--window-size=1200,1400",
        f"--screenshot={shot}",
        page.as_uri(),
    )
    assert run.returncode == 0 and shot.exists(), run.stderr[-2000:]
    w, h, colours = png_pixels(shot)
    assert (w, h) == (1200, 1400)
    assert len(colours) > 50  # text, tables and chart, not a blank page
    assert colours[(0xF4, 0xF4, 0xF4)] > 5000  # the chart rows' background (used nowhere else)
    broadcast, all_gather = (0x4E, 0x79, 0xA7), (0xF2, 0x8E, 0x2B)
    assert colours[broadcast] > 500 and colours[all_gather] > 200  # the bars (and legend)
