"""``written_copy``: an in-place write replayed on a copy, as one pure call in a graph.

``passes/functionalize_writes.py`` turns a write into a tensor the graph built (``h[:, 1:] =
x[:, :-1]``, ``y.transpose(0, 1)[0].mul_(2)``) into a call of this function: the passes then
see a value that depends on its inputs only, and torch itself runs the write — the same views,
the same in-place op, so the same values, dtype casts and broadcasting — on a clone. Traced by
aot_autograd like any Python function (clone, views, one in-place op, which it functionalizes).
"""

from __future__ import annotations

from typing import Any

import torch

# One step: a Tensor method's name, its positional arguments after ``self``, its keywords.
Step = tuple[str, tuple, dict]


def _call(obj: Any, step: Step) -> Any:
    name, args, kwargs = step
    return getattr(obj, name)(*args, **kwargs)


def written_copy(base: torch.Tensor, views: tuple[Step, ...], write: Step) -> torch.Tensor:
    """A clone of ``base`` after ``write`` on the view ``views`` select of it:
    ``written_copy(x, (("__getitem__", (idx,), {}),), ("fill_", (0.0,), {}))`` is ``x`` with
    ``x[idx].fill_(0.0)`` done to a copy. ``base`` itself is not changed."""
    out = base.clone()
    target = out
    for step in views:
        target = _call(target, step)
    _call(target, write)
    return out
