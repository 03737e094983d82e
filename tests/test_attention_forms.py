"""Attention projections in the forms transformers families write them, on hand-written
two-layer models (no transformers import), graph-only as rank r of D on the fake process group:
every attention is matched, the schedule has the broadcasts and gathers it should, and the
weights are declared with the placements their layouts allow. The same forms in the real
families, against one process on gloo: ``tests/test_hf_models.py``.

Forms: GPT-2's Conv1D fused ``c_attn`` (``addmm`` with an ``[h, 3h]`` weight, split after a
view, biases); Falcon's ``x @ W.T`` with q/k/v grouped per KV head in one fused weight and the
K/V heads picked by a one-element list and ``broadcast_to``; the same grouped weight cut by
``split([per, 1, 1], -2)`` (torchtitan's ``wqkv``, transformers 5's Falcon) and the multi-query
``[all q | k | v]`` rows cut by ``split([heads, 1, 1], -2)`` (held whole: no Shard says a
rank's rows); RoPE by rotate-every-two
(``stack`` + ``flatten``); OLMo-2's q/k RMSNorm over all heads' features.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers import D4_EXTENDED, count_collectives

H, HEADS, KV, D_HEAD, VOCAB = 64, 8, 4, 8, 128


def _rope_tables(s: int, dim: int):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.arange(s).float()[:, None] * inv  # [S, dim/2]
    # rotate-every-two pairs neighbouring features: each frequency twice, interleaved
    freqs = torch.stack((freqs, freqs), dim=-1).flatten(-2)
    return freqs.cos(), freqs.sin()


def _rotate_every_two(x):
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


class Conv1D(nn.Module):
    """GPT-2's Conv1D: a ``[in, out]`` weight applied by ``addmm`` to the flattened tokens."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out) * 0.05)
        self.bias = nn.Parameter(torch.randn(n_out) * 0.05)

    def forward(self, x):
        out = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return out.view(*x.shape[:-1], -1)


class XWT(nn.Module):
    """Falcon's ``FalconLinear`` without bias: ``x @ W.T``."""

    def __init__(self, n_in: int, n_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_out, n_in) * 0.05)

    def forward(self, x):
        return x @ self.weight.T


class RMSNorm(nn.Module):
    """Written out as OLMo-2's (``nn.RMSNorm`` traces to one fused ``rms_norm``)."""

    def __init__(self, n: int):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(n))

    def forward(self, x):
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + 1e-6))


class Attention(nn.Module):
    def __init__(self, form: str):
        super().__init__()
        self.form = form
        if form == "conv1d":
            self.c_attn, self.c_proj = Conv1D(H, 3 * H), Conv1D(H, H)
        elif form in ("falcon_grouped", "grouped_split"):  # per KV group: q heads, one k, one v
            self.qkv, self.dense = XWT(H, (HEADS + 2 * KV) * D_HEAD), XWT(H, H)
        elif form == "mq_split":  # all q heads, then the one k and the one v head
            self.qkv, self.dense = XWT(H, (HEADS + 2) * D_HEAD), XWT(H, H)
        else:
            self.q = nn.Linear(H, HEADS * D_HEAD, bias=False)
            self.k = nn.Linear(H, KV * D_HEAD, bias=False)
            self.v = nn.Linear(H, KV * D_HEAD, bias=False)
            self.o = nn.Linear(HEADS * D_HEAD, H, bias=False)
            if form == "cross_head_norm":
                self.q_norm, self.k_norm = RMSNorm(HEADS * D_HEAD), RMSNorm(KV * D_HEAD)

    def forward(self, x):
        b, s, _ = x.shape
        if self.form == "conv1d":
            q, k, v = self.c_attn(x).split(H, dim=2)
            q, k, v = (t.view(b, s, -1, D_HEAD).transpose(1, 2) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.c_proj(out.transpose(1, 2).reshape(b, s, H))
        if self.form == "falcon_grouped":
            per = HEADS // KV
            qkv = self.qkv(x).view(b, s, -1, per + 2, D_HEAD)
            q = qkv[:, :, :, :-2]
            k = torch.broadcast_to(qkv[:, :, :, [-2]], q.shape)
            v = torch.broadcast_to(qkv[:, :, :, [-1]], q.shape)
            q, k, v = (t.flatten(2, 3).transpose(1, 2) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.dense(out.transpose(1, 2).reshape(b, s, H))
        if self.form == "grouped_split":  # torchtitan's fused wqkv, transformers 5's Falcon
            per = HEADS // KV
            q, k, v = self.qkv(x).view(b, s, KV, per + 2, D_HEAD).split([per, 1, 1], dim=-2)
            q, k, v = (t.reshape(b, s, -1, D_HEAD).transpose(1, 2) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return self.dense(out.transpose(1, 2).reshape(b, s, H))
        if self.form == "mq_split":  # transformers 5's multi-query Falcon
            q, k, v = self.qkv(x).view(b, s, HEADS + 2, D_HEAD).split([HEADS, 1, 1], dim=-2)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return self.dense(out.transpose(1, 2).reshape(b, s, H))
        q, k, v = self.q(x), self.k(x), self.v(x)
        if self.form == "cross_head_norm":
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(b, s, HEADS, D_HEAD).transpose(1, 2)
        k = k.view(b, s, KV, D_HEAD).transpose(1, 2)
        v = v.view(b, s, KV, D_HEAD).transpose(1, 2)
        if self.form == "rotate_every_two":
            cos, sin = _rope_tables(s, D_HEAD)
            q = q * cos + _rotate_every_two(q) * sin
            k = k * cos + _rotate_every_two(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class Model(nn.Module):
    def __init__(self, form: str, layers: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, H)
        self.layers = nn.ModuleList(Attention(form) for _ in range(layers))
        self.head = nn.Linear(H, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


FORMS = {
    # form: {parameter name: the placement its layout gives}
    "conv1d": {
        "c_attn.weight": ("strided", 1, 3),  # this rank's columns of each of q, k and v
        "c_attn.bias": ("strided", 0, 3),
        "c_proj.weight": ("shard", 0),  # heads' features are its rows
    },
    "falcon_grouped": {"qkv.weight": ("shard", 0), "dense.weight": ("shard", 1)},
    "grouped_split": {"qkv.weight": ("shard", 0), "dense.weight": ("shard", 1)},
    # a rank's rows are its q heads' and the shared k and v rows: no Shard placement says that,
    # so the fused weight is held whole (the report's notes say so); the output is sharded
    "mq_split": {"qkv.weight": ("replicate",), "dense.weight": ("shard", 1)},
    "rotate_every_two": {"q.weight": ("shard", 0), "k.weight": ("shard", 0)},
    "cross_head_norm": {"q.weight": ("shard", 0), "o.weight": ("shard", 1)},
}


def test_map_getitem_keeps_a_split_through_one_list_index():
    from tspc.passes.layout import Sharded, map_getitem

    heads = Sharded(2, 4, 2)
    # Falcon's qkv[:, :, :, [-2]]: one list on another dim picks entries, dims stay in place
    assert map_getitem((2, 16, 4, 6, 8), (slice(None),) * 3 + ([-2],), heads) == heads
    # ... on the split dim it cuts the split
    assert map_getitem((2, 16, 4, 6, 8), (slice(None),) * 2 + ([1],), heads) is None
    # an int beside a list may move the picked dims to the front (numpy's rules): unknown
    assert map_getitem((2, 16, 4, 6, 8), (0, slice(None), slice(None), [1]), heads) == "unknown"


@pytest.mark.parametrize("world", [2, D4_EXTENDED])
def test_every_form_is_matched_with_its_schedule_and_placements(world, fake_group):
    from tspc.backend import COMPILED
    from tspc.runtime.shard_store import STORE
    from tspc.runtime.tsp_params import layout_placement

    for form, placements in FORMS.items():
        fake_group(0, world)
        torch.compiler.reset()
        model = Model(form)
        full = {n: p for n, p in model.named_parameters()}
        with torch.no_grad():
            torch.compile(model, backend="tsp", fullgraph=True)(torch.randint(0, VOCAB, (2, 16)))
        # the one graph of this compile: the latest (COMPILED keeps the last KEEP_COMPILED, so
        # an index counted before the call fails once earlier tests in the process filled it)
        cg = COMPILED[-1]
        entries = [(e.kind, e.module, e.status, e.reason) for e in cg.report.entries]
        assert entries == [("attention", f"layers.{i}", "matched", "") for i in (0, 1)], form
        (fwd,) = cg.aot.forward_gms
        counts = count_collectives(fwd)
        sweeps = 2 if form == "cross_head_norm" else 1  # Q/K/V, then O (notes say why)
        for i in (0, 1):
            tag = f"layers.{i}"
            assert counts[("broadcast_start", tag)] == sweeps * world, (form, counts)
            kv_groups = 1 if form == "mq_split" else world  # one K/V head: held whole, one group
            assert counts[("all_gather_start", tag)] == 2 * kv_groups, (form, counts)
        if sweeps == 2:
            assert any("two sweeps" in note for note in cg.report.notes), cg.report.notes
        for i in (0, 1):
            for name, want in placements.items():
                p = full[f"layers.{i}.{name}"]
                entry = STORE.get(p)
                assert entry is not None, (form, name)
                assert layout_placement(entry.layout, tuple(p.shape)) == want, (form, name)
