"""The ``tspc`` command: ``tspc plan ...`` (memory/communication planner) and ``tspc dump ...``
(what the compiler does to a model, for rank r of D, without a process group)."""

from __future__ import annotations

import sys
import textwrap

COMMANDS = {
    "plan": (
        "tspc.tools.plan",
        "per-device memory and communication of DP, TP, SP, TP+SP and TSP for a model and "
        "cluster shape",
    ),
    "dump": (
        "tspc.tools.dump_cli",
        "the graphs after each pass, the matched layers, the collectives and a picture of the "
        "schedule for rank r of D (graph-only)",
    ),
}


def _usage() -> str:
    lines = [f"usage: tspc {{{','.join(COMMANDS)}}} ...", ""]
    for name, (_, help_) in COMMANDS.items():
        wrapped = textwrap.wrap(help_, 70)
        lines.append(f"  {name:6s} {wrapped[0]}")
        lines += [f"         {more}" for more in wrapped[1:]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(_usage())
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\ntspc: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0
    import importlib

    return importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
