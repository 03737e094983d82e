"""Any sequence length: a length that does not split into 2D zigzag chunks is padded inside.

tspc pads the sequence to the next multiple of 2D (the padding at its end), never attends to
the padding, counts it in no sum or loss and drops it from the outputs — so outputs and
gradients equal the same model in one process, for lengths 2D·k ± 1, lengths shorter than 2D
and batch 1, with the loss inside the graph or outside. Also here: Mistral's default config
(a sliding window wider than the sequence), which must run the TSP schedules.

Graph-only and kernel checks run in this process; the rest are real gloo runs at D = 2 and 4,
several cases per spawn (starting processes and importing torch is most of a small run's time).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import D4_EXTENDED, HF_SMALL, grad_error, zigzag_against_dense
from tspc.launch import spawn
from tspc.runtime.zigzag import (
    drop_padding,
    fill_padding,
    local_valid,
    padded_length,
    zigzag_indices,
    zigzag_slice,
    zigzag_unshard,
)

# --------------------------------------------------------------------------- layout helpers


@pytest.mark.parametrize("n,world,padded", [(16, 2, 16), (13, 2, 16), (3, 4, 8), (1, 2, 4)])
def test_padded_length_is_the_next_multiple_of_2d(n, world, padded):
    assert padded_length(n, world) == padded


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("n", [3, 7, 9, 13])
def test_padded_slices_gather_back_to_the_sequence(world, n):
    """Every rank's padded zigzag part, gathered and cut to the true length, is the sequence;
    the padding tokens are copies of the last one, and ``local_valid`` tells them apart."""
    x = torch.arange(2 * n * 3).view(2, n, 3)
    p = padded_length(n, world)
    parts = [zigzag_slice(x, 1, r, world, padded=p) for r in range(world)]
    assert all(part.shape[1] == p // world for part in parts)
    full = zigzag_unshard(torch.stack(parts), 1, world)
    assert torch.equal(drop_padding(full, 1, 1, 1, n), x)
    for r, part in enumerate(parts):
        valid = local_valid(n, r, world)
        positions = zigzag_indices(p, r, world)
        assert torch.equal(valid, positions < n)
        assert torch.equal(part[:, valid], x[:, positions[valid]])
        assert (part[:, ~valid] == x[:, -1:]).all()
        filled = fill_padding(part, 1, 1, 1, n, r, world, -100)
        assert (filled[:, ~valid] == -100).all() and torch.equal(filled[:, valid], part[:, valid])


def test_padding_of_a_merged_batch_and_sequence_dimension():
    """``[B * S]`` (outer = B): each sequence of the batch is padded on its own."""
    n, world, b = 5, 2, 3
    x = torch.arange(b * n)
    p = padded_length(n, world)
    parts = [zigzag_slice(x, 0, r, world, outer=b, padded=p) for r in range(world)]
    full = zigzag_unshard(torch.stack(parts), 0, world, outer=b)
    assert torch.equal(drop_padding(full, 0, b, 1, n), x)
    total = sum(fill_padding(part, 0, b, 1, n, r, world).sum() for r, part in enumerate(parts))
    assert total == x.sum()


# --------------------------------------------------------------------------- the kernel


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("n", [3, 9, 15])
@pytest.mark.parametrize("key_padding", [False, True])
def test_zigzag_kernel_with_padded_queries_matches_dense_causal(world, n, key_padding):
    """Queries padded to P, keys of the true length (n shorter than 2D, or 2D·k ± 1)."""
    zigzag_against_dense(world, n, 2, key_padding)


# --------------------------------------------------------------------------- graph only


@pytest.mark.parametrize("seq", [3, 6, 12, 17, 16])
def test_any_length_compiles_to_tsp_and_the_report_says_padded(seq, fake_group):
    """D = 4 (2D = 8): 3 (shorter than 2D, odd), 6 and 12 (even, not multiples) and 17 compile
    to the TSP schedules (they used to be refused) and the report names the padding; 16 is not
    padded and the report says nothing of it."""
    import tspc
    from samples.reference_model import build_reference_model

    fake_group(0, 4)
    model = build_reference_model(num_layers=1)
    torch.compile(model, backend="tsp", options={"strict": True})(torch.randint(0, 256, (1, seq)))
    rep = tspc.last_report()
    assert rep.level == "tsp" and len(rep.matched) == 2, rep.summary()
    pad = padded_length(seq, 4) - seq
    notes = [n for n in rep.notes if "padded" in n]
    if not pad:
        assert not notes, rep.notes
        return
    assert len(notes) == 1 and f"padded to {seq + pad} (+{pad} token" in notes[0], rep.notes
    assert rep.padded_seq_len == seq + pad and f"(padded to {seq + pad})" in rep.summary()


# --------------------------------------------------------------------------- gloo: reference model


class WithLoss(nn.Module):
    """The reference model with a per-token loss and a mean over the sequence in the graph.

    The loss runs on each rank's own tokens, padding included; the last target is a real one
    (a shifted loss ends on an ignored target, which would hide a padding token counted in the
    loss), and the padding tokens are copies of the last token: they must not count."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, labels):
        logits = self.model(ids).float()
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return loss + logits.mean(dim=1).square().mean()


def _loss_outside(logits, ids):
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())


def _backward_against_one_process(loss_ref, loss, ref, model) -> dict:
    """Both losses' backward; the loss and gradient errors against one process and what the
    latest compile reported."""
    import tspc

    loss_ref.backward()
    loss.backward()
    err, _ = grad_error(ref, model)
    rep = tspc.last_report()
    return {
        "loss_err": abs(loss.item() - loss_ref.item()),
        "grad_err": err,
        "level": rep.level,
        "matched": len(rep.matched),
        "notes": rep.notes,
    }


def reference_worker(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Per case: the forward, the loss and every parameter's gradient against one process."""
    from samples.reference_model import build_reference_model

    out = []
    for case in cases:
        torch.compiler.reset()
        kw = {"num_layers": 2, **case.get("model", {})}
        ref = build_reference_model(seed=1, **kw)
        model = build_reference_model(seed=1, **kw)
        gen = torch.Generator().manual_seed(7)
        ids = torch.randint(0, 256, (case["batch"], case["seq"]), generator=gen)
        if case["loss"] == "in_graph":
            labels = ids.clone()
            labels[:, : case["seq"] // 3] = -100
            expected = WithLoss(ref)(ids, labels)
            got = torch.compile(WithLoss(model), backend="tsp")(ids, labels)
            out_err = abs(got.item() - expected.item())
            loss_ref, loss = expected, got
        else:
            expected = ref(ids)
            got = torch.compile(model, backend="tsp")(ids)
            out_err = ((got - expected).abs().max() / expected.abs().max()).item()
            loss_ref, loss = _loss_outside(expected, ids), _loss_outside(got, ids)
        out.append(
            {
                "case": case,
                "shape_ok": tuple(got.shape) == tuple(expected.shape),
                "out_err": out_err,
                **_backward_against_one_process(loss_ref, loss, ref, model),
            }
        )
    return out


def _reference_cases(world: int) -> list[dict]:
    """2D·k ± 1, shorter than 2D, batch 1, an explicit mask, the loss in the graph or outside
    — fewer at D = 4, where four processes share the two cores."""
    two_d = 2 * world
    if world == 4:
        return [
            {"batch": 2, "seq": two_d + 1, "loss": "outside"},
            {"batch": 1, "seq": 3, "loss": "outside", "model": {"mask": "explicit"}},
            {"batch": 1, "seq": two_d - 1, "loss": "in_graph"},
        ]
    return [
        {"batch": 2, "seq": 2 * two_d + 1, "loss": "outside"},
        {"batch": 1, "seq": 2 * two_d - 1, "loss": "outside", "model": {"mask": "explicit"}},
        {"batch": 1, "seq": 3, "loss": "outside"},  # shorter than 2D
        {"batch": 2, "seq": two_d + 1, "loss": "in_graph"},
        {"batch": 1, "seq": two_d - 1, "loss": "in_graph"},
    ]


def _check_reference(results, world):
    for per_rank in results:
        for r in per_rank:
            case = r["case"]
            assert r["level"] == "tsp" and r["matched"] == 4, r
            assert r["shape_ok"], r
            assert r["out_err"] < 1e-5 and r["loss_err"] < 1e-5, r
            assert r["grad_err"] < 1e-5, r
            pad = padded_length(case["seq"], world) - case["seq"]
            assert any(f"(+{pad} token" in n for n in r["notes"]), r["notes"]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, D4_EXTENDED])
def test_reference_model_any_length_matches_one_process(world):
    _check_reference(spawn(reference_worker, world, _reference_cases(world), timeout=900), world)


# --------------------------------------------------------------------------- gloo: transformers

SMALL = HF_SMALL


def llama_worker(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Llama with labels (its loss in the graph) and left padding, or without labels (a loss
    outside): logits at real positions, the loss and every gradient against one process."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import tspc

    out = []
    for case in cases:
        torch.compiler.reset()
        cfg = AutoConfig.for_model("llama", **SMALL)
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        ref = AutoModelForCausalLM.from_config(cfg).train()
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).train()
        b, s = case["batch"], case["seq"]
        ids = torch.randint(1, 128, (b, s), generator=torch.Generator().manual_seed(3))
        mask = torch.ones(b, s, dtype=torch.long)
        kwargs = {"input_ids": ids}
        if case["left_padding"]:
            mask[0, :3] = 0
            kwargs["attention_mask"] = mask
        if case["labels"]:
            kwargs["labels"] = ids.masked_fill(mask == 0, -100)
        expected = ref(**kwargs)
        got = torch.compile(model, backend="tsp", fullgraph=True)(**kwargs)
        if case["labels"]:
            loss_ref, loss = expected.loss, got.loss
        else:
            loss_ref = _loss_outside(expected.logits, ids)
            loss = _loss_outside(got.logits, ids)
        real = mask.bool()
        scale = expected.logits[real].abs().max()
        logits_err = ((got.logits[real] - expected.logits[real]).abs().max() / scale).item()
        out.append(
            {
                "case": case,
                "logits_err": logits_err,
                **_backward_against_one_process(loss_ref, loss, ref, model),
                "masks": [m["recognised"] for m in tspc.last_report().masks],
            }
        )
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, D4_EXTENDED])
def test_llama_any_length_matches_one_process(world):
    two_d = 2 * world
    cases = [
        {"batch": 2, "seq": 2 * two_d + 1, "left_padding": True, "labels": True},
        {"batch": 1, "seq": two_d - 1, "left_padding": False, "labels": False},
    ]
    for per_rank in spawn(llama_worker, world, cases, timeout=900):
        for r in per_rank:
            assert r["level"] == "tsp" and r["matched"] == 4, r
            assert all(r["masks"]), r  # the mask is recognised: no S x S tensor, padded or not
            assert r["logits_err"] < 1e-5 and r["loss_err"] < 1e-5, r
            assert r["grad_err"] < 1e-5, r
            assert any("padded" in n for n in r["notes"]), r["notes"]


def mistral_worker(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Mistral built from its default config (sliding window 4096, the KV cache on) under
    ``strict``: the logits and the cache's keys and values against one process."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import tspc

    out = []
    for case in cases:
        torch.compiler.reset()
        cfg = AutoConfig.for_model(
            "mistral", **{**HF_SMALL, "use_cache": True, **case.get("config", {})}
        )
        torch.manual_seed(0)
        ref = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
        ids = torch.randint(
            0, cfg.vocab_size, (2, case["seq"]), generator=torch.Generator().manual_seed(1)
        )
        opts = {"strict": case["strict"]}
        with torch.no_grad():
            expected = ref(ids)
            got = torch.compile(model, backend="tsp", options=opts)(ids)
        cache_err = 0.0
        if expected.past_key_values is not None:
            for lr, lg in zip(expected.past_key_values.layers, got.past_key_values.layers):
                for a, b in ((lr.keys, lg.keys), (lr.values, lg.values)):
                    cache_err = max(cache_err, (a - b).abs().max().item())
        rep = tspc.last_report()
        out.append(
            {
                "case": case,
                "err": ((got.logits - expected.logits).abs().max()).item()
                / expected.logits.abs().max().item(),
                "cache_err": cache_err,
                "level": rep.level,
                "fallbacks": rep.fallbacks,
                "matched": len(rep.matched),
            }
        )
    return out


@pytest.mark.slow
@pytest.mark.extended
def test_mistral_default_config_runs_tsp():
    """The default sliding window (4096) is wider than the sequence: plain causal attention,
    on the TSP schedules (it used to fail the pipeline and fall back to 'sp'). Also 31 tokens
    (padded), and a window narrower than the sequence (the zigzag kernel's sliding window,
    with the KV cache on: see tests/test_masks.py for the rest)."""
    cases = [
        {"seq": 32, "strict": True},
        {"seq": 31, "strict": True},
        {"seq": 13, "strict": True, "config": {"sliding_window": 5}},
    ]
    for per_rank in spawn(mistral_worker, 2, cases, timeout=900):
        for r in per_rank:
            assert r["err"] < 1e-5 and r["cache_err"] < 1e-5, r
            if r["case"]["strict"]:
                assert r["level"] == "tsp" and not r["fallbacks"] and r["matched"] == 4, r


# The padded length's memory (no S x S tensor at S = 4095): tests/test_memory_no_sxs.py.
