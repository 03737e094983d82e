"""The peer zoo: models from torchtitan, torchtune and einsum-written code (issue 26).

Each model of ``tests/peer_models.py`` (small configs, random weights, the libraries' own model
code) is compiled with ``backend="tsp"`` and trained one step at an even and an odd length
(16 and 13: tspc pads the odd one internally) against the same model run eagerly in one
process: logits and every parameter's gradient must be equal (relative error < 1e-5). Each
compile is judged like the transformers zoo (``tests/test_zoo.py``'s ``judge``): level 'tsp'
with no fallback, bytes received = the schedules' prediction, and every layer's attention and
MLP in the state ``EXPECTED`` gives — matched, skipped with the reason it names, or (a gap the
census of every attention and MLP is to close) not listed at all.

The table is today's; better is accepted: a kind the table says skipped or unlisted that is now
matched in every layer is then held to everything a match is held to, and the test prints the
table entry to update. Worse (a match lost, another skip reason, an entry gone) fails.

The libraries are a test extra (``requirements-peers.txt``, installed into ``.peers/``): without
it the test skips and says how to install it. One spawn per world size runs every model: D = 2
in the suite, D = 4 in the extended tier.
"""

from __future__ import annotations

import copy
import time
import traceback

import pytest
import torch

from tests.helpers import D4_EXTENDED, grad_err_vs
from tests.peer_models import PEER_MODELS, PEERS, build, with_peers
from tests.test_zoo import judge
from tspc.launch import spawn

LENGTHS = (16, 13)
UNLISTED = "not listed"  # a kind the report has no entry for (the census's gap)

# model -> {kind: "matched" | UNLISTED | a substring of the skip reason}, today; or
# {"raises": a substring of the error} for a model tspc still crashes on (a bug to fix)
# At D = 4 torchtitan's fused wqkv (2 KV heads, laid out per KV group) has fewer groups than
# ranks: no cut of its rows gives every rank whole groups, so the attention is skipped there
_TITAN = {
    "attention": {2: "matched", 4: "in a layout no grouping of its rows cuts per rank"},
    "mlp": "matched",
}
EXPECTED: dict[str, dict[str, str | dict[int, str]]] = {
    "torchtitan llama3": _TITAN,
    "torchtitan qwen3": _TITAN,
    "torchtune llama3": {"attention": "matched", "mlp": "matched"},
    "torchtune qwen2": {"attention": "matched", "mlp": "matched"},
    "torchtune gemma": {"attention": "matched", "mlp": "matched"},
    "torchtune gemma mqa": {"attention": "matched", "mlp": "matched"},
    # the einsum attention (fused [3, h, e, d] q/k/v einsum, two contracted indices out) is
    # skipped with its reason; the GLU MLPs are matched
    "litgpt llama": {"attention": "matched", "mlp": "matched"},
    "litgpt pythia": {"attention": "matched", "mlp": "matched"},
    "x-transformers glu": {"attention": "matched", "mlp": "matched"},
    # einops' repeat 'b h n d -> b (r h) n d' tiles the KV heads (query head i reads KV head
    # i mod n): no contiguous head group holds its own keys; skipped with that reason (it
    # ran with wrong keys before the check in passes/head_plan.py)
    "x-transformers gqa": {
        # at D = 4 its 2 KV heads, repeated inside the region, do not divide among 4 ranks
        "attention": {
            2: "does not keep a group's heads together",
            4: "key/value heads repeated to 4 before the attention's head-local ops",
        },
        "mlp": "matched",
    },
    "x-transformers mqa": {"attention": "matched", "mlp": "matched"},
    "einsum decoder": {
        "attention": "the schedules shard projections by 2-D weights",
        "mlp": "matched",
    },
}


def _layers(world: int) -> int:
    """Decoder layers per model: one at D = 2 (the suite; every peer model's layers are all
    of one kind, and a layer's boundary to the next is proven by the transformers models' and
    the reference model's two-layer runs), two at D = 4 (the extended tier)."""
    return 1 if world == 2 else 2


def _model_rows(name: str, layers: int) -> list[dict]:
    import tspc
    from tspc.runtime.counters import COUNTER

    torch.compiler.reset()
    t0 = time.perf_counter()
    ref = build(name, layers=layers)
    model = copy.deepcopy(ref)
    compiled = torch.compile(model, backend="tsp", options={"inner": "aot_eager"})
    gen = torch.Generator().manual_seed(3)
    rows = []
    for seq in LENGTHS:
        ids = torch.randint(0, 128, (2, seq), generator=gen)
        probe = torch.randn(2, seq, 128, generator=gen)
        for p in list(ref.parameters()) + list(model.parameters()):
            p.grad = None
        COUNTER.reset()
        got = compiled(ids)
        by_tag = COUNTER.snapshot()["by_tag"]  # the forward's transfers
        expected = ref(ids)
        (got * probe).sum().backward()
        (expected * probe).sum().backward()
        rep = tspc.last_report()
        rows.append(
            {
                "case": (name, seq),
                "err": ((got - expected).abs().max() / expected.abs().max()).item(),
                "grad_err": grad_err_vs(ref, model),
                "level": rep.level,
                "fallbacks": list(rep.fallbacks),
                "entries": [(e.kind, e.module, e.status, e.reason) for e in rep.entries],
                "layers": layers,
                "measured": {
                    tag: sum(k["recv_bytes"] for k in by_tag.get(tag, {}).values())
                    for tag in rep.predicted_recv_bytes
                },
                "predicted": dict(rep.predicted_recv_bytes),
            }
        )
    rows[-1]["seconds"] = time.perf_counter() - t0
    return rows


def peer_zoo_worker(rank: int, world: int) -> list[dict]:
    import logging
    import warnings

    with_peers()
    warnings.filterwarnings("ignore")
    logging.getLogger("torchao").setLevel(logging.ERROR)
    out = []
    for name in PEER_MODELS:
        try:
            out += _model_rows(name, _layers(world))
        except Exception:  # noqa: BLE001 - one model's failure is reported, the rest still run
            out.append({"case": (name, None), "error": traceback.format_exc()[-3000:]})
    return out


def problems(r: dict, world: int = 2) -> tuple[list[str], list[str]]:
    """(what is wrong with the row, table entries to update because the row is better). A
    table state may depend on D: ``{world: state}``."""
    name = r["case"][0]
    table = {k: v[world] if isinstance(v, dict) else v for k, v in EXPECTED[name].items()}
    if "error" in r:
        if "raises" in table and table["raises"] in r["error"]:
            return [], []
        return [f"raised: {r['error']}"], []
    gaps, unlisted, stale = {}, [], []
    if "raises" in table:  # runs now: any listed state passes until the table says which
        stale.append(f"EXPECTED[{name!r}]: no longer raises; {r['entries']}")
        table = {"attention": UNLISTED, "mlp": UNLISTED}
    for kind, state in table.items():
        statuses = {e[2] for e in r["entries"] if e[0] == kind}
        if state != "matched" and statuses == {"matched"}:
            stale.append(f"EXPECTED[{name!r}][{kind!r}] = 'matched' (was {state!r})")
        elif state == UNLISTED:
            unlisted.append(kind)
            skipped = [e for e in r["entries"] if e[0] == kind and e[2] == "skipped"]
            if skipped:  # listed now: a reason is all that is asked until the table says which
                gaps[kind] = ""
                stale.append(f"EXPECTED[{name!r}][{kind!r}]: listed now, {skipped[0][3]!r}")
        elif state != "matched":
            gaps[kind] = state
    bad = judge(r, gaps, tuple(unlisted))
    if r["grad_err"] >= 1e-5:
        bad.append(f"gradients differ from one process: {r['grad_err']:.2e}")
    return bad, stale


def _installed() -> bool:
    import os

    return os.path.isdir(os.path.join(PEERS, "torchtitan")) and os.path.isdir(
        os.path.join(PEERS, "torchtune")
    )


@pytest.mark.slow
@pytest.mark.skipif(
    not _installed(),
    reason="the peer libraries are not installed: pip install --no-deps --target .peers "
    "-r requirements-peers.txt (docs/models.md)",
)
@pytest.mark.parametrize("world", [2, D4_EXTENDED])
def test_peer_zoo_equals_one_process_forward_and_backward(world):
    rows = spawn(peer_zoo_worker, world, timeout=1200, env={"TSPC_COMM_TIMEOUT": "120"})
    found, stale = {}, set()
    for per_rank in rows:
        for r in per_rank:
            bad, better = problems(r, world)
            stale |= set(better)
            if bad:
                found.setdefault(r["case"], bad)
    for r in rows[0]:
        print(r["case"], r.get("level"), f"{r.get('seconds', 0):.1f}s", r.get("entries"))
    if stale:
        print("peer zoo better than its table; update EXPECTED:\n  " + "\n  ".join(sorted(stale)))
    assert not found, "\n".join(f"{c}: {p}" for c, p in found.items())
