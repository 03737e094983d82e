"""What a user can change when a matched attention or MLP is held whole on every rank.

A module the schedules cannot cut for this D runs unsharded: its weights, gradients and
optimizer state take their full size on every rank. When the reason is a count that D does not
fit (attention heads, key/value heads, the MLP's intermediate size), the fix is another D; these
helpers say which ones fit, for the report and the compile-time warning (``tspc/backend.py``).
"""

from __future__ import annotations

# Divisors listed in a message: enough to choose from, never a wall of numbers.
_LISTED = 12


def _listed(values: list[int]) -> str:
    shown = ", ".join(str(v) for v in values[:_LISTED])
    return shown + (", ..." if len(values) > _LISTED else "")


def heads_fix(q_heads: int, kv_heads: int) -> str:
    """The D values whose head groups the attention schedule can cut."""
    fits = [
        d
        for d in range(1, q_heads + 1)
        if q_heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0)
    ]
    return (
        f"use a TSP group size D that divides its {q_heads} query heads and divides or is a "
        f"multiple of its {kv_heads} key/value heads: {_listed(fits)}"
    )


def size_fix(what: str, size: int) -> str:
    """The D values that divide ``size`` (an MLP's intermediate size)."""
    fits = [d for d in range(1, size + 1) if size % d == 0]
    return f"use a TSP group size D that divides its {what} {size}: {_listed(fits)}"


def kv_heads_fix(kv_heads: int) -> str:
    """K/V projections held whole because there are fewer KV heads than ranks."""
    fits = [d for d in range(1, kv_heads + 1) if kv_heads % d == 0]
    return (
        f"a D that divides its {kv_heads} key/value heads ({_listed(fits)}) shards them; "
        "larger D still shards the query and output projections"
    )
