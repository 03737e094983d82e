"""A prompt's inputs padded to a bucket, so a serving loop compiles a few prefill programs, not one per prompt.

A compiled TSP program serves every length of its family (``tspc/length_family.py``) only at
lengths that are multiples of 2D and at the batch size it was compiled for. Before the prompt
runs, ``generate``'s prefill pads it (``bucket_prompt``), as vLLM pads a batch to a CUDA-graph
capture size:

* **length** to the next multiple of 2D, on the right: pad tokens come after every real token,
  and the model is causal, so no real token's hidden state, K/V or logit depends on them
  (``generate`` runs decoders only). The attention mask is extended with ones (a prompt with no
  padding keeps a mask of all ones: the same graph), position ids and cache positions continue
  counting. The pad's K/V are dropped from the cache (``trim_prefill_output``, and
  ``cache_from_prefill`` for the sharded cache, which already drops the positions past the
  prompt), the pad's logits are never returned.
* **batch** to the next power of two, with copies of the first row, dropped from every output.
* the sequence dims are marked dynamic (``maybe_mark_dynamic``), so Dynamo's first trace is
  symbolic in the length and its first compile is already the family's program; the batch dim
  is marked static, so each batch bucket is one Dynamo graph with one program.
* ``logits_to_keep=k`` becomes ``k + 2D - 1`` (one value whatever the pad: an int Dynamo sees
  change would be one more trace), and the ``k`` real positions are cut out of them.

Only the inputs ``generate`` gives a decoder's prefill are padded (``input_ids``,
``attention_mask``, ``position_ids``, ``cache_position``, ``token_type_ids``); a call with any
other tensor, a positional tensor beyond the ids, embeddings instead of ids, or asking for hidden
states or attentions (whose shapes the caller reads) runs unpadded, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tspc.runtime.compat import mark_static, maybe_mark_dynamic
from tspc.runtime.zigzag import padded_length

__all__ = ["PromptBucket", "bucket_prompt", "trim_prefill_output"]

# how each padded input grows along the sequence: the pad token (any id: no real token sees
# it), a mask of ones, positions that go on counting, the last row's type
_SEQUENCE_INPUTS = ("input_ids", "attention_mask", "position_ids", "token_type_ids")
_OTHER_KNOWN = {"cache_position", "logits_to_keep", "use_cache", "return_dict"}
_OUTPUTS_READ_BY_SHAPE = ("output_hidden_states", "output_attentions")


@dataclass(frozen=True)
class PromptBucket:
    """What ``bucket_prompt`` did: the prompt's real batch and length, the padded ones, and
    the logits the caller asked for (``keep``: None for all of them)."""

    batch: int
    length: int
    padded_batch: int
    padded_length: int
    keep: int | None

    @property
    def padded(self) -> bool:
        return (self.padded_batch, self.padded_length) != (self.batch, self.length)


def _bucket_batch(b: int) -> int:
    return 1 << max(0, (b - 1).bit_length())


def _grow(name: str, t: torch.Tensor, batch: int, length: int) -> torch.Tensor:
    """``t`` ([batch, seq] or, for cache_position, [seq]) padded to ``batch`` rows and
    ``length`` positions."""
    if name == "cache_position":
        return torch.cat([t, t[-1] + torch.arange(1, length - t.shape[0] + 1, device=t.device)])
    extra = length - t.shape[1]
    if extra:
        if name == "attention_mask":
            tail = torch.ones(t.shape[0], extra, dtype=t.dtype, device=t.device)
        elif name == "position_ids":
            tail = t[:, -1:] + torch.arange(1, extra + 1, dtype=t.dtype, device=t.device)
        else:  # ids, token types: the last one again
            tail = t[:, -1:].expand(-1, extra)
        t = torch.cat([t, tail], dim=1)
    if batch > t.shape[0]:
        t = torch.cat([t, t[:1].expand(batch - t.shape[0], -1)], dim=0)
    return t.contiguous()


def bucket_prompt(args: tuple, kwargs: dict, world: int) -> tuple[tuple, dict, PromptBucket | None]:
    """The prefill call's inputs padded to their bucket (module docstring), and what was done;
    ``(args, kwargs, None)`` unchanged when the call is not one this pads."""
    if len(args) > 1 or any(kwargs.get(k) for k in _OUTPUTS_READ_BY_SHAPE):
        return args, kwargs, None
    kw = dict(kwargs)
    if args:
        if "input_ids" in kw:
            return args, kwargs, None
        kw["input_ids"] = args[0]
    ids = kw.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return args, kwargs, None
    batch, length = ids.shape
    for k, v in kw.items():
        if isinstance(v, torch.Tensor) and k not in _SEQUENCE_INPUTS and k not in _OTHER_KNOWN:
            return args, kwargs, None  # a tensor whose layout this does not know
        if k in _SEQUENCE_INPUTS and v is not None and tuple(v.shape) != (batch, length):
            return args, kwargs, None
    position = kw.get("cache_position")
    if position is not None and (position.dim() != 1 or position.shape[0] != length):
        return args, kwargs, None
    keep = kw.get("logits_to_keep")
    if isinstance(keep, torch.Tensor) or (keep is not None and not isinstance(keep, int)):
        return args, kwargs, None
    keep = keep if keep else None  # 0: every position's logits
    padded = padded_length(length, world)
    wider = keep + 2 * world - 1 if keep is not None else None
    if wider is not None and (wider > padded or wider == padded and length >= world):
        # many logits asked for, or a prompt of D to 2D tokens: runs unpadded. Kept logits
        # spanning the whole bucket came back from the length family's program with another
        # rank's positions in them (at 3 or 4 tokens on 2 ranks, rank 1's last logit was
        # another token's; found by a probe of generate with short prompts). Fewer tokens than
        # ranks stay bucketed: the unpadded prefill cannot give every rank a cached token.
        return args, kwargs, None
    bucket = PromptBucket(batch, length, _bucket_batch(batch), padded, keep)
    for k in (*_SEQUENCE_INPUTS, "cache_position"):
        v = kw.get(k)
        if v is None:
            continue
        v = _grow(k, v, bucket.padded_batch, padded)
        maybe_mark_dynamic(v, v.dim() - 1)  # the sequence dim: one trace for every length
        if v.dim() == 2:
            # the batch stays a constant: each bucket its own Dynamo graph and program (a
            # graph symbolic in the batch would catch every bucket and compile each again)
            mark_static(v, 0)
        kw[k] = v
    if keep is not None:
        kw["logits_to_keep"] = wider
    return (), kw, bucket


def _trim_cache(cache: Any, bucket: PromptBucket, seq_too: bool) -> None:
    for layer in getattr(cache, "layers", ()):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if not isinstance(t, torch.Tensor):
                continue
            t = t[: bucket.batch]
            if seq_too:
                t = t[..., : bucket.length, :]
            setattr(layer, name, t)


def trim_prefill_output(out: Any, bucket: PromptBucket, cache_name: str, sharded: bool) -> Any:
    """The prefill's output as the unpadded prompt's: the padded rows dropped everywhere, the
    pad positions' logits dropped and, for a gathered cache (``sharded`` False: every position
    on every rank), their K/V (a sharded cache is cut by ``cache_from_prefill``)."""
    logits = out["logits"]
    logits = logits[: bucket.batch]
    if bucket.keep is None:
        logits = logits[:, : bucket.length]
    else:  # positions P - (keep + 2D - 1) .. P - 1 came back; the real last ``keep`` of them
        first = logits.shape[1] - (bucket.padded_length - bucket.length) - bucket.keep
        logits = logits[:, first : first + bucket.keep]
    out["logits"] = logits
    _trim_cache(out[cache_name], bucket, seq_too=not sharded)
    return out
