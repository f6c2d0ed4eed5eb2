"""Give every notebook cell RISE slide metadata, so each chapter presents as slides.

`python tools/slides.py [notebooks…]` (default: all of notebooks/). Rules: cell 0 (title) is a
"slide"; a markdown cell starting with `## ` starts a "slide", one starting with `### ` a
"subslide"; the Colab set-up cell is skipped; every other cell is "-" (continues the current
slide). Only metadata changes, so stored outputs stay valid; running it twice changes nothing.
In JupyterLab with jupyterlab_rise installed, open a notebook and press Alt+R to present.
"""

import sys
from pathlib import Path

import nbformat

SETUP_TAG = "colab-setup"


def slide_type(cell: nbformat.NotebookNode, index: int) -> str:
    if index == 0:
        return "slide"
    if SETUP_TAG in cell.metadata.get("tags", []):
        return "skip"
    if cell.cell_type == "markdown":
        first = cell.source.lstrip().splitlines()[0] if cell.source.strip() else ""
        if first.startswith("## "):
            return "slide"
        if first.startswith("### "):
            return "subslide"
    return "-"


def fix(path: Path) -> bool:
    """Set slideshow.slide_type on every cell; return True if the notebook changed."""
    nb = nbformat.read(path, as_version=4)
    changed = False
    for i, cell in enumerate(nb.cells):
        kind = slide_type(cell, i)
        if cell.metadata.get("slideshow", {}).get("slide_type") != kind:
            cell.metadata.setdefault("slideshow", {})["slide_type"] = kind
            changed = True
    if changed:
        nbformat.write(nb, path)
    return changed


if __name__ == "__main__":
    paths = [Path(p) for p in sys.argv[1:]] or sorted(Path("notebooks").glob("*.ipynb"))
    for p in paths:
        if fix(p):
            print(f"updated {p}")
