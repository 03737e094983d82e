"""The language-model head and its cross-entropy in token chunks, gradients taken in the forward.

``sharded_linear_cross_entropy(x, W, b, target, ...)`` is ``sharded_cross_entropy(linear(x, W,
b).to(dtype), target, ...)`` (``runtime/seq_reductions.py``) without a ``tokens x vocab`` tensor
alive beyond one chunk: the local tokens are taken ``chunk`` at a time, each chunk's logits are
made, turned into that chunk's loss *and* its gradients with respect to ``x``, ``W`` and ``b``
(softmax minus the one-hot target), and dropped. What the backward keeps is ``dx`` (``[N, h]``)
and ``dW`` (``[V, h]``, the size of the weight's own gradient), not the saved log-softmax
(``[N, V]``: 1.05 GB per rank for a 32K vocabulary at 16K local tokens in bf16).

Why gradients in the forward (as Liger's and torchtune's chunked losses do) and not a
recomputation of each chunk in the backward: the backward would need each chunk's logits again
(one more ``N x h x V`` GEMM), and under aot_autograd a recomputed chunk is the same expression
as the forward's, which the partitioner's common-subexpression elimination merges back into one
node whose result it then saves (every chunk's logits: the tensor this exists to avoid). Computed
in the forward, the gradients are exact for any use of the loss: the local loss is a scalar, so
its backward only scales them by the incoming gradient. When no input needs a gradient (an
evaluation forward) only the loss is computed.

The weight gradient is accumulated over the chunks in fp32 when the weight is 16-bit (one GEMM
of all tokens, as the unchunked backward runs, accumulates in fp32 inside the kernel), then
stored in the weight's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .precision import accumulation_dtype
from .seq_reductions import reduce_local_loss


class ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Sum over the valid tokens of ``cross_entropy(linear(x, W, b).to(dtype), target)``."""

    @staticmethod
    def forward(ctx, x, weight, bias, target, ignore_index, logits_dtype, chunk):
        n = x.shape[0]
        want = ctx.needs_input_grad[:3]
        grads = any(want)
        acc = accumulation_dtype(weight.dtype)
        total = None
        dxs = []
        dw = db = None
        for lo in range(0, n, chunk):
            xc, tc = x[lo : lo + chunk], target[lo : lo + chunk]
            logits = F.linear(xc, weight, bias)
            z = logits.to(logits_dtype)
            valid = tc != ignore_index
            safe = torch.where(valid, tc, 0)
            lse = torch.logsumexp(z, dim=-1)
            picked = z.gather(1, safe.unsqueeze(1)).squeeze(1)
            part = torch.where(valid, lse - picked, 0).sum()
            total = part if total is None else total + part
            if not grads:
                continue
            # d(sum of losses)/dz = softmax(z) - onehot(target), zero on ignored tokens
            dz = torch.exp(z - lse.unsqueeze(1))
            dz = dz.scatter_add(1, safe.unsqueeze(1), -torch.ones_like(lse).unsqueeze(1))
            dz = dz * valid.unsqueeze(1).to(dz.dtype)
            dlogits = dz.to(logits.dtype)
            if want[0]:
                dxs.append(dlogits @ weight)
            if want[1]:
                piece = (dlogits.t() @ xc).to(acc)
                dw = piece if dw is None else dw + piece
            if want[2] and bias is not None:
                piece = dlogits.sum(0).to(acc)
                db = piece if db is None else db + piece
        if total is None:  # no local tokens
            total = x.new_zeros((), dtype=logits_dtype)
        dx = torch.cat(dxs) if dxs else None
        ctx.save_for_backward(
            dx,
            None if dw is None else dw.to(weight.dtype),
            None if db is None else db.to(bias.dtype),
        )
        return total

    @staticmethod
    def backward(ctx, grad_total):
        dx, dw, db = ctx.saved_tensors
        g = grad_total
        out_dx = None if dx is None else dx * g.to(dx.dtype)
        out_dw = None if dw is None else dw * g.to(dw.dtype)
        out_db = None if db is None else db * g.to(db.dtype)
        return out_dx, out_dw, out_db, None, None, None, None


def chunk_tokens(n: int, vocab: int, elements: int) -> int:
    """Tokens per chunk so that one chunk's logits hold about ``elements`` values."""
    return max(1, min(n, elements // max(vocab, 1)))


def sharded_linear_cross_entropy(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    target: torch.Tensor,
    ignore_index: int,
    reduction: str,
    logits_dtype: torch.dtype,
    chunk: int,
    group: str,
    world: int,
    tag: str,
) -> torch.Tensor:
    """``sharded_cross_entropy(F.linear(x, weight, bias).to(logits_dtype), target, None,
    ignore_index, reduction, 0.0, group, world, tag)`` in chunks of ``chunk`` tokens (module
    doc). ``x``: this rank's tokens ``[N, h]``; ``target``: ``[N]``."""
    if reduction not in ("mean", "sum"):
        raise ValueError(f"chunked cross-entropy: reduction {reduction!r} is not 'mean' or 'sum'")
    local = ChunkedLinearCrossEntropy.apply(
        x, weight, bias, target, ignore_index, logits_dtype, chunk
    )
    return reduce_local_loss(local, target, None, ignore_index, reduction, group, world, tag)
