"""Query rows that the mask hides from every key, forward and backward, exactly as the model's code.

Hugging Face's set-up with left padding: the last padding position's logits predict the first
real token, so the loss reads a query row that sees no key. Eager attention adds HF's
``finfo.min`` mask, which makes such a row attend *uniformly to every key*; its gradient is
autograd's softmax backward at those weights. SDPA with HF's bool mask makes it 0 (no
gradient). tspc must give both exactly: the loss, every gradient, a finite difference of the
one-process loss along a random direction, and AdamW steps — on gloo at D = 1, 2, 4, for Llama,
Qwen2 and GPT-2, SDPA and eager, left and right padding. Before the fix, eager + left padding
gave the right loss and gradients 13-47x off (torch's fused SDPA backward, which tspc's
canonicalised eager attention ran, multiplies such a row's gradient by the number of keys).

The kernels alone (no process group): the zigzag kernel on each block kernel a GPU takes that
CPU can run (CPU flash, the math fallback, GQA folded into query rows), and
``masked_attention`` (SDPA with an additive mask the passes do not recognise), against eager
softmax and SDPA's math backend.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import D4_EXTENDED, HF_SMALL, train_step_against_one_process
from tspc.launch import spawn
from tspc.ops import attention_kernels as ak
from tspc.ops import zigzag_attention as zz

MIN = torch.finfo(torch.float32).min

# --------------------------------------------------------------------------- the kernels alone


def _eager(q, k, v, add, scale):
    """The model's own code: ``softmax(q k^T * scale + mask) @ v`` (GQA by repetition)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return torch.softmax(q @ k.transpose(-1, -2) * scale + add, dim=-1) @ v


def _padded_batch(n: int, window: int | None = None):
    """(key_valid [2, n], the causal (+ window) + key padding bool mask [2, 1, n, n]): row 0
    left-padded (its first 3 queries see no key), row 1 right-padded."""
    valid = torch.ones(2, n, dtype=torch.bool)
    valid[0, :3] = False
    valid[1, -3:] = False
    pos = torch.arange(n)
    see = pos[None, :] <= pos[:, None]
    if window is not None:
        see = see & (pos[:, None] - pos[None, :] < window)
    return valid, see[None, None] & valid[:, None, None, :]


def _zigzag_vs_reference(world, n, kv_heads, masked_value, safe, window=None):
    """Each rank's zigzag kernel against the model's softmax over the whole sequence, forward
    and backward; returns the largest error (the ranks' K/V gradients summed)."""
    from tspc.runtime.zigzag import local_valid, padded_length, zigzag_slice

    torch.manual_seed(0)
    b, hq, d = 2, 4, 8
    q = torch.randn(b, hq, n, d, requires_grad=True)
    k = torch.randn(b, kv_heads, n, d, requires_grad=True)
    v = torch.randn(b, kv_heads, n, d, requires_grad=True)
    valid, see = _padded_batch(n, window)
    if masked_value is None:  # a bool mask through SDPA: hidden rows are 0
        ref = F.scaled_dot_product_attention(
            q, k, v, attn_mask=see, enable_gqa=True, scale=d**-0.5
        )  # fmt: skip
    else:
        ref = _eager(q, k, v, torch.zeros(see.shape).masked_fill(~see, masked_value), d**-0.5)
    go = torch.randn_like(ref)
    gq, gk, gv = torch.autograd.grad(ref, (q, k, v), go)
    p = padded_length(n, world) if world > 1 else n
    dk, dv, err = torch.zeros_like(k), torch.zeros_like(v), 0.0
    for r in range(world):
        real = local_valid(n, r, world) if world > 1 else torch.ones(n, dtype=torch.bool)
        ql = zigzag_slice(q.detach(), 2, r, world, padded=p).requires_grad_()
        kk, vv = k.detach().requires_grad_(), v.detach().requires_grad_()
        out, _ = zz.zigzag_causal_attention(
            ql, kk, vv, r, world, d**-0.5, valid, window, None, None, masked_value, safe
        )
        want = zigzag_slice(ref, 2, r, world, padded=p)
        err = max(err, (out[:, :, real] - want[:, :, real]).abs().max().item())
        grad_local = zigzag_slice(go, 2, r, world, padded=p) * real[:, None]
        a, bk, bv = torch.autograd.grad(out, (ql, kk, vv), grad_local)
        want_q = zigzag_slice(gq, 2, r, world, padded=p)
        err = max(err, (a[:, :, real] - want_q[:, :, real]).abs().max().item())
        dk, dv = dk + bk, dv + bv
    return max(err, (dk - gk).abs().max().item(), (dv - gv).abs().max().item())


@pytest.mark.parametrize("path", ["cpu_flash", "math", "fold"])
@pytest.mark.parametrize("world, n", [(1, 16), (2, 13), (4, 30)])
def test_zigzag_kernel_gives_hidden_rows_the_models_softmax(monkeypatch, path, world, n):
    """Eager's finfo.min mask (uniform rows, GQA 4 -> 2), SDPA's bool mask (zero rows, no
    GQA), a sliding window: every block kernel path, every rank's rows, both padding sides."""
    if path == "math":
        monkeypatch.setattr(ak, "choose_kernel", lambda *a: "math")
    elif path == "fold":  # a kernel without grouped heads (CUDA's efficient one)
        monkeypatch.setattr(ak, "_native_gqa", lambda kernel: False)
    assert _zigzag_vs_reference(world, n, 2, MIN, safe=False) < 1e-5
    assert _zigzag_vs_reference(world, n, 4, None, safe=True) < 1e-5
    assert _zigzag_vs_reference(world, n, 2, MIN, safe=False, window=5) < 1e-5


def test_zigzag_kernel_hidden_rows_other_masked_values():
    """A milder additive value (-1e4: the row's scores survive the sum) and -inf under eager
    softmax (NaN, as the model's own code gives) or SDPA's safe softmax (0)."""
    assert _zigzag_vs_reference(2, 16, 2, -1e4, safe=False) < 1e-5
    n, d = 16, 8
    valid, see = _padded_batch(n)
    q, k = torch.randn(2, 4, n, d), torch.randn(2, 2, n, d)
    nan_rows, _ = zz.zigzag_causal_attention(
        q, k, k, 0, 1, d**-0.5, valid, None, None, None, float("-inf"), False
    )
    assert nan_rows[0, :, :3].isnan().all() and not nan_rows[0, :, 3:].isnan().any()
    zero_rows, _ = zz.zigzag_causal_attention(
        q, k, k, 0, 1, d**-0.5, valid, None, None, None, float("-inf"), True
    )
    assert (zero_rows[0, :, :3] == 0).all()


def test_zigzag_kernel_dense_mask_rows_hidden_from_every_key():
    """An explicit float mask that is not block-diagonal (its rows run on the mask itself),
    with rows it hides from every key: the eager softmax of those rows, forward and backward."""
    torch.manual_seed(0)
    n, d = 12, 8
    q, k, v = (torch.randn(1, 2, n, d, requires_grad=True) for _ in range(3))
    _, see = _padded_batch(n)
    see = see[:1].clone()
    see[0, 0, 6, :] = False  # a middle row hidden too
    see[0, 0, 8, 0] = True  # and a row that is not causal: no documents
    add = torch.zeros(see.shape).masked_fill(~see, MIN)
    ref = _eager(q, k, v, add, d**-0.5)
    go = torch.randn_like(ref)
    want = torch.autograd.grad(ref, (q, k, v), go)
    ids = torch.full((1, n), -1)  # documents_of_mask's "not documents"
    out, _ = zz.zigzag_causal_attention(
        q, k, v, 0, 1, d**-0.5, None, None, ids, add, None, False
    )  # fmt: skip
    torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
    got = torch.autograd.grad(out, (q, k, v), go)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("heads_in_mask", [False, True])
def test_masked_attention_equals_eager_and_sdpas_math_backend(heads_in_mask):
    """SDPA with an additive mask the passes do not read: torch's fused CPU kernel gets the
    backward of a row hidden from every key wrong (its log-sum-exp m + log L rounds to m, so
    every gradient of the row is L times too large); ``masked_attention`` equals eager softmax
    and SDPA's math backend, forward and backward, GQA and per-head masks included."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from tspc.ops.masked_rows import masked_attention

    torch.manual_seed(0)
    n, d = 6, 8
    q = torch.randn(2, 4, n, d, requires_grad=True)
    k, v = (torch.randn(2, 2, n, d, requires_grad=True) for _ in range(2))
    _, see = _padded_batch(n)
    add = torch.zeros(see.shape).masked_fill(~see, MIN)
    if heads_in_mask:
        add = add.expand(2, 4, n, n).clone()
        add[1, 1, 2:] = MIN  # rows hidden in one head only
    go = torch.randn(2, 4, n, d)
    ref = _eager(q, k, v, add, d**-0.5)
    want = torch.autograd.grad(ref, (q, k, v), go)
    with sdpa_kernel(SDPBackend.MATH):
        math_out = F.scaled_dot_product_attention(q, k, v, attn_mask=add, enable_gqa=True)
    fused = F.scaled_dot_product_attention(q, k, v, attn_mask=add, enable_gqa=True)
    for out in (masked_attention(q, k, v, add, enable_gqa=True), math_out):
        torch.testing.assert_close(out, ref, atol=2e-6, rtol=1e-5)
        for a, b in zip(torch.autograd.grad(out, (q, k, v), go), want):
            torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)
    # why masked_attention exists (if torch fixes its kernel, these rows could go back to it)
    dq_fused = torch.autograd.grad(fused, (q,), go)[0]
    assert not torch.allclose(dq_fused[0, :, 0], want[0][0, :, 0], rtol=0.1), "torch fixed it"
    torch.testing.assert_close(dq_fused[0, :, 0], n * want[0][0, :, 0], rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- whole models on gloo

# (family, attention, padding, layers): Llama, Qwen2 (q/k/v biases) and GPT-2 (Conv1D, its own
# eager code without an fp32 softmax), eager and SDPA, left padding (rows that see no key, read
# by the loss) and right padding (in one batch too). Two layers where a hidden row's output becomes the next
# layer's keys and values (and the AdamW run), one elsewhere (compile time).
CASES = [
    ("llama", "eager", "left", 2),
    ("qwen2", "eager", "both", 1),  # row 0 left-padded, row 1 right-padded
    ("gpt2", "eager", "left", 1),
    ("llama", "sdpa", "left", 1),
    ("gpt2", "sdpa", "right", 1),
    ("odd_mask", "eager", "left", 1),  # a mask the passes do not read: masked_attention
]
GPT2 = {"n_inner": 128, "bos_token_id": 1, "eos_token_id": 2}
NO_DROPOUT = {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "attention_dropout": 0.0}


class OddMaskLM(torch.nn.Module):
    """One eager attention layer under an additive finfo.min mask with a term the mask
    analysis cannot read (``(q + k) % 5 != 1``) and key padding: not recognised, so it runs as
    ``masked_attention`` on each rank's mask rows; left padding and the term hide rows from
    every key."""

    def __init__(self, vocab: int = 128, hidden: int = 64, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (
            torch.nn.Linear(hidden, hidden, bias=False) for _ in range(4)
        )
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids, attention_mask, labels):
        from transformers.modeling_outputs import CausalLMOutput

        b, s = input_ids.shape
        x = self.embed(input_ids)
        pos = torch.arange(s)
        see = (pos[None, :] <= pos[:, None]) & ((pos[:, None] + pos[None, :]) % 5 != 1)
        see = see[None, None] & attention_mask[:, None, None, :].bool()
        mask = torch.zeros(see.shape).masked_fill(~see, MIN)
        q, k, v = (
            p(x).view(b, s, self.heads, -1).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        scores = torch.matmul(q, k.transpose(-2, -1)) * q.shape[-1] ** -0.5 + mask
        a = torch.matmul(torch.softmax(scores, dim=-1), v).transpose(1, 2).reshape(b, s, -1)
        logits = self.lm_head(x + self.o_proj(a))
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return CausalLMOutput(loss=loss, logits=logits)


def _models(family: str, attn: str, layers: int = 2):
    """The one-process model and a second one with the same weights (for tspc)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if family == "odd_mask":
        return [torch.manual_seed(0) and OddMaskLM().train() for _ in range(2)]

    extra = GPT2 if family == "gpt2" else {}
    extra = {**extra, "num_hidden_layers": layers}
    cfg = AutoConfig.for_model(family, **{**HF_SMALL, **extra, **NO_DROPOUT})
    cfg._attn_implementation = attn
    models = []
    for _ in range(2):
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(cfg).train()
        if getattr(m, "loss_type", None) is None:  # GPT2LMHeadModel: its loss would warn,
            m.loss_type = "ForCausalLM"  # which breaks fullgraph
        models.append(m)
    return models


def _batch(padding: str) -> dict:
    """Labels at every real token: with left padding the first real token of row 0 is
    predicted from the last padding position, a query row that sees no key."""
    b, s = 2, 16
    ids = torch.randint(1, 128, (b, s), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(b, s, dtype=torch.long)
    if padding in ("left", "both"):
        mask[0, :5] = 0
    if padding in ("right", "both"):
        mask[1, -4:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _directional(ref, model, kwargs, eps: float = 3e-4) -> dict:
    """The derivative of the loss along a random direction u (normal entries) of all
    parameters: from the one-process gradient, from tspc's, and a central finite difference
    of the one-process loss (fp32; at eps = 3e-4 it is within 0.3% of autograd here)."""
    gen = torch.Generator().manual_seed(11)
    u = [torch.randn(p.shape, generator=gen) for p in ref.parameters()]
    d_ref = sum(float((p.grad * x).sum()) for p, x in zip(ref.parameters(), u))
    d_tsp = sum(float((_full(p.grad) * x).sum()) for p, x in zip(model.parameters(), u))
    losses = []
    with torch.no_grad():
        for sign in (1.0, -2.0, 1.0):  # +eps, -eps, back
            for p, x in zip(ref.parameters(), u):
                p.add_(x, alpha=sign * eps)
            if sign != 1.0 or not losses:
                losses.append(ref(**kwargs).loss.item())
    return {"ref": d_ref, "tsp": d_tsp, "fd": (losses[0] - losses[1]) / (2 * eps)}


def masks_worker(rank: int, world: int, cases: list[tuple], adamw_steps: int = 0) -> list[dict]:
    """Each case compiled and trained one step against one process; the first case then takes
    ``adamw_steps`` AdamW steps side by side."""
    import tspc

    out = []
    for i, (family, attn, padding, layers) in enumerate(cases):
        t0 = time.perf_counter()
        torch.compiler.reset()
        ref, model = _models(family, attn, layers)
        kwargs = _batch(padding)
        loss_ref, loss, err, compiled = train_step_against_one_process(ref, model, kwargs)
        rep = tspc.last_report()
        r = {
            "case": (family, attn, padding, layers),
            "loss": (loss.item(), loss_ref.item()),
            "grad_err": err,
            "directional": _directional(ref, model, kwargs),
            "masks": [(m["recognised"], m["detail"]) for m in rep.masks],
            "matched": len(rep.matched),
            "level": rep.level,
        }
        t1 = time.perf_counter()
        if adamw_steps and i == 0:
            r["adamw"] = _adamw(ref, model, compiled, kwargs, adamw_steps)
        r["seconds"] = (t1 - t0, time.perf_counter() - t1)  # the case, its AdamW steps
        out.append(r)
    return out


def _adamw(ref, model, compiled, kwargs, steps: int) -> list[tuple[float, float]]:
    """(tspc loss, one-process loss) after each of ``steps`` AdamW steps (gradients of the
    first are those already there)."""
    # the finite difference moved ref's weights and back: the same weights, up to rounding
    with torch.no_grad():
        for p_ref, p in zip(ref.parameters(), model.parameters()):
            p_ref.copy_(_full(p))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, eps=1e-6) for m in (ref, model)]
    losses = []
    for _ in range(steps):
        for o in opts:
            o.step()
            o.zero_grad()
        loss_ref, loss = ref(**kwargs).loss, compiled(**kwargs).loss
        loss_ref.backward()
        loss.backward()
        losses.append((loss.item(), loss_ref.item()))
    return losses


def _check(per_rank: list[list[dict]]) -> None:
    for results in per_rank:
        for r in results:
            got, want = r["loss"]
            family, _, _, layers = r["case"]
            assert r["level"] == "tsp", r
            assert r["matched"] == (1 if family == "odd_mask" else 2 * layers), r
            assert abs(got - want) < 1e-5, r
            assert r["grad_err"] < 2e-5, r
            d = r["directional"]
            assert abs(d["tsp"] - d["ref"]) <= 1e-5 + 1e-4 * abs(d["ref"]), r
            # the finite difference sees the rounded forward, in which a uniform row does not
            # depend on its scores; autograd (eager's too) differentiates the softmax at it
            assert abs(d["tsp"] - d["fd"]) <= 5e-3 + 2e-2 * abs(d["fd"]), r
            # every HF mask understood: no S x S mask, whatever the padding and attention
            recognised = family != "odd_mask"
            assert r["masks"] and all(rec == recognised for rec, _ in r["masks"]), r["masks"]
            for got, want in r.get("adamw", []):
                assert abs(got - want) < 1e-4, r["adamw"]


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_hidden_rows_train_like_one_process(world):
    """Loss, every gradient, a directional derivative against a finite difference, five
    configurations; at D = 2 also six AdamW steps of eager Llama with left padding."""
    per_rank = spawn(masks_worker, world, CASES, 6 if world == 2 else 0, timeout=900)
    _check(per_rank)
    if world == 2:
        assert all(len(r[0]["adamw"]) == 6 for r in per_rank)


@pytest.mark.slow
@pytest.mark.parametrize(
    "cases",
    [[("llama", "eager", "left", 1)], pytest.param(CASES, marks=D4_EXTENDED.marks)],
    ids=["llama-eager-left", "all"],
)
def test_hidden_rows_train_like_one_process_d4(cases):
    """D = 4: eager Llama (one layer) with left padding in the suite, every case in the
    extended tier."""
    _check(spawn(masks_worker, 4, cases, timeout=900))
