"""The package's shape, read from the source with `ast`: no import cycle between our modules or folders, every import
goes down the layers docs/architecture.md draws, our own modules are imported at module top, and the
command line starts with the standard library alone."""
from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG_DIR = ROOT / "src" / "ucx_dask_gpu"
PKG = "ucx_dask_gpu"

# Rows of the drawing in docs/architecture.md, bottom first. A module may import its own folder and any folder on a
# LOWER row, never one on its own row or above. The foundation modules (row 0) are single files that import only each
# other.
LAYERS = [
    {"errors", "fsutil", "cliutil", "report", "nvml"},
    {"stack"},
    {"gate"},
    {"ucx"},
    {"ucxbuild", "oci", "topology", "proof"},
    {"image", "nvlink", "bench", "conda"},
    {"cli"},
    {"__main__"},
]
RANK = {unit: row for row, units in enumerate(LAYERS) for unit in units}
# The package's __init__ reads the stack model for __version__ when the package is not installed.
INIT_MAY_IMPORT = {"stack"}

# Where our own modules may be imported inside functions: only in the console script's main, which holds SIGINT and
# SIGTERM before it imports the commands and must not hold them at import (spawned worker processes import it).
LAZY_OWN_IMPORTS: set[str] = {"__main__.py"}


def modules() -> dict[str, Path]:
    out = {}
    for path in PKG_DIR.rglob("*.py"):
        parts = list(path.relative_to(PKG_DIR.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


MODULES = modules()


def _owner(name: str) -> str | None:
    """The module a dotted name lives in (`ucx_dask_gpu.stack.load` -> `ucx_dask_gpu.stack`)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def own_imports(module: str) -> list[tuple[str, int, bool]]:
    """(imported module, line, inside a function) for every import of one of our modules, at any depth."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    in_function = {id(node) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for node in ast.walk(fn)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1] + [node.module or ""]) if node.level \
                else node.module or ""
            base = base.rstrip(".")
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            target = _owner(name) if name.split(".")[0] == PKG else None
            if target and target != module:
                out.append((target, node.lineno, id(node) in in_function))
    return out


EDGES = {m: own_imports(m) for m in MODULES}


def unit(module: str) -> str:
    """The folder (or foundation file) a module belongs to: `ucx_dask_gpu.ucx.install` -> `ucx`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one member (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_sees_module_level_relative_and_in_function_imports():
    seen = {(t, inner) for t, _, inner in EDGES[f"{PKG}.ucx.doctor"]}
    assert (f"{PKG}.ucx.install", False) in seen and (f"{PKG}.gate.identity", False) in seen
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle_between_modules():
    assert cycles({m: {t for t, _, _ in e} for m, e in EDGES.items()}) == []


def test_no_import_cycle_between_folders():
    graph: dict[str, set[str]] = {}
    for m, e in EDGES.items():
        graph.setdefault(unit(m), set()).update(unit(t) for t, _, _ in e if unit(t) != unit(m))
    assert cycles(graph) == []


def test_every_folder_has_a_layer():
    units = {unit(m) for m in MODULES}
    assert units - {"__init__"} == set(RANK), "a new folder: give it a row in LAYERS and in docs/architecture.md"


def allowed(importer: str, imported: str) -> bool:
    if importer == imported:
        return True
    if importer == "__init__":
        return imported in INIT_MAY_IMPORT
    if imported == "__init__":                    # the package's __version__: the command line only
        return RANK[importer] >= RANK["cli"]
    if RANK[importer] == RANK[imported] == 0:     # foundation files import each other (acyclic: tested above)
        return True
    return RANK[imported] < RANK[importer]


def test_imports_go_down_the_layers():
    wrong = [f"{MODULES[m].relative_to(ROOT)}:{line}: {unit(m)} imports {unit(t)}"
             for m, e in EDGES.items() for t, line, _ in e if not allowed(unit(m), unit(t))]
    assert wrong == []


def test_the_layering_rule_refuses_upward_and_sideways_imports():
    assert allowed("image", "oci") and allowed("ucx", "gate") and allowed("report", "fsutil")
    assert not allowed("oci", "image") and not allowed("oci", "ucxbuild") and not allowed("stack", "ucx")
    assert not allowed("gate", "cli") and not allowed("__init__", "ucx")


def test_the_layers_match_the_drawing():
    page = (ROOT / "docs" / "architecture.md").read_text()
    drawing = page.split("# Architecture", 1)[1].split("```", 2)[1]
    rows = [line.split("|")[0].split() for line in drawing.strip().splitlines()]
    assert [set(r) for r in reversed(rows)] == [{u + ".py" if RANK[u] in (0, RANK["cli"], RANK["__main__"]) else u + "/"
                                                 for u in row}
                                                for row in LAYERS]


def test_our_modules_are_imported_at_module_top():
    inside = sorted({f"{MODULES[m].relative_to(PKG_DIR)}:{line}" for m, e in EDGES.items()
                     for _, line, inner in e if inner})
    assert {s.split(":")[0] for s in inside} <= LAZY_OWN_IMPORTS, inside


@pytest.mark.parametrize("argv", [["--help"], ["stack", "get", "debian.suite"], ["guard", "id"]])
def test_the_command_line_starts_with_the_standard_library_alone(argv):
    """`python3 -S`: no site-packages, so any third-party import on the way to the parser fails here (ci/ runs `stack
    get` with the system python3 before any venv exists)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")} | {"PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run([sys.executable, "-S", "-m", PKG, *argv], capture_output=True, text=True, env=env,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
