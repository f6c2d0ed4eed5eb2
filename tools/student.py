"""Write solution-free student copies of the notebooks: `make student` (or `python tools/student.py`).

Cells tagged `solution` are removed (nbconvert's TagRemovePreprocessor), and so are the instructor's
speaker notes (cells tagged `speaker-notes`, made by tools/slides.py); every output is cleared, so a
learner opens `student/NN_name.ipynb`, runs it top to bottom, and meets each exercise with
`answer = None` and a checker that prints a hint instead of the worked solution.
"""

import sys
from pathlib import Path

import nbformat
from nbconvert.preprocessors import ClearOutputPreprocessor, TagRemovePreprocessor

SOLUTION_TAG = "solution"
NOTES_TAG = "speaker-notes"  # tools/slides.py's speaker notes: for the presenter only
OUT_DIR = Path("student")


def strip(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The notebook without solution cells, speaker notes and outputs (changed in place and returned)."""
    resources: dict = {}
    nb, _ = TagRemovePreprocessor(remove_cell_tags={SOLUTION_TAG, NOTES_TAG}).preprocess(nb, resources)
    nb, _ = ClearOutputPreprocessor().preprocess(nb, resources)
    return nb


def write_copies(paths: list[Path], out_dir: Path = OUT_DIR) -> list[Path]:
    """Write a student copy of each notebook into out_dir; return the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for path in paths:
        nb = strip(nbformat.read(path, as_version=4))
        target = out_dir / path.name
        nbformat.write(nb, target)
        written.append(target)
    return written


if __name__ == "__main__":
    notebooks = [Path(p) for p in sys.argv[1:]] or sorted(Path("notebooks").glob("*.ipynb"))
    for target in write_copies(notebooks):
        print(f"wrote {target}")
