"""Random ops on sequence-sharded values draw, for each global token, the same numbers at every D.

Before: ``dropout`` on a rank's tokens drew from torch's generator, whose state is the same on
every rank, so rank 0's and rank 1's tokens got copies of one mask and the result changed with
D; GPT-2 with its default dropout did not train at D = 2 (the partitioner found a random op it
could neither save nor recompute). Now dropout, ``rand_like``/``randn_like`` and SDPA's
``dropout_p`` are keyed by (per-call seed, op, global position) — ``tspc/ops/keyed_random.py``,
``passes/keyed_random.py`` — and the same seed gives the same loss and gradients at D = 1, 2, 4.

The references are independent of the code under test where one exists: the keyed draw of the
whole tensor in one call against the ranks' zigzag parts (its definition: position-keyed), the
binomial spread of a keep rate, and D = 1 (no sharding, no communication) for the whole models.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from tests.helpers import D4_EXTENDED, HF_SMALL
from tspc.launch import spawn
from tspc.ops.keyed_random import keyed_draw
from tspc.runtime.zigzag import padded_length, zigzag_indices, zigzag_slice

# --------------------------------------------------------------------------- the graph pass


def _graph(fn, *example) -> fx.GraphModule:
    from tspc.passes.analyse import propagate_shapes

    gm = fx.symbolic_trace(fn)
    propagate_shapes(gm, list(example))
    return gm


def _targets(gm: fx.GraphModule) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def test_random_ops_become_keyed_ops():
    """dropout (functional), rand_like, randn_like and SDPA's dropout_p become keyed ops with a
    seed drawn once from torch's generator; eval-mode dropout stays (the identity); bernoulli
    is left (and no longer counts as token-wise: the sequence pass gathers its input)."""
    from tspc.passes.keyed_random import key_random_ops
    from tspc.passes.seq_ops import is_elementwise

    def f(x, q):
        y = F.dropout(x, 0.1, True) + torch.rand_like(x) + torch.randn_like(x)
        y = F.dropout(y, 0.5, False)  # eval: identity
        a = F.scaled_dot_product_attention(q, q, q, dropout_p=0.2, is_causal=True)
        return y, a, torch.bernoulli(x.sigmoid())

    x, q = torch.randn(2, 8, 4), torch.randn(1, 2, 8, 4)
    gm = _graph(f, x, q)
    rep = key_random_ops(gm, "", 1)
    t = _targets(gm)
    assert t.count(torch.ops.tspc.keyed_dropout.default) == 2  # the activation, the probs
    assert t.count(torch.ops.tspc.keyed_rand.default) == 2
    assert t.count(torch.randint) == 1 and t.count(F.dropout) == 1 and torch.rand_like not in t
    assert F.scaled_dot_product_attention not in t and torch.softmax in t
    assert len(rep.keyed) == 4 and "keyed random draws" in rep.notes()[0]
    assert len(rep.left) == 1 and "bernoulli" in rep.notes()[1]  # reported, not keyed
    keys = [n.args[2] for n in gm.graph.nodes if "keyed" in str(n.target)]
    assert sorted(keys) == [0, 1, 2, 3]
    bern = next(n for n in gm.graph.nodes if n.target is torch.bernoulli)
    assert not is_elementwise(bern)
    # the rewritten graph runs; a fixed generator state gives the same numbers twice
    outs = [(torch.manual_seed(1), gm(x, q))[1] for _ in range(2)]
    for a, b in zip(outs[0][:2], outs[1][:2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # at D > 1 the seed comes from rank 0 (a broadcast), so ranks seeded apart agree
    gm2 = _graph(f, x, q)
    key_random_ops(gm2, "g", 2)
    assert "broadcast" in gm2.code


def test_sdpa_dropout_keeps_rows_hidden_from_every_key_zero():
    """SDPA with ``dropout_p`` rewritten to its math: a query row the mask hides from every key
    (left padding) is 0 and takes no gradient, as SDPA's safe softmax has it — not NaN, which
    made GPT-2's loss and every gradient NaN in training with left padding (found by probing)."""
    from tspc.passes.keyed_random import key_random_ops

    def f(q, mask):
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask, dropout_p=0.2)

    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    mask[:3] = False  # three rows see no key
    gm = _graph(f, q, mask)
    key_random_ops(gm, "", 1)
    out = gm(q, mask)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()
    assert (out[:, :, :3] == 0).all()


def test_sharded_dropout_gets_global_positions():
    """Through the sequence pass (fake group at D = 2, rank 1): the keyed dropout on a sharded
    activation is told its split dimension and its zigzag positions — not gathered."""
    from tests.helpers import capture
    from tspc.options import TSPOptions
    from tspc.pipeline import run_pipeline
    from tspc.runtime.group import TSPGroup

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = torch.nn.Linear(16, 48)
            self.drop = torch.nn.Dropout(0.1)

        def forward(self, x):
            q, k, v = self.qkv(x).view(1, 12, 3, 2, 8).permute(2, 0, 3, 1, 4)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.drop(a.transpose(1, 2).reshape(1, 12, 16))

    gm, ex = capture(Block().train(), torch.randn(1, 12, 16))
    res = run_pipeline(gm, ex, TSPGroup("fake", 1, 2), TSPOptions(), level="sp")
    node = next(n for n in res.gm.graph.nodes if n.target == torch.ops.tspc.keyed_dropout.default)
    assert node.args[4] == 1 and node.args[6] == 12  # split dim, global size
    pos = node.args[5]
    assert isinstance(pos, fx.Node) and "zigzag_slice" in str(pos.target)
    assert not any(
        "gather" in str(n.target) and n.args[0] is node.args[0] for n in res.gm.graph.nodes
    )
    assert any("keyed random draws" in s for s in res.report.notes)


# --------------------------------------------------------------------------- the keyed draw


@pytest.mark.parametrize("world, n", [(2, 16), (4, 24), (2, 13), (4, 30)])
def test_keyed_draw_independent_of_the_split(world, n):
    """Each rank's zigzag part (padded where n does not split into 2D chunks) draws exactly the
    numbers the whole tensor draws at those positions; along a merged dim (B*S) too."""
    seed = torch.tensor([123, 456])
    like = torch.empty(3, n, 5)
    whole_u = keyed_draw(like, seed, 7, False)
    whole_z = keyed_draw(like, seed, 7, True)
    p = padded_length(n, world)
    for r in range(world):
        pos = zigzag_slice(torch.arange(n), 0, r, world, padded=p)
        loc = torch.empty(3, p // world, 5)
        for normal, whole in ((False, whole_u), (True, whole_z)):
            got = keyed_draw(loc, seed, 7, normal, 1, pos, n)
            assert torch.equal(got, zigzag_slice(whole, 1, r, world, padded=p))
    # the sequence merged with the batch: [B * S, h], cut with outer = B
    flat = keyed_draw(torch.empty(3 * n, 5), seed, 7, False)
    assert torch.equal(flat, whole_u.reshape(3 * n, 5))
    pos = zigzag_slice(torch.arange(3 * n), 0, 1, world, outer=3, padded=p)
    got = keyed_draw(torch.empty(pos.numel(), 5), seed, 7, False, 0, pos, 3 * n)
    assert torch.equal(got, zigzag_slice(flat, 0, 1, world, outer=3, padded=p))


def test_keyed_draw_is_statistically_sane():
    """Uniform mean and variance, normal moments, a dropout keep rate within 5 binomial standard
    deviations; different seeds and keys draw different numbers; no two ranks' masks equal."""
    seed = torch.tensor([1, 2])
    like = torch.empty(64, 512, 16)  # 524288 draws
    u = keyed_draw(like, seed, 0, False)
    assert u.min() >= 0 and u.max() < 1
    assert abs(u.mean() - 0.5) < 3e-3 and abs(u.var() - 1 / 12) < 2e-3
    z = keyed_draw(like, seed, 0, True)
    assert abs(z.mean()) < 1e-2 and abs(z.std() - 1) < 1e-2 and z.isfinite().all()
    p, n = 0.1, u.numel()
    assert abs((u < p).float().mean() - p) < 5 * (p * (1 - p) / n) ** 0.5
    # neighbouring elements uncorrelated
    c = torch.corrcoef(torch.stack([u[:, :-1].flatten(), u[:, 1:].flatten()]))[0, 1]
    assert abs(c) < 1e-2
    assert not torch.equal(u, keyed_draw(like, seed, 1, False))
    assert not torch.equal(u, keyed_draw(like, torch.tensor([1, 3]), 0, False))
    # D = 2: each rank's tokens get their own mask (before the fix they were one mask twice)
    masks = []
    for r in range(2):
        pos = zigzag_indices(512, r, 2)
        masks.append(keyed_draw(torch.empty(64, 256, 16), seed, 0, False, 1, pos, 512) < p)
    assert not torch.equal(masks[0], masks[1])
    agree = (masks[0] == masks[1]).float().mean()
    assert abs(agree - (p * p + (1 - p) ** 2)) < 5e-3  # independent masks agree this often


def test_keyed_dropout_gradient_is_the_same_mask():
    """The backward regenerates the mask: d(out)/dx = mask / (1 - p) elementwise."""
    x = torch.randn(4, 32, requires_grad=True)
    seed = torch.tensor([9, 9])
    out = torch.ops.tspc.keyed_dropout(x, seed, 3, 0.25, 0, None, 0)
    (g,) = torch.autograd.grad(out.sum(), x)
    keep = out != 0
    torch.testing.assert_close(g, keep.float() / 0.75)
    torch.testing.assert_close(out, x.detach() * keep / 0.75)


# --------------------------------------------------------------------------- whole models on gloo

GPT2 = {"n_inner": 128, "bos_token_id": 1, "eos_token_id": 2}  # default dropouts: 0.1 x 3


def _gpt2(attn: str, layers: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("gpt2", **{**HF_SMALL, **GPT2, "num_hidden_layers": layers})
    assert cfg.resid_pdrop == cfg.embd_pdrop == cfg.attn_pdrop == 0.1
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg).train()
    m.loss_type = "ForCausalLM"  # GPT2LMHeadModel's default would warn, which breaks fullgraph
    return m


class MaskProbe(torch.nn.Module):
    """One attention (so the sequence is sharded) and the dropout mask itself as an output:
    ``dropout(ones)`` on the sharded activations, gathered to the whole sequence."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.drop = torch.nn.Dropout(0.5)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, h // 4).permute(2, 0, 3, 1, 4)  # 4 heads
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        a = a.reshape(b, s, h)
        return a, self.drop(torch.ones_like(a))


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def random_worker(rank: int, world: int, cases: list[tuple[str, int]], n: int) -> dict:
    """GPT-2 with its default dropouts, one training step per case from the same seeds: the
    loss and every gradient (whole); then the probe's dropout mask, two calls."""
    import tspc
    from tspc.runtime.counters import COUNTER

    out: dict = {}
    ids = torch.randint(1, 128, (2, n), generator=torch.Generator().manual_seed(3))
    for attn, layers in cases:
        torch.compiler.reset()
        model = _gpt2(attn, layers)
        compiled = torch.compile(model, backend="tsp", fullgraph=True)
        torch.manual_seed(100 + rank * (attn == "sdpa"))  # sdpa: ranks seeded apart
        COUNTER.reset()
        loss = compiled(input_ids=ids, labels=ids).loss
        loss.backward()
        seed_sends = COUNTER.snapshot()["by_tag"].get("rng_seed", {})
        grads = {k: _full(p.grad).numpy() for k, p in model.named_parameters()}  # by value
        again = compiled(input_ids=ids, labels=ids).loss.item()  # the next step's masks
        rep = tspc.last_report()
        out[attn] = {"loss": loss.item(), "grads": grads, "next": again, "level": rep.level}
        out[attn]["seed_broadcasts"] = seed_sends.get("broadcast", {}).get("calls", 0)
        out[attn]["notes"] = rep.notes
        out[attn]["entries"] = [(e.module, e.status, e.reason) for e in rep.entries]
    out["masks"] = _probe_masks()
    return out


PROBE_LENGTHS = (16, 8, 24, 13)  # a length family at D = 1, 2, 4 (multiples of 2D), then padded


def _probe_masks() -> dict:
    """The probe compiled with a symbolic length (``dynamic_seq``: later lengths of the family
    run the program compiled for the first): its mask at each length, two calls at the first."""
    from torch._dynamo.utils import counters

    torch.compiler.reset()
    counters.clear()
    torch.manual_seed(0)
    probe = torch.compile(MaskProbe().train(), backend="tsp", dynamic=True)
    torch.manual_seed(7)
    masks = {}
    for n in PROBE_LENGTHS:
        x = torch.randn(2, n, 16)
        masks[n] = probe(x)[1].detach().numpy()
        if n == PROBE_LENGTHS[0]:
            masks["second call"] = probe(x)[1].detach().numpy()
    return {"masks": masks, "tspc": dict(counters["tspc"])}


CASES = [("sdpa", 1), ("eager", 1)]
N = 13  # pads at D = 2 and 4
_ONE: dict = {}


def _d1() -> dict:
    """D = 1 (one rank, nothing sharded, nothing sent): the reference, run once per session."""
    if not _ONE:
        _ONE.update(spawn(random_worker, 1, CASES, N, timeout=900)[0])
    return _ONE


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, D4_EXTENDED])
def test_gpt2_dropout_same_loss_and_gradients_at_every_d(world):
    """GPT-2 with its default dropouts trains at D > 1 (before: the partitioner failed at D = 2)
    and gives D = 1's loss and every gradient for the same seed, SDPA (its dropout_p) and eager
    attention (dropout of the probabilities) alike; the next call draws new masks."""
    ref = _d1()
    for r in spawn(random_worker, world, CASES, N, timeout=900):
        for attn, _ in CASES:
            got, want = r[attn], ref[attn]
            assert got["level"] == "tsp" and any("keyed random" in x for x in got["notes"])
            assert abs(got["loss"] - want["loss"]) < 1e-5 * abs(want["loss"]), (attn, got["loss"])
            assert abs(got["next"] - want["next"]) < 1e-5 * abs(want["next"])
            assert abs(got["next"] - got["loss"]) > 1e-4  # new masks at the next step
            assert got["seed_broadcasts"] == 1  # one per step: saved for backward, not resent
            for k, g in want["grads"].items():
                err = float(abs(got["grads"][k] - g).max() / (abs(g).max() + 1e-12))
                assert err < 1e-5, (attn, k, err)
            status = {m: st for m, st, _ in got["entries"]}
            assert status["transformer.h.0.mlp"] == "matched"  # the MLP runs TSP
            assert status["transformer.h.0.attn"] == "skipped"  # dropout: held whole (docs)
        # the mask itself: D = 1's at every length of the symbolic family and a padded one
        masks, want = r["masks"]["masks"], ref["masks"]["masks"]
        for n, m in want.items():
            assert (masks[n] == m).all(), n
        assert not (masks["second call"] == masks[PROBE_LENGTHS[0]]).all()
        if world == 2:  # a family program ran (at D = 4 these lengths compiled 4 times)
            assert r["masks"]["tspc"].get("runs_without_compile", 0) >= 1
        # rank 0's tokens and rank 1's drew different masks (before: one mask, twice)
        m = torch.from_numpy(masks[PROBE_LENGTHS[0]])
        parts = [zigzag_slice(m, 1, rank, world) for rank in range(world)]
        assert all(not torch.equal(parts[0], q) for q in parts[1:])
