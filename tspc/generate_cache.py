"""The sequence-sharded K/V cache of ``generate()`` (``tspc/generate.py``): ``TSPCache`` holds
this rank's real prompt tokens' keys and values with their true positions, built from the
prefill's ``DynamicCache``. transformers is imported on first use.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from tspc.runtime.decode import owner_of_next
from tspc.runtime.zigzag import padded_length, zigzag_indices


class GenerateUnsupportedError(NotImplementedError):
    """The model (or the generate() options) cannot decode on the TSP shards; says why."""


# What generate.py's routed forward sets for this thread: ``generating`` (a depth count) and
# ``step``, the decode step running now.
DECODE = threading.local()


def current_step():
    """The decode step running on this thread (``decode_attention.py``'s ``DecodeStep``)."""
    step = getattr(DECODE, "step", None)
    if step is None:
        raise RuntimeError(
            "tspc: the sequence-sharded cache was used outside a tspc decode step; call the model "
            "whose forward tspc routes (model.generate after compiling), not the module directly"
        )
    return step


def _cache_classes():
    from transformers.cache_utils import Cache, DynamicLayer

    return Cache, DynamicLayer


def _make_cache_types():
    Cache, DynamicLayer = _cache_classes()

    class TSPCacheLayer(DynamicLayer):
        """This rank's cached tokens of one layer: ``keys``/``values`` [B, H_kv, L_p, d] of every KV
        head, ``positions`` [L_p] their true positions; ``counts`` every rank's token count.
        The sequence length it reports is the whole sequence's (masks and positions are global)."""

        is_croppable = False

        def __init__(self, keys, values, positions, counts, rank, window=None):
            super().__init__()
            self.keys, self.values = keys, values
            self.positions = positions
            self.counts = list(counts)
            self.rank = rank
            self.window = window  # the layer's sliding window (keys), None: full attention
            self.by_heads = False  # held by head groups (``cache_by_heads``), not by tokens
            self.device = keys.device
            self.is_initialized = True

        def get_seq_length(self) -> int:
            return sum(self.counts)

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.get_seq_length() + query_length, 0

        def update(self, key_states, value_states, *args, **kwargs):
            """Called by the attention module with the new token's k, v (its head group): they
            are kept pending; ``decode_attention`` gathers them with q in one collective and
            ``append``s them at their owner. Returns this rank's cached tokens."""
            if key_states.shape[-2] != 1:
                raise GenerateUnsupportedError(
                    f"tspc: {key_states.shape[-2]} new tokens per step on a sequence-sharded cache; "
                    "decoding runs one token per sequence (assisted / speculative decoding and "
                    "chunked prefill are not supported)"
                )
            current_step().touched = True  # (and a clear error outside a decode step)
            self.pending = (key_states, value_states)
            return self.keys, self.values

        def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
            """The new token's K/V of every KV head: cached by its owner rank only."""
            pos = self.get_seq_length()
            if self.window is not None:  # a window cache: the query at pos, and every later
                # one, sees only keys after pos - window (``counts`` keep every token: the
                # sequence length and the owner of the next token do not change)
                seen = self.positions > pos - self.window
                if not bool(seen.all()):
                    self.keys, self.values = self.keys[..., seen, :], self.values[..., seen, :]
                    self.positions = self.positions[seen]
            owner = owner_of_next(self.counts)
            self.counts[owner] += 1
            if owner == self.rank:
                self._keep(keys, values, pos)

        def _keep(self, keys: torch.Tensor, values: torch.Tensor, pos: int) -> None:
            self.keys = torch.cat([self.keys, keys], dim=-2)
            self.values = torch.cat([self.values, values], dim=-2)
            self.positions = torch.cat(
                [self.positions, torch.tensor([pos], device=self.positions.device)]
            )

        def append_by_heads(self, keys: torch.Tensor, values: torch.Tensor) -> None:
            """The new token's K/V of this rank's head group, on a cache held by head groups
            (``cache_by_heads``): every rank keeps it. ``counts`` go on as if the sequence were
            sharded (they give the sequence length; no rank reads them as its own)."""
            pos = self.get_seq_length()
            self.counts[owner_of_next(self.counts)] += 1
            self._keep(keys, values, pos)

        def crop(self, tokens_to_remove: int) -> None:
            raise GenerateUnsupportedError("tspc: a sequence-sharded cache cannot be cropped")

        def batch_repeat_interleave(self, repeats: int) -> None:
            raise GenerateUnsupportedError(
                "tspc: beam search / num_return_sequences > 1 are not supported on a "
                "sequence-sharded cache"
            )

        def batch_select_indices(self, indices) -> None:
            raise GenerateUnsupportedError("tspc: a sequence-sharded cache cannot be re-batched")

        def reorder_cache(self, beam_idx) -> None:
            raise GenerateUnsupportedError("tspc: beam search is not supported")

    class TSPCache(Cache):
        """transformers' ``Cache`` over ``TSPCacheLayer``s: each rank holds its own tokens' K/V."""

        def __init__(self, layers, group: str, world: int, rank: int):
            super().__init__(layers=layers)
            self.group, self.world, self.rank = group, world, rank

        @property
        def is_compileable(self) -> bool:
            return False

        def local_tokens(self) -> int:
            """Tokens of the first layer this rank caches."""
            return self.layers[0].keys.shape[-2]

        def nbytes(self) -> int:
            return sum(
                layer.keys.numel() * layer.keys.element_size()
                + layer.values.numel() * layer.values.element_size()
                for layer in self.layers
            )

    return TSPCacheLayer, TSPCache


_TYPES: dict[str, type] = {}


def _types():
    if not _TYPES:
        _TYPES["layer"], _TYPES["cache"] = _make_cache_types()
    return _TYPES["layer"], _TYPES["cache"]


def tsp_cache_type() -> type:
    """The ``TSPCache`` class (transformers is imported on first use)."""
    return _types()[1]


def layer_windows(config) -> list[int | None]:
    """Each decoder layer's sliding window (None: full attention), as transformers lays out the
    cache of ``config`` (``sliding_window``, or ``layer_types`` mixing sliding and full layers)."""
    from transformers.cache_utils import DynamicCache

    windows = []
    for i, layer in enumerate(DynamicCache(config=config).layers):
        kind = type(layer).__name__
        if "Chunked" in kind:
            raise GenerateUnsupportedError(
                f"tspc: layer {i} attends in chunks ({kind}: attention_chunk_size); decoding on a "
                "sequence-sharded cache supports full attention and sliding windows only"
            )
        windows.append(getattr(layer, "sliding_window", None))
    return windows


def full_prefill_cache(windows: list[int | None]):
    """The cache the prompt fills when a layer has a sliding window: every layer keeps every
    prompt token (transformers' window layer keeps the last ``window - 1`` of whatever tokens it
    is given: on a rank that is the tail of its zigzag shard, padding included, not the tail of
    the prompt), cut to the window by ``cache_from_prefill``. None where no layer has one."""
    if all(w is None for w in windows):
        return None
    from transformers.cache_utils import DynamicCache

    return DynamicCache()


def cache_from_prefill(
    cache,
    prompt_len: int,
    sharded: bool,
    group: str,
    world: int,
    rank: int,
    windows: list[int | None] | None = None,
) -> Any:
    """A ``TSPCache`` from the prefill's ``DynamicCache``: its K/V hold this rank's zigzag tokens
    of the padded prompt (``sharded``), or the whole prompt (gathered; a sliding-window layer of
    transformers: the prompt's last tokens); keep this rank's real tokens the next token can
    see (a layer's ``windows`` entry: its sliding window)."""
    layer_cls, cache_cls = _types()
    P = padded_length(prompt_len, world)
    counts = [int((zigzag_indices(P, r, world) < prompt_len).sum()) for r in range(world)]
    windows = windows or [None] * len(cache.layers)
    layers = []
    for i, layer in enumerate(cache.layers):
        keys, values = layer.keys, layer.values
        pos = zigzag_indices(P, rank, world).to(keys.device)
        window = windows[i] if i < len(windows) else None
        if sharded:
            if keys.shape[-2] != P // world:
                raise RuntimeError(
                    f"tspc: the prefill returned {keys.shape[-2]} cached tokens per rank, "
                    f"expected {P // world} (prompt {prompt_len}, {world} ranks)"
                )
            valid = pos < prompt_len
            keys, values, pos = keys[..., valid, :], values[..., valid, :], pos[valid]
        else:
            # the layer holds the prompt's last ``held`` tokens (all of them, but in a
            # sliding-window layer, which keeps the last window - 1)
            held = keys.shape[-2]
            first = prompt_len - held
            if first < 0 or (first > 0 and getattr(layer, "sliding_window", None) is None):
                raise RuntimeError(
                    f"tspc: layer {i} of the prompt's cache holds {held} tokens of a "
                    f"{prompt_len}-token prompt; expected all of them"
                )
            window = window if window is not None else getattr(layer, "sliding_window", None)
            pos = pos[(pos < prompt_len) & (pos >= first)]
            keys, values = keys.index_select(-2, pos - first), values.index_select(-2, pos - first)
        if window is not None:  # the next token (at prompt_len) sees keys after prompt_len - window
            seen = pos > prompt_len - window
            keys, values, pos = keys[..., seen, :], values[..., seen, :], pos[seen]
        layers.append(layer_cls(keys.contiguous(), values.contiguous(), pos, counts, rank, window))
    return cache_cls(layers, group, world, rank)


def cache_by_heads(layer, comm, tag: str) -> None:
    """Re-lay one layer's sequence-sharded cache (this rank's tokens, every KV head) as a cache
    of this rank's KV head group with every token: one all-to-all of the keys, one of the
    values (each rank's part padded to the longest rank's), one all-gather of the positions.
    Each rank keeps 1/D of the cache before and after (``decode_layout="heads"``)."""
    D = comm.world
    B, H, L, d = layer.keys.shape
    group = H // D
    lengths = [int(n) for n in comm.all_gather(torch.tensor([L]), tag)]
    longest = max(lengths)

    def exchange(t: torch.Tensor) -> torch.Tensor:
        padded = torch.nn.functional.pad(t, (0, 0, 0, longest - L))  # [B, H, longest, d]
        parts = padded.reshape(B, D, group, longest, d).transpose(0, 1)  # part j: group j
        got = comm.all_to_all(parts, tag)  # [D, B, group, longest, d]: rank s's tokens
        return torch.cat([got[s, :, :, : lengths[s]] for s in range(D)], dim=2)

    keys, values = exchange(layer.keys), exchange(layer.values)
    pos = torch.nn.functional.pad(layer.positions, (0, longest - L))
    every = comm.all_gather(pos, tag)
    layer.positions = torch.cat([every[s][: lengths[s]] for s in range(D)])
    layer.keys, layer.values = keys.contiguous(), values.contiguous()
    layer.by_heads = True
