"""The zigzag layout of a sequence over D ranks.

The sequence is cut into 2D equal chunks; rank p holds chunks p and 2D-1-p, in that order.
Causal attention then costs the same on every rank: an early chunk (few keys) is paired with a
late one (many keys).

A sharded dimension may also hold the sequence merged with other dimensions, as after
``x.view(B * S, h)``: its size is ``outer * n * inner`` (row-major) and the zigzag cut applies to
the ``n`` factor. Every function here takes ``(dim, outer, inner)`` for that reason; the common
case is ``outer = inner = 1``.

A length that does not split into 2D chunks is *padded* to the next multiple of 2D
(``padded_length``): the padding tokens are the last chunks of the sequence, so rank 0's second
chunk (the last one) takes them first. ``zigzag_slice(..., padded=P)`` cuts a replicated tensor
as if it had ``P`` tokens, the extra ones copies of its last token (so they hold values a real
token holds: valid indices, finite numbers, a mask row that sees some key);
``drop_padding`` cuts a gathered tensor back to its true length, and ``fill_padding`` /
``local_valid`` tell the padding apart in a local shard, for sums and losses over tokens.

These are plain tensor functions (narrow / cat), so they trace into graphs, differentiate, and
cost no communication.
"""

from __future__ import annotations

import torch

from .errors import SequenceLengthError

# BOOL_THROUGH_UINT8: the cats that cut, pad or reorder a bool tensor (a mask) run on uint8 and
# compare back. Inductor (torch 2.13, CPU) may hold a bool value computed from integers as an
# int64 buffer; a cat of that buffer then feeds a vectorised ``where`` an int64 mask, which its
# code generation rejects (Llama-4's chunked mask under left padding: sliced by the SDPA path,
# all-gathered and put back in order by the eager one). The comparison gives Inductor a bool
# buffer again; the values are the same.


def check_divisible(n: int, world: int, what: str = "sequence length") -> int:
    """Chunk length of the zigzag cut; a clear error when ``n`` does not split into 2D chunks."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    if n % (2 * world) != 0:
        raise SequenceLengthError(
            f"{what} {n} is not divisible by 2*D = {2 * world} (D = {world} ranks): the zigzag "
            f"layout cuts it into 2D equal chunks. Pad the {what} to a multiple of {2 * world} "
            f"(and mask the padding), or use a D that divides it."
        )
    return n // (2 * world)


def padded_length(n: int, world: int) -> int:
    """The smallest length of at least ``n`` that splits into 2D equal chunks (``n`` itself
    when it already does)."""
    two_d = 2 * world
    return max(1, -(-n // two_d)) * two_d


def zigzag_chunk_ids(rank: int, world: int) -> tuple[int, int]:
    """The two chunk indices (of 2D) that ``rank`` holds, in local order."""
    return rank, 2 * world - 1 - rank


def zigzag_indices(n: int, rank: int, world: int) -> torch.Tensor:
    """True positions of this rank's local tokens, in local order (a LongTensor of n/D)."""
    c = check_divisible(n, world)
    a, b = zigzag_chunk_ids(rank, world)
    return torch.cat([torch.arange(a * c, (a + 1) * c), torch.arange(b * c, (b + 1) * c)])


def _split3(x: torch.Tensor, dim: int, outer: int, inner: int) -> tuple[torch.Tensor, int]:
    dim = dim % x.dim()
    size = x.shape[dim]
    n = size // (outer * inner)
    if n * outer * inner != size:
        raise ValueError(f"dim {dim} of size {size} is not outer={outer} x n x inner={inner}")
    return x.unflatten(dim, (outer, n, inner)), dim


def zigzag_slice(
    x: torch.Tensor,
    dim: int,
    rank: int,
    world: int,
    outer: int = 1,
    inner: int = 1,
    padded: int | None = None,
) -> torch.Tensor:
    """This rank's zigzag part of a full (replicated) tensor along ``dim``.

    With ``padded`` (a multiple of 2D), a shorter sequence is first extended to that length
    with copies of its last token."""
    if world == 1:
        return x
    if x.dtype == torch.bool:  # through uint8 (BOOL_THROUGH_UINT8)
        return zigzag_slice(x.to(torch.uint8), dim, rank, world, outer, inner, padded) != 0
    y, dim = _split3(x, dim, outer, inner)
    n = y.shape[dim + 1]
    if padded is not None and padded > n:
        last = y.narrow(dim + 1, n - 1, 1)
        extra = list(y.shape)
        extra[dim + 1] = padded - n
        y = torch.cat([y, last.expand(extra)], dim + 1)
        n = padded
    c = check_divisible(n, world)
    a, b = zigzag_chunk_ids(rank, world)
    local = torch.cat([y.narrow(dim + 1, a * c, c), y.narrow(dim + 1, b * c, c)], dim + 1)
    return local.flatten(dim, dim + 2)


def zigzag_unshard(
    gathered: torch.Tensor, dim: int, world: int, outer: int = 1, inner: int = 1
) -> torch.Tensor:
    """Put an all-gathered tensor back into true order.

    ``gathered`` has a leading rank dimension of size D followed by each rank's local tensor;
    the result has ``dim`` (of the local tensor) D times larger, in true token order.
    """
    if world == 1:
        return gathered[0]
    if gathered.dtype == torch.bool:  # through uint8 (BOOL_THROUGH_UINT8)
        return zigzag_unshard(gathered.to(torch.uint8), dim, world, outer, inner) != 0
    parts, ldim = _split3(gathered, dim + 1 if dim >= 0 else dim, outer, inner)
    # parts: [D, ..., outer, 2c, inner, ...] with the chunk pair at ldim + 1; once ``unbind``
    # drops D, each rank's pair is at ldim. True order: every rank's first chunk, rank by rank,
    # then every rank's second chunk, last rank first. ``unbind`` and ``split`` rather than an
    # index and a slice per chunk: their gradients are one ``stack`` and one ``cat``, where
    # those of indexing and slicing each fill a zero tensor of the gathered size, summed after.
    c = parts.shape[ldim + 1] // 2
    firsts, seconds = zip(*(part.split(c, ldim) for part in parts.unbind(0)))
    full = torch.cat([*firsts, *reversed(seconds)], ldim)
    return full.flatten(ldim - 1, ldim + 1)


def zigzag_stack_parts(
    full: torch.Tensor, dim: int, world: int, outer: int = 1, inner: int = 1
) -> torch.Tensor:
    """The inverse of ``zigzag_unshard``: ``[D, *local]`` with every rank's part of ``full``."""
    if full.dtype == torch.bool:  # through uint8 (BOOL_THROUGH_UINT8)
        return zigzag_stack_parts(full.to(torch.uint8), dim, world, outer, inner) != 0
    return torch.stack(
        [zigzag_slice(full, dim, r, world, outer, inner) for r in range(world)], dim=0
    )


def drop_padding(x: torch.Tensor, dim: int, outer: int, inner: int, n: int) -> torch.Tensor:
    """The first ``n`` tokens of a true-order tensor that holds a padded sequence along ``dim``
    (the padding is at the end)."""
    y, dim = _split3(x, dim, outer, inner)
    if y.shape[dim + 1] == n:
        return x
    return y.narrow(dim + 1, 0, n).flatten(dim, dim + 2)


def local_valid(n: int, rank: int, world: int, device=None) -> torch.Tensor:
    """[P/D] bool: which of this rank's local tokens (of a sequence of true length ``n``,
    padded to ``padded_length(n, world)``) are real."""
    p = padded_length(n, world)
    return zigzag_indices(p, rank, world).to(device) < n


def fill_padding(
    x: torch.Tensor,
    dim: int,
    outer: int,
    inner: int,
    n: int,
    rank: int,
    world: int,
    value: float = 0,
) -> torch.Tensor:
    """A local shard with its padding tokens set to ``value`` (real tokens untouched): 0 before
    a sum over tokens, a loss's ``ignore_index`` for its targets. ``where``, not a product:
    whatever a padding token holds, it contributes nothing, not even a NaN."""
    y, d = _split3(x, dim, outer, inner)
    valid = local_valid(n, rank, world, x.device)
    shape = [1] * y.dim()
    shape[d + 1] = valid.numel()
    fill = torch.full((), value, dtype=y.dtype, device=y.device)
    return torch.where(valid.view(shape), y, fill).flatten(d, d + 2)
