"""The ``tspc`` command: ``tspc plan ...`` (memory/communication planner)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"plan": "tspc.plan"}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print(
            "usage: tspc {plan} ...\n\n  plan   per-device memory and communication of DP, TP, SP,"
        )
        print("         TP+SP and TSP for a model and cluster shape")
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\ntspc: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        return 0
    import importlib

    return importlib.import_module(commands[argv[0]]).main(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
