"""What one compile's passes hand to its runtime, owned by the compiled graph.

The pipeline creates one ``RuntimeContext`` per compile (``tspc/pipeline.py``), the rewrites
fill it, and the compiled graph (``tspc/backend.py``'s ``_CompiledTSPGraph``) keeps it for as
long as it can be called: what is in it dies with the graph, not with the process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch


@dataclass
class RuntimeContext:
    # the MLP rings' and the experts' activation chains by key (``runtime/ring_mlp.py``'s
    # ``register_chain``): the graph names a chain by key, this holds the function alive
    chains: dict[str, Callable[..., torch.Tensor]] = field(default_factory=dict)
