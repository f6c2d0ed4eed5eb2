"""The house style of docs/style.md, on every chapter: headings, the close, the set-up line, one
exercise form, `check_…` / `plot_…` names in kvlab/course, no test markers in a cell, ruff on the
notebooks; and nbval really compares the outputs of the cells tagged `nbval-check-output`."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
IDS = [p.name for p in NOTEBOOKS]
COURSE = sorted((ROOT / "kvlab" / "course").glob("ch[0-9][0-9]_*.py"))
SETUP_LINE = "device = kvlab.env.setup()  # the GPU if there is one; else the CPU, with one thread"
NO_CLOSING_TRY_IT = {"00", "11"}  # the welcome and the review: their exercises sit in their sections
NUMBERED = re.compile(r"## (\d+) · \S")
CLOSING = [("Summary", re.compile(r"## Summary$")),
           ("Common misconceptions", re.compile(r"## Common misconceptions( \(\S[^)]*\))?$"))]
PLACEHOLDER = re.compile(r"None  # ← your answer(: \S.*)?$")
NBVAL_TAGS = {"nbval-check-output", "nbval-ignore-output", "nbval-raises-exception", "nbval-skip"}


def cells(path: Path, kind: str | None = None) -> list:
    return [c for c in nbformat.read(path, as_version=4).cells if kind is None or c.cell_type == kind]


def headings(path: Path, level: str) -> list[str]:
    """The `## ` (or `# `) heading lines of the notebook's markdown, outside fenced code blocks."""
    found = []
    for cell in cells(path, "markdown"):
        prose = re.sub(r"^```.*?^```", "", cell.source, flags=re.M | re.S)
        found += [ln.rstrip() for ln in prose.splitlines() if ln.startswith(level + " ")]
    return found


# --- headings and the close -----------------------------------------------------------------------

@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_the_title_is_the_chapter_number_a_dot_and_the_title(path):
    title = [ln for ln in cells(path)[0].source.splitlines() if ln.startswith("# ")]
    assert len(title) == 1, f"cell 0 must hold one `# ` title line, not {title}"
    assert re.fullmatch(rf"# {path.name[:2]} · \S.*", title[0]), \
        f"{title[0]!r}: a title reads `# {path.name[:2]} · Title`"
    assert not headings(path, "#")[1:], "only cell 0 has a `# ` title"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_sections_are_numbered_in_order_then_the_close(path):
    lines = headings(path, "##")
    numbered = [(i, int(NUMBERED.match(h).group(1))) for i, h in enumerate(lines) if NUMBERED.match(h)]
    closing = [(i, name) for i, h in enumerate(lines) for name, rx in CLOSING if rx.match(h)]
    stray = [h for i, h in enumerate(lines) if i not in dict(numbered) and i not in dict(closing)]
    assert not stray, f"headings outside the house style (`## N · …`, the close): {stray}"
    numbers = [n for _, n in numbered]
    assert numbers and numbers[0] in (0, 1), f"sections are numbered from 1 (or 0): {numbers}"
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers))), f"numbered in order: {numbers}"
    assert [name for _, name in closing][:1] == ["Summary"], "every chapter closes with `## Summary`"
    assert [name for _, name in closing] in (["Summary"], ["Summary", "Common misconceptions"])
    assert all(i < closing[0][0] for i, _ in numbered), "the Summary comes after every numbered section"
    assert closing[-1][0] == len(lines) - 1, "nothing follows the closing sections"
    try_it = [lines[i] for i, _ in numbered if re.match(r"## \d+ · Try it\b", lines[i])]
    if path.name[:2] in NO_CLOSING_TRY_IT:
        assert not try_it, f"{path.name[:2]} keeps its exercises in its sections"
    else:
        assert try_it == [lines[numbered[-1][0]]], \
            "the last numbered section is the chapter's exercises, `## N · Try it…`, and the only one"


# --- the set-up cell ------------------------------------------------------------------------------

@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_one_set_up_line_in_the_set_up_cell(path):
    code = cells(path, "code")
    colab = next(i for i, c in enumerate(code) if "colab-setup" in c.metadata.get("tags", []))
    setup = code[colab + 1].source.splitlines()
    assert SETUP_LINE in setup, f"the set-up cell (code cell {colab + 1}) lacks `{SETUP_LINE}`"
    assert "import kvlab" in setup
    for i, cell in enumerate(code):
        text = cell.source
        calls = len(re.findall(r"\benv\.(setup|device)\(", text))
        assert calls == (1 if i == colab + 1 else 0), f"code cell {i}: the device is picked in the set-up"
        assert not re.search(r"\b(DEVICE|ON_GPU)\b", text), f"code cell {i}: spelled `device`, `on_gpu`"
        for line in re.findall(r"^\s*on_gpu\s*=.*$", text, flags=re.M):
            assert line.strip() == 'on_gpu = device.type == "cuda"', line


# --- exercises ------------------------------------------------------------------------------------

@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_every_exercise_has_one_form_and_its_solution_checks_itself(path):
    chapter = f"ch{path.name[:2]}"
    asked = 0
    for cell in cells(path, "code"):
        tags = cell.metadata.get("tags", [])
        last = cell.source.rstrip().splitlines()[-1] if cell.source.strip() else ""
        if "solution" in tags:
            assert re.fullmatch(rf"assert {chapter}\.check_\w+\(solution_answer\)", last), \
                f"a solution ends with `assert {chapter}.check_…(solution_answer)`, not {last!r}"
            continue
        marks = [ln for ln in cell.source.splitlines() if "←" in ln]
        calls = re.findall(rf"\b{chapter}\.check_\w+\(", cell.source)
        if not marks and not calls:
            continue
        asked += 1
        for line in marks:
            assert PLACEHOLDER.search(line), f"{line.strip()!r}: write `None  # ← your answer: …`"
        assert marks, f"an exercise cell marks what to replace: {cell.source[:80]!r}"
        assert re.fullmatch(rf"{chapter}\.check_\w+\(answer\)", last), \
            f"an exercise cell ends with `{chapter}.check_…(answer)`, not {last!r}"
    assert asked, f"{path.name} has no exercise"


# --- names in kvlab/course ------------------------------------------------------------------------

def _makes_a_figure(node: ast.FunctionDef) -> bool:
    """The function creates a matplotlib figure itself, or returns what a plot_… function drew."""
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            name = sub.func.attr if isinstance(sub.func, ast.Attribute) else getattr(sub.func, "id", "")
            if name in ("new_figure", "subplots", "figure") or name.startswith("plot_"):
                return True
    return False


def _returns_verdict(node: ast.FunctionDef) -> bool:
    return node.returns is not None and ast.unparse(node.returns).strip("'\"") == "Verdict"


@pytest.mark.parametrize("path", COURSE, ids=[p.name for p in COURSE])
def test_checkers_are_check_and_figures_are_plot(path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    wrong = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        name, checks, draws = node.name, _returns_verdict(node), _makes_a_figure(node)
        if name.endswith("_explorer"):
            continue
        if checks != name.startswith("check_"):
            wrong.append(f"{name}: a checker (-> Verdict) is check_…, and only a checker")
        if not checks and draws != name.startswith("plot_"):
            wrong.append(f"{name}: a function that draws is plot_…, and only one that draws")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("path", COURSE, ids=[p.name for p in COURSE])
def test_no_function_is_kept_under_a_second_name(path):
    module = importlib.import_module(f"kvlab.course.{path.stem}")
    aliases = [f"{attr} = {fn.__name__}" for attr, fn in vars(module).items()
               if inspect.isfunction(fn) and fn.__module__.startswith("kvlab.course") and attr != fn.__name__]
    assert not aliases, f"old names kept as aliases: {aliases}"


def test_the_notebooks_and_the_guide_name_only_functions_that_exist():
    """A renamed checker or figure function left behind in a chapter, the guide or the README fails."""
    modules = {f"ch{p.name[2:4]}": importlib.import_module(f"kvlab.course.{p.stem}") for p in COURSE}
    texts = {p.name: "\n".join(c.source for c in cells(p)) for p in NOTEBOOKS}
    texts |= {name: (ROOT / name).read_text(encoding="utf-8")
              for name in ("docs/instructor-guide.md", "docs/architecture.md", "README.md")}
    missing = sorted({f"{where}: {ch}.{attr}" for where, text in texts.items()
                      for ch, attr in re.findall(r"\b(ch\d\d)\.(\w+)\(", text)
                      if ch in modules and not hasattr(modules[ch], attr)})
    assert not missing, "\n".join(missing)


# --- test markers, lint ---------------------------------------------------------------------------

@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_no_cell_carries_an_nbval_marker_comment(path):
    marked = [i for i, c in enumerate(cells(path, "code")) if "NBVAL_" in c.source]
    assert not marked, f"code cells {marked} hold an NBVAL_ comment: run `python tools/nbval_tags.py`"
    tags = {t for c in cells(path, "code") for t in c.metadata.get("tags", []) if t.startswith("nbval")}
    assert tags <= NBVAL_TAGS, f"unknown nbval tags {tags - NBVAL_TAGS}"


def test_the_tag_tool_moves_a_marker_into_a_tag():
    tool = _load_tool("nbval_tags")
    marked = nbformat.v4.new_code_cell("# NBVAL_CHECK_OUTPUT\nprint(1)")
    inline = nbformat.v4.new_code_cell("x = 1  # NBVAL_SKIP, inline: not a marker line")
    nb = nbformat.v4.new_notebook(cells=[marked, inline])
    assert tool.convert(nb) == 1
    assert nb.cells[0].source == "print(1)" and nb.cells[0].metadata.tags == ["nbval-check-output"]
    assert "tags" not in nb.cells[1].metadata
    with pytest.raises(ValueError, match="NBVAL_CHECK_OUTPUTS"):
        tool.convert(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("# NBVAL_CHECK_OUTPUTS")]))


def _load_tool(name: str):
    spec = importlib.util.spec_from_file_location(f"kvlab_tools_{name}", ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _printing(source: str, stored: str, tags=()):
    cell = nbformat.v4.new_code_cell(source, outputs=[nbformat.v4.new_output("stream", text=stored)],
                                     execution_count=1)
    cell.metadata["tags"] = list(tags)
    return cell


def test_nbval_compares_the_output_of_a_tagged_cell(tmp_path):
    """With --nbval-lax (as in `make test`) the tag alone decides: a tagged cell whose stored output
    differs from what it prints fails; an untagged one is only run."""
    pytest.importorskip("nbval")
    tagged = ["nbval-check-output"]
    notebooks = {"right.ipynb": [_printing("print(1 + 1)", "2\n", tagged), _printing("print(3)", "stale\n")],
                 "stale.ipynb": [_printing("print(1 + 1)", "3\n", tagged)]}
    for name, nb_cells in notebooks.items():
        nb = nbformat.v4.new_notebook(cells=nb_cells)
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nbformat.write(nb, tmp_path / name)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    result = subprocess.run([sys.executable, "-m", "pytest", "--nbval-lax", "--nbval-current-env", "-rA",
                             "-p", "no:cacheprovider", str(tmp_path)],
                            cwd=tmp_path, capture_output=True, text=True, timeout=300)
    out = result.stdout
    assert "PASSED right.ipynb::Cell 0" in out and "PASSED right.ipynb::Cell 1" in out, out
    assert "FAILED stale.ipynb::Cell 0" in out and "Cell outputs differ" in out, out
    assert result.returncode == 1, out


def test_ruff_checks_the_notebooks_in_make_test_with_a_100_character_limit():
    recipe = (ROOT / "Makefile").read_text().split("\ntest: ", 1)[1].split("\n\n", 1)[0]
    assert re.search(r"ruff check [^\n]*\bnotebooks\b", recipe), "make test must lint notebooks/"
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    if not Path(ruff).is_file():
        pytest.skip("ruff not installed — pip install -e '.[test]'")
    settings = subprocess.run([ruff, "check", "--show-settings", str(NOTEBOOKS[0])], cwd=ROOT,
                              capture_output=True, text=True).stdout
    assert re.search(r"^linter\.line_length = 100$", settings, flags=re.M), "notebooks/.ruff.toml sets 100"
    result = subprocess.run([ruff, "check", "notebooks"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout[-3000:]
