"""The README and docs/ cannot rot: every code block and command in them runs in a test.

Each fenced block of ``README.md`` and ``docs/*.md`` is one of:

* ``python`` with no marker: run here, as a script in a fresh process that is rank 0 of a
  one-rank gloo group (what ``torchrun --nproc-per-node 1`` gives it);
* a block preceded by ``<!-- test: run -->``: run here (``bash`` blocks by bash, in the
  repository, with this virtual environment first on ``PATH``);
* a block preceded by ``<!-- test: tests/test_x.py::test_name -->``: a fragment (it needs a
  model, data or a GPU from around it) that the named test runs the same way; the test must
  exist;
* ``text`` (or no language): output or a diagram, which runs nothing.

A ``python``/``bash`` block with a marker naming no existing test, or a ``bash`` block with no
marker, fails ``test_every_block_is_run_or_names_its_test``.
"""

from __future__ import annotations

import ast
import os
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
CODE_LANGS = {"python", "bash", "sh", "shell", "console"}
MARKER = re.compile(r"<!--\s*test:\s*(\S+)\s*-->")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    lang: str
    body: str
    marker: str | None  # "run", "tests/...::name", or None

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks_of(page: Path) -> list[Block]:
    lines = page.read_text().split("\n")
    out: list[Block] = []
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            lang = lines[i][3:].strip()
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            previous = lines[i - 1] if i > 0 else ""
            found = MARKER.search(previous)
            out.append(
                Block(page, i + 1, lang, "\n".join(lines[i + 1 : j]), found and found.group(1))
            )
            i = j + 1
        else:
            i += 1
    return out


ALL_BLOCKS = [b for page in PAGES for b in blocks_of(page)]


def runs_here(block: Block) -> bool:
    return block.marker == "run" or (block.lang == "python" and block.marker is None)


def names_a_test(ref: str) -> bool:
    path, _, name = ref.partition("::")
    file = REPO / path
    if not file.is_file() or not name:
        return False
    tree = ast.parse(file.read_text())
    return any(
        isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name for n in tree.body
    )


def test_every_block_is_run_or_names_its_test():
    problems = []
    for b in ALL_BLOCKS:
        if b.lang not in CODE_LANGS:
            if b.marker not in (None, "run") and not names_a_test(b.marker):
                problems.append(f"{b.name}: names {b.marker}, which does not exist")
            continue
        if runs_here(b):
            continue
        if b.marker is None:
            problems.append(
                f"{b.name}: a {b.lang} block with no marker: add '<!-- test: run -->' or "
                "'<!-- test: tests/<file>.py::<test> -->' on the line before it"
            )
        elif not names_a_test(b.marker):
            problems.append(f"{b.name}: names {b.marker}, which does not exist")
    assert not problems, "\n".join(problems)
    assert len(ALL_BLOCKS) > 10  # the parser found the pages' blocks


def test_relative_links_resolve():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
    assert not broken, broken


def test_readme_setup_commands_are_what_ci_runs():
    """The README's two commands are the set-up and the test command `.ci/run` runs."""
    readme = [b for b in ALL_BLOCKS if b.page.name == "README.md" and b.lang == "bash"]
    setup, tests = readme[0].body.strip(), readme[1].body.strip()
    ci = (REPO / ".ci" / "run").read_text()
    for step in setup.split(" && "):
        if step.startswith(("python3 -m venv", ". .venv")):
            assert step in ci, step
        elif step.startswith("pip install"):
            assert step.replace("pip install", "pip install -q") in ci, step
    test_command = tests.removeprefix(". .venv/bin/activate && ")
    assert ci.rstrip().splitlines()[-1] == test_command, "the README's test command != .ci/run's"
    assert len((REPO / "README.md").read_text().splitlines()) <= 300


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("block", [b for b in ALL_BLOCKS if runs_here(b)], ids=lambda b: b.name)
def test_block_runs(block: Block, tmp_path):
    env = dict(os.environ)
    env.update(
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(_free_port()),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
    )
    if block.lang == "python":
        script = tmp_path / "block.py"
        script.write_text(block.body)
        cmd = [sys.executable, str(script)]
    else:
        cmd = ["bash", "-euo", "pipefail", "-c", block.body]
    done = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, (
        f"{block.name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
