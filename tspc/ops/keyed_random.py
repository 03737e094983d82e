"""Random numbers keyed by position: the same draw for an element whichever rank holds it.

torch's generators are sequential: ``dropout(x)`` on a rank's slice of the tokens draws from the
generator's current state, so a token's mask depends on which rank holds it and on how many
tokens precede it there. At D = 2 every rank draws from the same state, so rank 0's tokens and
rank 1's get identical masks (correlated), and the numbers change with D.

Here an element's draw is a hash of (a per-call seed, the op's key in the graph, the element's
*global* flat index): row-major over the unsharded shape, with the sharded dimension's index
replaced by the element's global position along it (``positions``, the zigzag layout's, padding
included). A rank draws only its own elements, and each element gets the same number at every
D — a counter-based generator (the idea of Philox, as DTensor's offset-based RNG tracker does for
CUDA), written in plain integer tensor ops so it runs wherever torch runs (CPU, CUDA).

The hash: each 32-bit word goes through a 32-bit integer finaliser (xor-shift, multiply,
xor-shift, multiply, xor-shift; the "lowbias32" construction, with multipliers below 2**31 so
every product fits an int64 without overflow). The seed's two words and the key make a base
value; the flat index's low and high words are mixed into it one after the other. A uniform
takes the top 24 bits (a float32 in [0, 1)); a normal is Box-Muller over two such words.

``keyed_dropout`` is ``x * (u >= p) / (1 - p)``: linear in ``x`` with a mask that the same
arguments regenerate, so its backward is ``keyed_dropout`` of the gradient — no mask is saved and
the partitioner may recompute it freely (it is not a random op to torch: it is a pure function of
its inputs).
"""

from __future__ import annotations

import math

import torch

_M32 = 0xFFFFFFFF
_MUL1 = 0x7FEB352D
_MUL2 = 0x2C1B3C6D  # odd, < 2**31: (2**32 - 1) * _MUL < 2**63
_GOLDEN = 0x9E3779B9
_STREAM2 = 0x68E31DA4  # the second word of a normal draw
SEED_TAG = "rng_seed"  # the tag of the seed's broadcast (passes/keyed_random.py)


def _mix(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit finaliser over int64 tensors holding values in [0, 2**32)."""
    h = h ^ (h >> 16)
    h = (h * _MUL1) & _M32
    h = h ^ (h >> 15)
    h = (h * _MUL2) & _M32
    return h ^ (h >> 16)


def flat_index(
    shape: list[int], dim: int, positions: torch.Tensor | None, global_size: int, device
) -> torch.Tensor:
    """Every element's flat index in the *global* tensor (int64, broadcast to ``shape``): the
    row-major index over ``shape`` with dimension ``dim`` of size ``global_size`` and this
    tensor's entries along it at ``positions`` (None: the tensor is the global one)."""
    nd = len(shape)
    gshape = list(shape)
    if positions is not None:
        gshape[dim] = global_size
    flat = torch.zeros((), dtype=torch.int64, device=device)
    stride = 1
    for k in range(nd - 1, -1, -1):
        if positions is not None and k == dim:
            idx = positions.to(device=device, dtype=torch.int64)
        else:
            idx = torch.arange(shape[k], dtype=torch.int64, device=device)
        view = [1] * nd
        view[k] = -1
        flat = flat + (idx * stride).view(view)
        stride *= gshape[k]
    return flat.expand(shape)


def _words(
    like: torch.Tensor,
    seed: torch.Tensor,
    key: int,
    dim: int,
    positions: torch.Tensor | None,
    global_size: int,
) -> torch.Tensor:
    """One hashed 32-bit word per element of ``like`` (int64 in [0, 2**32))."""
    s = seed.to(device=like.device, dtype=torch.int64) & _M32
    base = _mix(_mix(s[0] ^ ((key * _GOLDEN + 1) & _M32)) ^ s[1])
    flat = flat_index(list(like.shape), dim, positions, global_size, like.device)
    h = _mix(base ^ (flat & _M32))
    return _mix(h ^ ((flat >> 32) + _GOLDEN) & _M32)


def _uniform(words: torch.Tensor) -> torch.Tensor:
    return (words >> 8).to(torch.float32) * (1.0 / (1 << 24))  # [0, 1), 24 bits


def keyed_draw(
    like: torch.Tensor,
    seed: torch.Tensor,
    key: int,
    normal: bool,
    dim: int = 0,
    positions: torch.Tensor | None = None,
    global_size: int = 0,
) -> torch.Tensor:
    """Uniform [0, 1) (or standard normal) float32 numbers shaped like ``like``, keyed by
    (``seed``, ``key``, each element's global flat index)."""
    w = _words(like, seed, key, dim, positions, global_size)
    if not normal:
        return _uniform(w)
    u1 = ((w >> 8) + 1).to(torch.float32) * (1.0 / (1 << 24))  # (0, 1]: log is finite
    u2 = _uniform(_mix(w ^ _STREAM2))
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2 * math.pi) * u2)


@torch.library.custom_op("tspc::keyed_rand", mutates_args=())
def keyed_rand(
    like: torch.Tensor,
    seed: torch.Tensor,
    key: int,
    normal: bool,
    dim: int,
    positions: torch.Tensor | None,
    global_size: int,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``rand_like(like)`` / ``randn_like(like)`` keyed by position (module docstring)."""
    out = keyed_draw(like, seed, key, normal, dim, positions, global_size)
    return out.to(dtype or like.dtype)


@keyed_rand.register_fake
def _keyed_rand_fake(like, seed, key, normal, dim, positions, global_size, dtype=None):
    return torch.empty_like(like, dtype=dtype or like.dtype)


def _no_grad_setup(ctx, inputs, output):
    ctx.n = len(inputs)


def _no_grad_backward(ctx, grad):
    return (None,) * ctx.n  # random numbers do not depend on ``like``'s values


torch.library.register_autograd("tspc::keyed_rand", _no_grad_backward, setup_context=_no_grad_setup)


@torch.library.custom_op("tspc::keyed_dropout", mutates_args=())
def keyed_dropout(
    x: torch.Tensor,
    seed: torch.Tensor,
    key: int,
    p: float,
    dim: int,
    positions: torch.Tensor | None,
    global_size: int,
) -> torch.Tensor:
    """``dropout(x, p, training=True)`` with the keep mask keyed by position: ``u >= p``."""
    keep = keyed_draw(x, seed, key, False, dim, positions, global_size) >= p
    return (x * keep) * (1.0 / (1.0 - p))  # the scale a Python number: not rounded to x's dtype


@keyed_dropout.register_fake
def _keyed_dropout_fake(x, seed, key, p, dim, positions, global_size):
    return torch.empty_like(x)


def _dropout_setup(ctx, inputs, output):
    _, seed, ctx.key, ctx.p, ctx.dim, positions, ctx.global_size = inputs
    ctx.save_for_backward(seed, positions)


def _dropout_backward(ctx, grad):
    seed, positions = ctx.saved_tensors
    g = keyed_dropout(grad, seed, ctx.key, ctx.p, ctx.dim, positions, ctx.global_size)
    return g, None, None, None, None, None, None


torch.library.register_autograd(
    "tspc::keyed_dropout", _dropout_backward, setup_context=_dropout_setup
)
