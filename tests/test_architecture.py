"""The layering docs/architecture.md states, read from the source (``ast``; nothing
is imported, so the test takes milliseconds), and docs/architecture.md's pass list against the registry.

Layers, each importing only from itself and the ones before it: ``runtime/`` (collectives and
runtime state), ``tspc/ops/`` (the attention kernels), ``passes/`` (graph passes), the core
(``tspc/*.py``: backend, pipeline, inner compiler, dump writer, generate). The tools
(``tspc/tools/``, ``bench/``, ``samples/``) may import anything and nothing imports them. Names
private to torch (``torch._...``) are imported only in ``runtime/compat.py``, ``tspc/inner.py``
(aot_autograd's and Inductor's entry points) and ``tspc/tools/memory.py``, and only these files
reach torch's private attributes (``torch._dynamo.x``, ``nn.Module._call_impl``,
``compiled._orig_mod``). The import graph of the library's files has no cycle.
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
    "tspc.tools.timemodel": "tspc/tools/timemodel",
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
            else:
                name = node.module or ""
            # from m import x: x may be a module (or a private name of m); readers trim
            out += [
                (node.lineno, f"{name}.{a.name}" if a.name != "*" else name) for a in node.names
            ]
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


def library_files() -> dict[str, tuple[str, Path]]:
    """Dotted module name -> (package, file) for every library file: tspc/ (with ops/ and
    tools/), passes/, runtime/ and samples/, named as installed (pyproject's package-dir)."""
    out = {}
    for package, folder in PACKAGE_DIRS.items():
        for path in sorted((REPO / folder).glob("*.py")):
            name = package if path.stem == "__init__" else f"{package}.{path.stem}"
            out[name] = (package, path)
    return out


def canonical(module: str) -> str:
    """``samples.x`` is importable both ways (the repository root is on the path in tests and
    scripts): one name for one file."""
    return "tspc." + module if module == "samples" or module.startswith("samples.") else module


def import_graph():
    """The import graph of the library's files: an edge A -> B where file A imports file B
    anywhere in it (module level, inside a function, under ``TYPE_CHECKING``). ``from pkg
    import name`` is an edge to ``pkg.name`` when that is a file, else to ``pkg`` itself."""
    import networkx as nx

    files = library_files()
    graph = nx.DiGraph()
    graph.add_nodes_from(files)
    for name, (package, path) in files.items():
        pkg = name if path.stem == "__init__" else package
        for line, module in imported_modules(pkg, path):
            module = canonical(module)
            while module and module not in files:  # from pkg.mod import name -> pkg.mod
                module = module.rpartition(".")[0]
            if module and module != name:
                graph.add_edge(name, module, line=line)
    return graph


def test_the_import_graph_has_no_cycle():
    import networkx as nx

    graph = import_graph()
    # the graph sees real imports: a few edges the layering rests on
    assert graph.has_edge("tspc.passes.shard_sequence", "tspc.passes.seq_propagate")
    assert graph.has_edge("tspc.backend", "tspc.pipeline")
    cycles = list(nx.simple_cycles(graph))
    shown = [
        " -> ".join(f"{a} (line {graph.edges[a, b]['line']})" for a, b in zip(c, c[1:] + c[:1]))
        for c in cycles[:20]
    ]
    assert not cycles, f"{len(cycles)} import cycles, e.g.:\n" + "\n".join(shown)


def test_the_import_graph_catches_function_level_imports(tmp_path):
    """An import inside a function body closes a cycle as surely as one at the top."""
    source = "def f():\n    from tspc.passes import analyse\n"
    path = tmp_path / "probe.py"
    path.write_text(source)
    assert (2, "tspc.passes.analyse") in imported_modules("tspc.passes", path)


# Members private to torch, flagged on any object (``module._orig_mod``, ``op._schema``), next to
# every private name reached from a torch module (``torch._dynamo``, ``dist._x``,
# ``nn.Module._call_impl``). Python's own (``sys._getframe``) and tspc's (``self._cache``) are
# not torch's.
TORCH_PRIVATE_MEMBERS = {
    "_call_impl",
    "_wrapped_call_impl",
    "_orig_mod",
    "_boxed_call",
    "_cdata",
    "_schema",
    "_opname",
    "_qualified_op_name",
    "_erased",
    "_version",
    "_parameters",
    "_buffers",
    "_modules",
}
# (file, private name) -> why it stays there for now
PRIVATE_ATTRIBUTES_ALLOWED = {
    # nn.Module's registries, written directly to put a DTensor shard (or the released
    # placeholder) where a parameter was without nn.Module.__setattr__'s re-registration, as
    # torch's own fully_shard does; a compat accessor for 20 call sites is a change of its own
    ("runtime/tsp_params.py", "_parameters"): "parameter swap (see above)",
    ("tspc/generate.py", "_parameters"): "parameter swap (see above)",
    ("tspc/tools/fake_cuda.py", "_parameters"): "parameter swap (see above)",
    ("tspc/tools/fake_cuda.py", "_buffers"): "buffer swap, as for parameters",
}


def _torch_bindings(tree: ast.AST) -> set[str]:
    """Names a file binds to torch or one of its modules (``import torch.nn as nn``, ``from
    torch import nn``, ``import torch.nn.functional as F``)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    out.add(a.asname or "torch")
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out.update(a.asname or a.name for a in node.names if _is_torch(node.module))
    return out


def _is_torch(module: str | None) -> bool:
    return module is not None and module.split(".")[0] == "torch"


def _attribute_chain(node: ast.Attribute) -> list[str] | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def private_torch_attributes(path: Path) -> list[tuple[int, str, str]]:
    """(line, chain, private name) of each torch-private attribute the file reaches. Op names
    under ``torch.ops`` (``aten._to_copy``) are the dispatcher's names of ops, not attributes."""
    tree = ast.parse(path.read_text(), str(path))
    torch_names = _torch_bindings(tree)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        chain = _attribute_chain(node)
        if chain is None or chain[-1] != node.attr:
            continue
        private = node.attr.startswith("_") and not node.attr.startswith("__")
        from_torch = chain[0] in torch_names and "ops" not in chain[1:-1]
        if private and (from_torch or node.attr in TORCH_PRIVATE_MEMBERS):
            out.append((node.lineno, ".".join(chain), node.attr))
    return out


def test_torch_private_attributes_are_reached_in_three_files_only():
    wrong, used = [], set()
    for path in [p for _, p in library_files().values()]:
        rel = str(path.relative_to(REPO))
        if rel in PRIVATE_TORCH_ALLOWED:
            continue
        for line, chain, name in private_torch_attributes(path):
            if (rel, name) in PRIVATE_ATTRIBUTES_ALLOWED:
                used.add((rel, name))
            else:
                wrong.append(f"{rel}:{line} reaches {chain}")
    assert not wrong, "torch-private attributes belong in runtime/compat.py:\n" + "\n".join(wrong)
    stale = set(PRIVATE_ATTRIBUTES_ALLOWED) - used
    assert not stale, f"allowed but no longer used (remove them): {sorted(stale)}"


def test_the_private_attribute_check_sees_chains_and_members(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text(
        "import torch\nfrom torch import nn\nimport torch.distributed as dist\n"
        "torch._dynamo.reset()\nnn.Module._call_impl\ndist._x.y\nm._orig_mod\n"
        "torch.ops.aten._to_copy.default\nself._cache\nimport sys\nsys._getframe(1)\n"
    )
    found = sorted((line, name) for line, _, name in private_torch_attributes(path))
    assert found == [(4, "_dynamo"), (5, "_call_impl"), (6, "_x"), (7, "_orig_mod")], found
