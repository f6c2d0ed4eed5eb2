"""`make student` (tools/student.py): solution-free copies that keep every exercise and still run."""

import ast
import importlib.util
import re
from pathlib import Path

import nbformat
import pytest
from nbconvert.preprocessors import ExecutePreprocessor

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
spec = importlib.util.spec_from_file_location("kvlab_tools_student", ROOT / "tools" / "student.py")
student = importlib.util.module_from_spec(spec)
spec.loader.exec_module(student)
CHECK_CALL = re.compile(r"\bch\d\d\.(check_\w+)\(")  # an exercise checker (style: check_…)


def _is_solution(cell) -> bool:
    return student.SOLUTION_TAG in cell.metadata.get("tags", [])


def _is_notes(cell) -> bool:
    return student.NOTES_TAG in cell.metadata.get("tags", [])


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    out = tmp_path_factory.mktemp("student")
    return dict(zip(NOTEBOOKS, student.write_copies(NOTEBOOKS, out), strict=True))


def test_the_review_has_solutions_to_strip():
    review = nbformat.read(ROOT / "notebooks" / "11_review.ipynb", as_version=4)
    assert sum(map(_is_solution, review.cells)) >= 10


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_student_copy_has_no_solutions_and_no_outputs(path, copies):
    original = nbformat.read(path, as_version=4)
    copy = nbformat.read(copies[path], as_version=4)
    assert not any(map(_is_solution, copy.cells))
    text = "\n".join(c.source for c in copy.cells)
    for cell in filter(_is_solution, original.cells):
        assert cell.source.strip() not in text
        assert "solution_answer" not in cell.source or "solution_answer" not in text
    assert all(not c.get("outputs") and c.get("execution_count") is None
               for c in copy.cells if c.cell_type == "code")
    assert not any(map(_is_notes, copy.cells)) and "Speaker notes" not in text  # for the presenter only
    kept = [c.source for c in original.cells if not _is_solution(c) and not _is_notes(c)]
    assert [c.source for c in copy.cells] == kept


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_every_exercise_checker_call_remains(path, copies):
    original = nbformat.read(path, as_version=4)
    copy = nbformat.read(copies[path], as_version=4)
    solved = {name for c in original.cells if _is_solution(c) for name in CHECK_CALL.findall(c.source)}
    asked = {name for c in copy.cells for name in CHECK_CALL.findall(c.source)}
    if any(map(_is_solution, original.cells)):
        assert solved, "solution cells found, but none calls its chapter's checker (chNN.<checker>(…))"
    assert solved <= asked, f"exercises with a solution but no learner cell: {sorted(solved - asked)}"
    before = [c.source for c in original.cells
              if not _is_solution(c) and not _is_notes(c) and CHECK_CALL.search(c.source)]
    after = [c.source for c in copy.cells if CHECK_CALL.search(c.source)]
    assert after == before


def test_student_review_runs_top_to_bottom_and_answers_nothing(copies):
    path = copies[ROOT / "notebooks" / "11_review.ipynb"]
    nb = nbformat.read(path, as_version=4)
    run_in = {"metadata": {"path": str(path.parent)}}
    ExecutePreprocessor(timeout=300, kernel_name="python3").preprocess(nb, run_in)
    out = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert not [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert "✗ Not yet. Hint:" in out and "✓" not in out


def _names(source: str) -> tuple[set[str], set[str]]:
    """Names a cell binds (anywhere, over-approximated) and names it reads."""
    code = "\n".join(ln for ln in source.splitlines() if not ln.lstrip().startswith(("%", "!")))
    bound, read = set(), set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
    return bound, read


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_no_later_cell_needs_what_only_a_solution_defined(path):
    """Cheap proof that every student copy runs past its exercises: nothing after a removed
    solution cell reads a name that only solution cells bind."""
    kept: set[str] = set()
    only_in_solutions: set[str] = set()
    for i, cell in enumerate(nbformat.read(path, as_version=4).cells):
        if cell.cell_type != "code":
            continue
        bound, read = _names(cell.source)
        if _is_solution(cell):
            only_in_solutions |= bound - kept
            continue
        missing = (read - bound) & only_in_solutions
        assert not missing, f"cell {i} reads {sorted(missing)}, defined only in solution cells"
        kept |= bound
        only_in_solutions -= bound
