"""Pass: the language-model head and its cross-entropy in token chunks (no ``tokens x vocab``
tensor saved for the backward).

After ``shard_sequence`` a token-level loss is one ``sharded_cross_entropy(logits, target, ...)``
call on this rank's tokens. When its logits are a ``linear(x, W, b)`` (``W`` ``[V, h]``) seen
through views that only merge leading dims and dtype casts (``.float()``: the reference model's
and transformers' spelling), or a ``log_softmax`` of that over the vocabulary feeding
``nll_loss``, and nothing else reads the logits, the pass replaces linear, casts, views and loss
by one ``sharded_linear_cross_entropy(x2d, W, b, target, ...)`` (``runtime/chunked_loss.py``):
the local tokens ``chunk`` at a time, each chunk's loss and gradients computed in the forward.
The ``[N, V]`` log-softmax aot_autograd would otherwise save (1.05 GB per rank for the 7B model
at 128K tokens on 8 ranks in bf16) is gone, and no chunk's logits outlive the chunk.

Handled: ``reduction`` "mean" or "sum", any ``ignore_index``, no class weights, no label
smoothing (other calls are left as they are, with a note). Chunks hold about ``CHUNK_ELEMENTS``
logits (``options={"loss_chunk": tokens}`` sets the tokens per chunk; 0 turns the pass off).
"""

from __future__ import annotations

import math

import torch
import torch.fx as fx

from tspc.runtime.chunked_loss import chunk_tokens, sharded_linear_cross_entropy
from tspc.runtime.seq_reductions import sharded_cross_entropy

from .graph_utils import arg, op_name, set_fake_value, shape, tensor_val

# Logits per chunk (fp32: 32 MB): at a 32K vocabulary, 256 tokens a chunk.
CHUNK_ELEMENTS = 1 << 23

_THROUGH = frozenset({"flatten", "view", "reshape", "contiguous", "float", "to", "type"})
_LOG_SOFTMAX = frozenset({"log_softmax", "_log_softmax"})


def _single_input(n: fx.Node) -> fx.Node | None:
    ins = [a for a in n.all_input_nodes if tensor_val(a) is not None]
    return ins[0] if len(ins) == 1 else None


def _head_of(logits: fx.Node, vocab: int, nll: bool) -> tuple[fx.Node | None, list[fx.Node], str]:
    """The ``linear`` behind ``logits`` and the nodes between (logits first), or a reason. For
    ``nll_loss`` (``nll``) exactly one ``log_softmax`` over the vocabulary must be among them."""
    chain, n = [], logits
    log_softmax = None
    while True:
        if len(n.users) != 1:
            return None, chain, f"{n.name} is read by {len(n.users)} nodes"
        name = op_name(n)
        if name == "linear" and n.op == "call_function":
            x, w = n.args[0], arg(n, 1, "weight")
            if (
                isinstance(x, fx.Node)
                and isinstance(w, fx.Node)
                and len(shape(w)) == 2
                and shape(w)[0] == vocab
                and shape(x)[-1] == shape(w)[1]
            ):
                if nll and log_softmax is None:
                    return None, chain, "nll_loss not of a log_softmax over the vocabulary"
                chain.append(n)
                return n, chain, ""
            return None, chain, f"{n.name}: a linear that is not [tokens, h] x [V, h]"
        if nll and log_softmax is None and name in _LOG_SOFTMAX:
            dim = arg(n, 1, "dim")
            if dim not in (-1, len(shape(n)) - 1):
                return None, chain, f"{n.name}: a log_softmax over dim {dim}, not the vocabulary"
            log_softmax = n
        elif name not in _THROUGH:
            return None, chain, f"{n.name} ({name}) between the head and the loss"
        if not shape(n) or shape(n)[-1] != vocab:
            return None, chain, f"{n.name} changes the vocabulary dim"
        src = _single_input(n)
        if src is None:
            return None, chain, f"{n.name} has more than one tensor input"
        chain.append(n)
        n = src


def chunk_loss(gm: fx.GraphModule, chunk: int | None = None) -> list[str]:
    """Rewrite each head + sharded cross-entropy of ``gm`` (module doc). ``chunk``: tokens per
    chunk (None: about ``CHUNK_ELEMENTS`` logits a chunk; 0: do nothing). Returns notes."""
    if chunk == 0:
        return []
    notes = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not sharded_cross_entropy:
            continue
        (logits, target, weight, ignore_index, reduction, smoothing, group, world, tag, nll) = (
            node.args
        )
        why = ""
        if weight is not None or smoothing:
            why = "class weights or label smoothing"
        elif reduction not in ("mean", "sum"):
            why = f"reduction {reduction!r}"
        elif not isinstance(logits, fx.Node) or len(shape(logits)) != 2:
            why = "logits are not [tokens, vocab]"
        if why:
            notes.append(f"loss {node.name} not chunked: {why}")
            continue
        vocab = shape(logits)[1]
        head, chain, why = _head_of(logits, vocab, nll)
        if head is None:
            notes.append(f"loss {node.name} not chunked: {why}")
            continue
        lead = shape(head)[:-1]
        n_tokens = math.prod(lead)
        if n_tokens != shape(logits)[0]:
            notes.append(f"loss {node.name} not chunked: the views do not merge leading dims")
            continue
        x, w, b = head.args[0], arg(head, 1, "weight"), arg(head, 2, "bias")
        hidden = shape(w)[1]
        dtype = tensor_val(logits).dtype
        per = chunk if chunk else chunk_tokens(n_tokens, vocab, CHUNK_ELEMENTS)
        with gm.graph.inserting_before(node):
            x2 = gm.graph.call_function(torch.reshape, (x, (n_tokens, hidden)))
            loss = gm.graph.call_function(
                sharded_linear_cross_entropy,
                (x2, w, b, target, ignore_index, reduction, dtype, per, group, world, tag),
            )
        for new in (x2, loss):
            new.meta.update({k: v for k, v in node.meta.items() if k not in ("val",)})
            set_fake_value(new)
        node.replace_all_uses_with(loss)
        for dead in [node, *chain]:
            gm.graph.erase_node(dead)
        chunks = -(-n_tokens // per)
        notes.append(
            f"loss {node.name}: head {head.name} and cross-entropy in {chunks} chunk(s) of "
            f"{per} tokens (no [{n_tokens}, {vocab}] logits saved)"
        )
    if notes:
        gm.recompile()
    return notes
