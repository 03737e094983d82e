"""Masks without S x S: sliding windows, documents and 4-D block masks on the zigzag layout.

The zigzag kernel (``tspc/ops/zigzag_attention.py``) runs causal attention narrowed by a
sliding window and by documents (contiguous runs of equal ids per batch row) as blocks: key
blocks outside the window or the document are skipped, a band inside a block is a mask of at
most a tile. The first tests check the kernel against dense masked attention in one process
(every rank's rows, forward and backward); the graph tests check what the mask classifier
recognises; the gloo tests (slow) run transformers models at D = 2 and 4 against one process
and check that no S x S (or c x S) tensor is created.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tspc.ops import zigzag_attention as zz
from tspc.runtime.zigzag import local_valid, padded_length, zigzag_slice

# --------------------------------------------------------------------------- kernel


def _dense_mask(n, window, doc_ids, valid, b):
    q = torch.arange(n)[:, None]
    k = torch.arange(n)[None, :]
    m = (k <= q)[None].expand(b, n, n)
    if window is not None:
        m = m & (q - k < window)
    if doc_ids is not None:
        m = m & (doc_ids[:, :, None] == doc_ids[:, None, :])
    if valid is not None:
        m = m & valid[:, None, :]
    return m[:, None]


def _docs(b, n, lengths_per_row):
    ids = torch.zeros(b, n, dtype=torch.long)
    for r, lengths in enumerate(lengths_per_row):
        pos = 0
        for i, length in enumerate(lengths):
            ids[r, pos : pos + length] = i
            pos += length
        ids[r, pos:] = len(lengths)
    return ids


def _check_kernel(world, n, window, doc_ids, key_padding, kv_heads=2, hq=4, d=8, b=2):
    torch.manual_seed(0)
    q = torch.randn(b, hq, n, d, requires_grad=True)
    k = torch.randn(b, kv_heads, n, d, requires_grad=True)
    v = torch.randn(b, kv_heads, n, d, requires_grad=True)
    valid = None
    if key_padding:
        valid = torch.ones(b, n, dtype=torch.bool)
        valid[0, :2] = False
    mask = _dense_mask(n, window, doc_ids, valid, b)
    g = hq // kv_heads
    ref = F.scaled_dot_product_attention(
        q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=mask
    ).nan_to_num()
    go = torch.randn_like(ref)
    gq, gk, gv = torch.autograd.grad(ref, (q, k, v), go)
    p = padded_length(n, world) if world > 1 else n
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    for r in range(world):
        real = local_valid(n, r, world) if world > 1 else torch.ones(n, dtype=torch.bool)
        ql = zigzag_slice(q.detach(), 2, r, world, padded=p) if world > 1 else q.detach()
        ql.requires_grad_()
        kk, vv = k.detach().requires_grad_(), v.detach().requires_grad_()
        out, _ = zz.zigzag_causal_attention(ql, kk, vv, r, world, d**-0.5, valid, window, doc_ids)
        assert torch.isfinite(out).all()

        def cut(x, r=r):
            return zigzag_slice(x, 2, r, world, padded=p) if world > 1 else x

        torch.testing.assert_close(out[:, :, real], cut(ref)[:, :, real], atol=2e-6, rtol=1e-5)
        a, bk, bv = torch.autograd.grad(out, (ql, kk, vv), cut(go) * real[:, None])
        torch.testing.assert_close(a[:, :, real], cut(gq)[:, :, real], atol=5e-6, rtol=1e-5)
        dk += bk
        dv += bv
    torch.testing.assert_close(dk, gk, atol=5e-6, rtol=1e-5)
    torch.testing.assert_close(dv, gv, atol=5e-6, rtol=1e-5)


@pytest.mark.parametrize("tile", [3, 512])
@pytest.mark.parametrize("world, n", [(1, 13), (2, 32), (2, 31), (4, 33)])
@pytest.mark.parametrize("window", [1, 2, 5, 9, 40])
def test_window_kernel_matches_dense(monkeypatch, tile, world, n, window):
    """Windows narrower than a tile, than a chunk, wider than the sequence; tiles of 3 rows
    (every path: edge band, full middle, diagonal, one band block) and of 512 (a chunk)."""
    monkeypatch.setattr(zz, "TILE", tile)
    _check_kernel(world, n, window, None, key_padding=window == 5)


@pytest.mark.parametrize("tile", [4, 512])
@pytest.mark.parametrize("world, n", [(1, 16), (2, 32), (4, 30)])
@pytest.mark.parametrize("same_rows", [True, False])
@pytest.mark.parametrize("window", [None, 4])
def test_document_kernel_matches_dense(monkeypatch, tile, world, n, same_rows, window):
    """Documents of 1 to 11 tokens, the same in every batch row or not, with and without a
    window; key padding in one case."""
    monkeypatch.setattr(zz, "TILE", tile)
    rows = [[5, 1, 7], [5, 1, 7]] if same_rows else [[3, 11, 2, 1], [9]]
    docs = _docs(2, n, rows)
    _check_kernel(world, n, window, docs, key_padding=not same_rows and window is None)


@pytest.mark.parametrize("kernel", ["math", "fold"])
def test_band_blocks_on_the_gpu_code_paths(monkeypatch, kernel):
    """A band's [1, 1, M, L] mask on the device-generic math kernel and on a kernel without
    grouped heads (queries looped per group member: the fold would misalign the mask)."""
    from tspc.ops import attention_kernels as ak

    if kernel == "math":
        monkeypatch.setattr(ak, "choose_kernel", lambda *a: "math")
    else:
        monkeypatch.setattr(ak, "_native_gqa", lambda kernel: False)
    monkeypatch.setattr(zz, "TILE", 4)
    _check_kernel(2, 32, 6, _docs(2, 32, [[5, 20], [30]]), key_padding=True)


def test_window_and_documents_build_no_chunk_sized_tensor():
    """S = 4096 over 2 ranks (c = 1024): a window of 300 and 7 documents; no tensor the kernel
    creates, forward or backward, has more elements than 2 tiles x a tile (no c x S or c x c)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Biggest(TorchDispatchMode):
        biggest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, tuple) else (out,):
                if isinstance(t, torch.Tensor) and t.dim() >= 2:
                    Biggest.biggest = max(Biggest.biggest, t.shape[-2] * t.shape[-1])
            return out

    s, world, d = 4096, 2, 8
    q = torch.randn(1, 1, s // world, d, requires_grad=True)
    k = torch.randn(1, 1, s, d, requires_grad=True)
    docs = _docs(1, s, [[700, 1, 1300, 5, 900, 600]])
    with Biggest():
        o, _ = zz.zigzag_causal_attention(q, k, k, 0, world, d**-0.5, None, 300, docs)
        o.sum().backward()
    biggest_mask = zz.TILE * 2 * zz.TILE
    assert Biggest.biggest <= max(biggest_mask, s * d), Biggest.biggest
    assert Biggest.biggest < (s // world) ** 2
