"""The three layers and what may import what (docs/architecture.md), read from the source with ast:
core (kvlab/*.py, kvlab/bench/) never imports the course layer; a chapter module imports only core,
`kvlab.course.style`, earlier chapters and the other parts of its own chapter (ch02_decode_explorer);
every notebook imports its own chapter's module and none imports the old kvlab.plots / kvlab.widgets /
kvlab.check."""

import ast
import re
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
KVLAB = ROOT / "kvlab"
COURSE = KVLAB / "course"
CORE = sorted(p for p in KVLAB.rglob("*.py") if COURSE not in p.parents)
CHAPTERS = sorted(COURSE.glob("ch[0-9][0-9]_*.py"))
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def imported_modules(path: Path) -> set[str]:
    """Absolute names of the modules a kvlab source file imports (relative imports resolved)."""
    package = ".".join(path.relative_to(ROOT).with_suffix("").parts[:-1])
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[:len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            names.add(module)
            names |= {f"{module}.{a.name}" for a in node.names}  # `from kvlab import course`
    return names


def test_the_layers_exist():
    assert len(CORE) > 10 and len(CHAPTERS) >= 9 and len(NOTEBOOKS) >= 9
    # chapter NN_name.ipynb has its module chNN_name.py
    assert {p.name for p in CHAPTERS} >= {f"ch{nb.stem}.py" for nb in NOTEBOOKS[:9]}


@pytest.mark.parametrize("path", CORE, ids=lambda p: str(p.relative_to(KVLAB)))
def test_core_never_imports_the_course(path):
    bad = sorted(m for m in imported_modules(path) if m == "kvlab.course" or m.startswith("kvlab.course."))
    assert not bad, f"{path.relative_to(ROOT)} imports {bad}: core must not depend on the course layer"


@pytest.mark.parametrize("path", CHAPTERS, ids=lambda p: p.name)
def test_a_chapter_imports_core_style_and_earlier_chapters_only(path):
    number = int(path.name[2:4])
    for module in imported_modules(path):
        found = re.match(r"kvlab\.course\.ch(\d\d)_", module)
        if found:
            assert int(found.group(1)) <= number, f"{path.name} imports {module}: a later chapter"


def test_the_old_presentation_modules_are_gone():
    for name in ("plots", "widgets", "check"):
        assert not (KVLAB / f"{name}.py").exists()
    every = set().union(*(imported_modules(p) for p in CORE + CHAPTERS))
    assert not {"kvlab.plots", "kvlab.widgets", "kvlab.check"} & every


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_notebook_imports_its_chapter(path):
    code = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code")
    mine = re.findall(rf"from kvlab\.course import (ch{path.name[:2]}_\w+) as ch{path.name[:2]}\b", code)
    assert mine and (COURSE / f"{mine[0]}.py").exists(), f"{path.name} does not import its chapter module"
    assert not re.search(r"from kvlab import [^\n]*\b(plots|widgets|check)\b|kvlab\.(plots|widgets|check)\b",
                         code)


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """kvlab module -> the kvlab modules it imports (anywhere in the file, lazy imports included).
    `from package import name` is an edge to package.name when that is a module, else to package."""
    files = {_module_name(p): p for p in KVLAB.rglob("*.py")}
    graph = {}
    for name, path in files.items():
        edges = set()
        for module in imported_modules(path):
            if module in files:
                edges.add(module)
        # `from kvlab import cache` names the package and its submodule; keep the submodule only
        graph[name] = {m for m in edges if not any(o.startswith(m + ".") for o in edges) and m != name}
    return graph


def test_no_import_cycle_anywhere_in_kvlab():
    graph = import_graph()
    assert "kvlab.cache.base" in graph and "kvlab.model" in graph
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)


def test_the_cache_package_holds_every_kind_and_the_old_homes_are_gone():
    for old in ("cache.py", "paging.py", "window.py"):
        assert not (KVLAB / old).exists(), f"kvlab/{old} should be gone (no shims)"
    kinds = {p.stem for p in (KVLAB / "cache").glob("*.py")}
    assert kinds >= {"__init__", "base", "dense", "quantized", "paged", "prefix", "window", "heavy_hitters"}
