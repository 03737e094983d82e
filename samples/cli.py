"""The command line the samples (and ``bench/inference.py``) share: integer options with defaults."""

from __future__ import annotations

import argparse


def parser_with(description: str, **int_options: int) -> argparse.ArgumentParser:
    """An ``ArgumentParser`` (the description printed as written) with one integer option per
    keyword, in order: ``kv_heads=4`` is ``--kv-heads``, default 4; ``world_size`` also answers
    to ``-D``. The caller adds any other option."""
    parser = argparse.ArgumentParser(
        description=description, formatter_class=argparse.RawTextHelpFormatter
    )
    for name, default in int_options.items():
        flags = ["--" + name.replace("_", "-")] + (["-D"] if name == "world_size" else [])
        parser.add_argument(*flags, type=int, default=default, help=f"(default {default})")
    return parser
