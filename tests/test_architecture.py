"""The layering docs/architecture.md states, read from the source (``ast``; nothing
is imported, so the test takes milliseconds), and docs/architecture.md's pass list against the registry.

Layers, each importing only from itself and the ones before it: ``runtime/`` (collectives and
runtime state), ``tspc/ops/`` (the attention kernels), ``passes/`` (graph passes), the core
(``tspc/*.py``: backend, pipeline, inner compiler, dump writer, generate). The tools
(``tspc/tools/``, ``bench/``, ``samples/``) may import anything and nothing imports them. Names
private to torch (``torch._...``) are imported only in ``runtime/compat.py``, ``tspc/inner.py``
(aot_autograd's and Inductor's entry points) and ``tspc/tools/memory.py``.
"""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

from tspc.pipeline import PHASES, describe

REPO = Path(__file__).resolve().parents[1]
# where each installed package lives in the repository (pyproject.toml's package-dir)
PACKAGE_DIRS = {
    "tspc.runtime": "runtime",
    "tspc.ops": "tspc/ops",
    "tspc.passes": "passes",
    "tspc.tools": "tspc/tools",
    "tspc.samples": "samples",
    "tspc": "tspc",
}
ORDER = ["runtime", "ops", "passes", "core", "tools"]
PRIVATE_TORCH_ALLOWED = {"runtime/compat.py", "tspc/inner.py", "tspc/tools/memory.py"}


def layer_of(module: str) -> str:
    """The layer of a dotted module name (``tspc.passes.analyse`` -> passes)."""
    top = module.split(".")[0]
    if top in ("bench", "samples", "tests"):
        return "tools"
    for prefix, layer in (
        ("tspc.runtime", "runtime"),
        ("tspc.ops", "ops"),
        ("tspc.passes", "passes"),
        ("tspc.tools", "tools"),
        ("tspc.samples", "tools"),
    ):
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return "core"


def core_files() -> list[tuple[str, Path]]:
    """(package, file) for every source file of the layers below the tools."""
    out = []
    for package in ("tspc.runtime", "tspc.ops", "tspc.passes", "tspc"):
        folder = REPO / PACKAGE_DIRS[package]
        for path in sorted(folder.glob("*.py")):
            out.append((package, path))
    return out


@functools.cache
def imported_modules(package: str, path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, relative ones resolved; an
    import inside a function counts too."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
                if node.module is None:  # from . import x: x may be a module
                    out += [(node.lineno, f"{name}.{a.name}") for a in node.names]
                    continue
            else:
                name = node.module or ""
            out.append((node.lineno, name))
    return out


def own(module: str) -> bool:
    return module.split(".")[0] in ("tspc", "bench", "samples", "tests")


def test_each_layer_imports_only_itself_and_the_layers_below():
    wrong = []
    for package, path in core_files():
        here = layer_of(package)
        for line, module in imported_modules(package, path):
            if own(module) and ORDER.index(layer_of(module)) > ORDER.index(here):
                wrong.append(f"{path.relative_to(REPO)}:{line} ({here}) imports {module}")
    assert not wrong, "\n".join(wrong)


def test_torch_private_names_are_imported_in_three_files_only():
    wrong = []
    for package, path in [
        *core_files(),
        *(("tspc.tools", p) for p in (REPO / "tspc/tools").glob("*.py")),
    ]:
        rel = str(path.relative_to(REPO))
        for line, module in imported_modules(package, path):
            if re.match(r"torch(\.[a-z0-9_]+)*\._", module) and rel not in PRIVATE_TORCH_ALLOWED:
                wrong.append(f"{rel}:{line} imports {module}")
    assert not wrong, "\n".join(wrong)


def test_the_readme_pass_list_is_the_registry():
    """docs/architecture.md shows ``describe()``'s output verbatim, and its table has a row per pass."""
    readme = (REPO / "docs" / "architecture.md").read_text()
    block = re.search(r"```text\n# python -m tspc.pipeline\n(.*?)```", readme, re.S)
    assert block, "docs/architecture.md: the pass list block (python -m tspc.pipeline) is missing"
    assert block.group(1).rstrip("\n") == describe(), (
        "docs/architecture.md's pass list is stale: paste describe()"
    )
    rows = set(re.findall(r"^\| ([a-z_]+) \|", readme, re.M))
    missing = [p.name for phase in PHASES for p in phase.passes if p.name not in rows]
    assert not missing, f"docs/architecture.md's table has no row for {missing}"
