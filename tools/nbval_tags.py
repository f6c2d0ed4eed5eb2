"""nbval's cell markers as cell tags, so a learner never reads test plumbing in a cell.

    python tools/nbval_tags.py [notebooks…]      # default: every notebooks/*.ipynb

A comment line `# NBVAL_CHECK_OUTPUT` (or another of nbval's markers) is removed from the cell's
source and the cell gets the tag nbval reads instead, `nbval-check-output` (the marker in lower case,
`_` → `-`): `pytest --nbval-lax` then compares that cell's stored output, exactly as with the comment.
The cell's outputs are left as they are. tests/test_style.py fails on any marker left in a cell.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
# nbval's comment markers (nbval.plugin.comment_markers); each has a tag of the same meaning.
MARKERS = ("NBVAL_CHECK_OUTPUT", "NBVAL_IGNORE_OUTPUT", "NBVAL_RAISES_EXCEPTION", "NBVAL_SKIP")
MARKER_LINE = re.compile(r"^[ \t]*#[ \t]*(NBVAL_[A-Z_]+)[ \t]*(?:\n|$)", flags=re.M)


def tag_of(marker: str) -> str:
    return marker.lower().replace("_", "-")


def convert(nb) -> int:
    """Move every marker comment of `nb`'s code cells into a tag (in place); return how many moved.
    An unknown NBVAL_ marker is an error: nbval would ignore it, and so would the tag."""
    moved = 0
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        for marker in MARKER_LINE.findall(cell.source):
            if marker not in MARKERS:
                raise ValueError(f"unknown nbval marker {marker!r}; nbval knows {', '.join(MARKERS)}")
            tags = cell.metadata.setdefault("tags", [])
            if tag_of(marker) not in tags:
                tags.append(tag_of(marker))
            moved += 1
        cell.source = MARKER_LINE.sub("", cell.source)
    return moved


def main(argv: list[str]) -> None:
    for path in [Path(a) for a in argv] or sorted((ROOT / "notebooks").glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        moved = convert(nb)
        if moved:
            nbformat.write(nb, path)
        print(f"{path.name}: {moved} marker comment(s) turned into tags")


if __name__ == "__main__":
    main(sys.argv[1:])
