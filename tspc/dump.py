"""Write what the compiler did to a directory: graphs after each pass and the match report.

Layout: ``DIR/rank<r>/graph<id>/NN_<pass>.py`` (readable Python of the graph after each pass),
``forward_<k>.py`` / ``backward_<k>.py`` (the graphs aot_autograd produced, after scheduling),
and ``report.json``.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tspc.runtime.group import TSPGroup

    from .inner import AotGraphs
    from .pipeline import PipelineResult


def write_dump(root: str, result: PipelineResult, graphs: AotGraphs, group: TSPGroup) -> str:
    d = os.path.join(root, f"rank{group.rank}", f"graph{result.report.graph_id}")
    os.makedirs(d, exist_ok=True)
    for i, (name, code) in enumerate(result.snapshots):
        with open(os.path.join(d, f"{i:02d}_{name}.py"), "w") as f:
            f.write(code)
    with open(os.path.join(d, "report.json"), "w") as f:
        json.dump(result.report.to_dict(), f, indent=2, default=str)
    return d


def write_aot_graphs(directory: str, graphs: AotGraphs) -> None:
    for kind, codes in (("forward", graphs.forward), ("backward", graphs.backward)):
        for i, code in enumerate(codes):
            with open(os.path.join(directory, f"{kind}_{i}.py"), "w") as f:
                f.write(code)
