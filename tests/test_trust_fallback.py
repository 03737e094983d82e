"""Failures stay local (docs/guarantees.md, "Failures stay local").

* A module whose rewrite raises is left out alone, transactionally: the graph equals the one
  where that module is simply not rewritten, even when the rewrite raised after changing the
  graph, and no layout of its weights reaches the shard store; the rest of the graph runs TSP.
  A module whose *matching* raises is skipped the same way.
* Anything else tspc raises while compiling a graph, before a weight is released, falls back to
  a plain compile of Dynamo's graph with a ``FallbackWarning``; ``strict`` raises instead.
* A partitioner failure on a value tspc tagged is tspc's ``PartitionerTagError`` naming the node,
  the pass and the option, without torch's "bug in PyTorch" text.
* The two models of the issue: transformers' Mamba (aot_autograd used to fail with "tensor may
  have escaped from inside a function being vmapped": tspc's dead-code elimination dropped the
  vmap level changes) and BART in training at D = 2 (the partitioner used to fail on
  ``getitem: must recompute``: tspc tagged a getitem of ``native_layer_norm``). Both train under
  TSP now, against one process; with each old bug put back (monkeypatched) they train through the
  fallback, with the warning, against one process too.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from samples.reference_model import build_reference_model
from tests.helpers import (
    adamw_side_by_side,
    capture,
    count_collectives,
    grad_err_vs,
    grad_error,
)
from tspc.errors import FallbackWarning
from tspc.launch import spawn

TARGET = {"attention": "layers.1.attn", "mlp": "layers.0.mlp"}


def _reference_graph():
    model = build_reference_model(num_layers=2)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    gm, inputs = capture(model, ids)
    return model, gm, inputs


def _run(gm, inputs, group, **options):
    from tspc.options import TSPOptions
    from tspc.pipeline import run_pipeline
    from tspc.runtime.shard_store import ShardStore

    store = ShardStore()
    opts = TSPOptions.from_dict({"inner": "aot_eager", **options})
    return run_pipeline(gm, inputs, group, opts, "tsp", 0, store), store


def _broadcast_modules(gm) -> set[str]:
    return {tag for (op, tag) in count_collectives(gm) if op == "broadcast_start"}


@pytest.mark.parametrize("kind", ["attention", "mlp"])
def test_a_rewrite_that_raises_half_way_leaves_its_module_alone(fake_group, monkeypatch, kind):
    """The injected rewrite runs the real one (the graph is changed, the weights' layouts are
    declared) and then raises. The result must equal the graph where that module is skipped
    without being touched, the store must hold no layout of its weights, and the report must
    give the exception as the reason while every other module is matched."""
    import tspc.pipeline
    from tspc.passes.match_attention import Skip

    group = fake_group(0, 2)
    model, gm, inputs = _reference_graph()
    name = f"rewrite_{kind}"
    real = getattr(tspc.pipeline, name)

    # The reference: the module left as it is where the schedules do not rewrite it, by the
    # code paths that existed before isolation (an attention rewrite's own Skip; an MLP match
    # dropped before the rewrites).
    if kind == "attention":

        def skip_target(gm, info, m, grp, shards):
            if m.module == TARGET[kind]:
                return Skip(kind, m.module, "left out for the reference")
            return real(gm, info, m, grp, shards)

        monkeypatch.setattr(tspc.pipeline, name, skip_target)
    else:
        match_mlp = tspc.pipeline.match_mlp

        def without_target(*args, **kwargs):
            matches, skips = match_mlp(*args, **kwargs)
            return [m for m in matches if m.module != TARGET[kind]], skips

        monkeypatch.setattr(tspc.pipeline, "match_mlp", without_target)
    expected, _ = _run(gm, inputs, group)
    monkeypatch.undo()

    def half_then_raise(gm, info, m, grp, shards, *chains):  # the MLP's: its chains' owner
        out = real(gm, info, m, grp, shards, *chains)
        if m.module == TARGET[kind]:
            raise RuntimeError(f"injected after rewriting {m.module}")
        return out

    monkeypatch.setattr(tspc.pipeline, name, half_then_raise)
    with pytest.warns(FallbackWarning, match=rf"{TARGET[kind]}.*RuntimeError: injected"):
        res, store = _run(gm, inputs, group)

    assert res.gm.code == expected.gm.code
    entries = {(e.kind, e.module): e for e in res.report.entries}
    bad = entries[(kind, TARGET[kind])]
    assert bad.status == "skipped"
    assert bad.reason == f"rewrite failed: RuntimeError: injected after rewriting {TARGET[kind]}"
    others = [e for key, e in entries.items() if key != (kind, TARGET[kind])]
    assert len(others) == 3 and all(e.status == "matched" for e in others), res.report.summary()
    broadcasts = _broadcast_modules(res.gm)  # attention: one per head group; mlp: none
    if kind == "attention":
        assert broadcasts == {"layers.0.attn"}, broadcasts
        owner = model.layers[1].attn
        held = [owner.q_proj.weight, owner.k_proj.weight, owner.v_proj.weight, owner.o_proj.weight]
        kept = model.layers[0].attn.q_proj.weight
    else:
        assert broadcasts == {"layers.0.attn", "layers.1.attn"}, broadcasts
        owner = model.layers[0].mlp
        held = [owner.gate_proj.weight, owner.up_proj.weight, owner.down_proj.weight]
        kept = model.layers[1].mlp.gate_proj.weight
    assert all(store.get(p) is None for p in held)  # declared by the failed attempt, dropped
    assert store.get(kept) is not None


def test_a_match_that_raises_skips_only_that_attention(fake_group, monkeypatch):
    import tspc.passes.match_attention as ma

    group = fake_group(0, 2)
    _, gm, inputs = _reference_graph()
    real = ma._match_one

    def broken(sdpa, a, params, module, world):
        if module == TARGET["attention"]:
            raise KeyError("injected in matching")
        return real(sdpa, a, params, module, world)

    monkeypatch.setattr(ma, "_match_one", broken)
    with pytest.warns(FallbackWarning, match=r"layers\.1\.attn.*KeyError"):
        res, _ = _run(gm, inputs, group)
    status = {(e.kind, e.module): (e.status, e.reason) for e in res.report.entries}
    assert status[("attention", "layers.1.attn")] == (
        "skipped",
        "match failed: KeyError: 'injected in matching'",
    )
    assert status[("attention", "layers.0.attn")][0] == "matched"
    assert _broadcast_modules(res.gm) == {"layers.0.attn"}


def test_strict_raises_where_the_default_falls_back(fake_group, monkeypatch):
    """A rewrite that raises, and an inner compiler that raises: under ``strict`` each is an
    error naming the cause; without, the module is skipped (rewrite) or a plain compile runs the
    graph (inner) with the numbers and gradients of the model run eagerly, and the report says
    level 'fallback' with the cause."""
    import tspc
    import tspc.backend
    import tspc.pipeline

    fake_group(0, 2)
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    real = tspc.pipeline.rewrite_attention

    def broken_rewrite(gm, info, m, grp, shards):
        if m.module == TARGET["attention"]:
            raise RuntimeError("injected rewrite failure")
        return real(gm, info, m, grp, shards)

    monkeypatch.setattr(tspc.pipeline, "rewrite_attention", broken_rewrite)
    strict = {"strict": True, "inner": "aot_eager"}
    model = build_reference_model(num_layers=2)
    with pytest.raises(Exception, match=r"strict.*layers\.1\.attn.*injected rewrite") as e:
        torch.compile(model, backend="tsp", options=strict)(ids)
    assert "TSPCompileError" in repr(e.value) or "TSPCompileError" in str(e.value)
    monkeypatch.setattr(tspc.pipeline, "rewrite_attention", real)

    def broken_inner(*args, **kwargs):
        raise RuntimeError("injected inner compiler failure")

    monkeypatch.setattr(tspc.backend, "compile_inner", broken_inner)
    torch.compiler.reset()
    with pytest.raises(Exception, match=r"strict.*injected inner compiler failure"):
        torch.compile(build_reference_model(num_layers=2), backend="tsp", options=strict)(ids)

    torch.compiler.reset()
    ref, model = build_reference_model(num_layers=2), build_reference_model(num_layers=2)
    compiled = torch.compile(model, backend="tsp", options={"inner": "aot_eager"})
    with pytest.warns(FallbackWarning, match=r"injected inner compiler failure.*plain torch"):
        out = compiled(ids)
    want = ref(ids)
    torch.testing.assert_close(out, want, rtol=1e-6, atol=1e-6)
    out.float().square().mean().backward()
    want.float().square().mean().backward()
    err, _ = grad_error(ref, model)
    assert err < 1e-6, err
    rep = tspc.last_report()
    assert rep.level == "fallback", rep.summary()
    assert "injected inner compiler failure" in rep.fallbacks[0], rep.fallbacks


def test_a_later_tsp_graph_does_not_release_what_a_fallback_graph_reads(fake_group, monkeypatch):
    """Static shapes at D = 2: the first length's compile raises (a plain graph reads the
    weights whole), the second length compiles under TSP and would release the weights it
    shards at its first call; the first length must still run, equal to eager (it read freed
    storage before: "setStorage ... out of bounds for storage of size 0")."""
    import tspc
    import tspc.backend

    fake_group(0, 2)
    real, calls = tspc.backend.compile_inner, []

    def first_fails(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected: the first compile fails")
        return real(*args, **kwargs)

    monkeypatch.setattr(tspc.backend, "compile_inner", first_fails)
    ref, model = build_reference_model(num_layers=1), build_reference_model(num_layers=1)
    compiled = torch.compile(model, backend="tsp", dynamic=False, options={"inner": "aot_eager"})
    short, long = (torch.randint(0, 256, (2, n)) for n in (16, 32))
    with pytest.warns(FallbackWarning, match="injected"):
        torch.testing.assert_close(compiled(short), ref(short), rtol=1e-6, atol=1e-6)
    compiled(long)  # TSP (with the fake group's transfers): only that it runs
    rep = tspc.last_report()
    assert rep.level == "tsp" and any("fell back to a plain compile" in n for n in rep.notes)
    torch.testing.assert_close(compiled(short), ref(short), rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_symbolic_sizes_fall_back_per_shape_and_warn_once_per_graph(monkeypatch):
    """No process group (D = 1). The inner compiler raises on every graph: Dynamo's static
    trace falls back (one warning); the second length makes Dynamo trace with a symbolic length,
    which tspc compiles per shape at its first call: that falls back (one more warning, a new
    graph) and a third length runs a plain compile at once, with no further warning. Every
    output equals the model run eagerly."""
    import tspc
    import tspc.backend

    def broken_inner(*args, **kwargs):
        raise RuntimeError("injected inner compiler failure")

    monkeypatch.setattr(tspc.backend, "compile_inner", broken_inner)
    model = build_reference_model(num_layers=1)
    compiled = torch.compile(model, backend="tsp", options={"inner": "aot_eager"})
    levels = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", FallbackWarning)
        for n in (16, 24, 40):
            ids = torch.randint(0, 256, (2, n), generator=torch.Generator().manual_seed(n))
            torch.testing.assert_close(compiled(ids), model(ids), rtol=1e-6, atol=1e-6)
            levels.append(tspc.last_report().level)
    texts = [str(w.message) for w in caught if issubclass(w.category, FallbackWarning)]
    assert len(texts) == 2 and all("injected inner compiler failure" in t for t in texts), texts
    assert levels == ["fallback"] * 3, levels


@pytest.mark.slow
def test_a_partitioner_failure_on_a_tspc_tag_is_a_tspc_error(monkeypatch, tmp_path):
    """The joint-graph tagging pass, made to tag a getitem of ``native_layer_norm``
    MUST_RECOMPUTE (what tspc did to BART's encoder output before the fix), makes the
    partitioner fail: under ``strict`` that is a ``PartitionerTagError`` naming the node, the
    pass and the option, without torch's pointer to its own tracker; without ``strict`` the plain
    compile runs the model, equal to eager."""
    import tspc.graph_phases
    from tspc.errors import PartitionerTagError
    from tspc.passes import aot_graphs

    monkeypatch.chdir(tmp_path)  # torch writes min_cut_failed_graph.txt where it runs
    real = tspc.graph_phases.mark_transfers_for_recompute

    def tag_the_norm_output(graph):
        for n in graph.nodes:
            src = n.args[0] if n.args else None
            norm = torch.ops.aten.native_layer_norm.default
            if n.target is aot_graphs.operator.getitem and getattr(src, "target", None) is norm:
                aot_graphs._mark(n)
        return real(graph)

    monkeypatch.setattr(tspc.graph_phases, "mark_transfers_for_recompute", tag_the_norm_output)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.LayerNorm(16), torch.nn.Linear(16, 16))
    x = torch.randn(2, 8, 16)
    strict = torch.compile(model, backend="tsp", options={"inner": "aot_eager", "strict": True})
    with pytest.raises(Exception) as caught:
        strict(x)
    err = caught.value
    while err is not None and not isinstance(err, PartitionerTagError):
        err = err.__cause__ or err.__context__
    assert isinstance(err, PartitionerTagError), repr(caught.value)
    msg = str(err)
    assert "mark_transfers_for_recompute" in msg and "'getitem'" in msg, msg
    assert "options={'schedules': 'none'}" in msg and "must recompute" in msg, msg
    assert "bug in PyTorch" not in msg and "file an issue" not in msg, msg

    torch.compiler.reset()
    compiled = torch.compile(model, backend="tsp", options={"inner": "aot_eager"})
    with pytest.warns(FallbackWarning, match=r"PartitionerTagError.*getitem"):
        out = compiled(x)
    torch.testing.assert_close(out, model(x), rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- Mamba and BART


def _mamba():
    from transformers import MambaConfig, MambaForCausalLM

    cfg = MambaConfig(vocab_size=128, hidden_size=64, state_size=8, num_hidden_layers=1,
                      intermediate_size=128, use_cache=False, pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    return MambaForCausalLM(cfg).train()


def _bart():
    from transformers import BartConfig, BartForConditionalGeneration

    cfg = BartConfig(vocab_size=128, d_model=64, encoder_layers=1, decoder_layers=1,
                     encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                     decoder_ffn_dim=128, max_position_embeddings=64, dropout=0.0,
                     attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1,
                     bos_token_id=0, eos_token_id=2, decoder_start_token_id=2,
                     use_cache=False)  # fmt: skip
    torch.manual_seed(0)
    return BartForConditionalGeneration(cfg).train()


def _old_bug(family: str):
    """The bug each model hit, to put back: Mamba's vmap level changes dropped by dead-code
    elimination; BART's getitem of a multi-output op tagged MUST_RECOMPUTE."""
    import tspc.passes.aot_graphs as aot_graphs
    import tspc.passes.graph_utils as graph_utils

    if family == "mamba":
        return graph_utils, "_interpreter_state_functions", frozenset
    return aot_graphs, "_free_to_recompute", aot_graphs.is_view_or_pack


def _train(family: str, old_bug: bool) -> dict:
    """Loss, gradients and three AdamW steps of the compiled model against the same model run
    eagerly in this process; with ``old_bug``, the model's old failure is put back first."""
    import os
    import tempfile

    from torch.distributed.tensor import DTensor

    import tspc

    torch.compiler.reset()
    build = _mamba if family == "mamba" else _bart
    ref, model = build(), build()
    gen = torch.Generator().manual_seed(3)
    n = 8 if family == "mamba" else 16  # Mamba's scan unrolls log2(n) levels; BART splits 2D
    ids = torch.randint(3, 128, (2, n), generator=gen)
    labels = torch.randint(3, 128, (2, n), generator=gen)
    compiled = torch.compile(model, backend="tsp", options={"inner": "aot_eager"})
    where, name, old = _old_bug(family)
    fixed, cwd = getattr(where, name), os.getcwd()
    if old_bug:
        setattr(where, name, old)
    try:
        with tempfile.TemporaryDirectory() as scratch, warnings.catch_warnings(record=True) as w:
            os.chdir(scratch)  # where torch writes min_cut_failed_graph.txt
            warnings.simplefilter("always", FallbackWarning)
            loss = compiled(input_ids=ids, labels=labels).loss
    finally:  # a pooled worker serves the next test
        setattr(where, name, fixed)
        os.chdir(cwd)
    ref_loss = ref(input_ids=ids, labels=labels).loss
    loss.backward()
    ref_loss.backward()
    grad_err = grad_err_vs(ref, model)
    rep = tspc.last_report()
    adamw_side_by_side(
        list(ref.parameters()),
        list(model.parameters()),
        lambda: ref(input_ids=ids, labels=labels).loss,
        lambda: compiled(input_ids=ids, labels=labels).loss,
    )
    step_err = max(
        ((p.full_tensor() if isinstance(p, DTensor) else p) - p_ref).abs().max().item()
        for p_ref, p in zip(ref.parameters(), model.parameters())
    )
    return {
        "family": family,
        "old_bug": old_bug,
        "loss_err": abs(loss.item() - ref_loss.item()),
        "grad_err": grad_err,
        "step_err": step_err,
        "level": rep.level,
        "fallbacks": rep.fallbacks,
        "matched": [e.module for e in rep.matched],
        "warnings": [str(m.message) for m in w if issubclass(m.category, FallbackWarning)],
    }


def _check(r: dict, world: int) -> None:
    assert r["loss_err"] < 1e-5 and r["grad_err"] < 1e-5 and r["step_err"] < 1e-5, r
    if not r["old_bug"]:
        assert r["level"] == "tsp" and not r["warnings"], r
        if r["family"] == "bart" and world > 1:  # the encoder's attention and both MLPs
            assert len(r["matched"]) == 3, r
        return
    assert r["level"] == "fallback" and len(r["warnings"]) == 1, r
    (warning,) = r["warnings"]
    assert "plain torch.compile with backend='aot_eager'" in warning, r
    if r["family"] == "mamba":
        cause = "escaped from inside a function being vmapped"
        assert cause in r["fallbacks"][0] and cause in warning, r
    else:  # the partitioner's failure is tspc's error, not "a bug in PyTorch"
        cause = "PartitionerTagError: tspc: aot_autograd's partitioner could not honour the tag"
        assert cause in r["fallbacks"][0] and cause in warning, r
        assert "mark_transfers_for_recompute" in warning and "'getitem_" in warning, r
        assert "bug in PyTorch" not in warning, r


CASES = {
    # BART's old bug needs a sequence gather, which D = 1 has not
    1: [("mamba", False), ("mamba", True), ("bart", False)],
    2: [("mamba", False), ("mamba", True), ("bart", False), ("bart", True)],
}


def models_worker(rank: int, world: int) -> list[dict]:
    return [_train(family, old_bug) for family, old_bug in CASES[world]]


@pytest.mark.slow
def test_mamba_and_bart_train_under_tsp_and_through_the_fallback_with_no_process_group():
    import torch.distributed as dist

    assert not dist.is_initialized()
    for r in models_worker(0, 1):
        _check(r, 1)


@pytest.mark.slow
def test_mamba_and_bart_train_under_tsp_and_through_the_fallback_at_d2():
    for per_rank in spawn(models_worker, 2, timeout=1500):
        for r in per_rank:
            _check(r, 2)
