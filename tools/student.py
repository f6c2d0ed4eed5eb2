"""Write solution-free student copies of the notebooks: `make student` (or `python tools/student.py`).

Cells tagged `solution` are removed (nbconvert's TagRemovePreprocessor), and so is any speaker-notes
cell (those live in the presenter's decks, tools/slides.py); every output is cleared, so a learner opens
`student/NN_name.ipynb`, runs it top to bottom, and meets each exercise with `answer = None` and a
checker that prints a hint instead of the worked solution.

A learner works in these copies, and `student/` is not in git, so nothing could bring an edit back:
a copy is never overwritten once it differs from what this tool last wrote there (a fingerprint of
each copy it writes is kept in `student/.kvlab-student.json`). Such a copy is skipped, and the run
says so; `--force` replaces it, after saving it as `NN_name.<time>.bak.ipynb` next to it.

    python tools/student.py [--force] [--out student] [notebooks/NN_name.ipynb …]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import time
from pathlib import Path

import nbformat
from nbconvert.preprocessors import ClearOutputPreprocessor, TagRemovePreprocessor

SOLUTION_TAG = "solution"
NOTES_TAG = "speaker-notes"  # the instructor's speaker notes: for the presenter only
OUT_DIR = Path("student")
MANIFEST = ".kvlab-student.json"  # file name -> sha256 of the copy this tool wrote


def strip(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """The notebook without solution cells, speaker notes and outputs (changed in place and returned)."""
    resources: dict = {}
    nb, _ = TagRemovePreprocessor(remove_cell_tags={SOLUTION_TAG, NOTES_TAG}).preprocess(nb, resources)
    nb, _ = ClearOutputPreprocessor().preprocess(nb, resources)
    return nb


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_copies(paths: list[Path], out_dir: Path = OUT_DIR, force: bool = False, log=print,
                 transform=None, remake: str = "make student FORCE=1") -> list[Path]:
    """Write a student copy of each notebook into out_dir; return the paths written.

    A copy already there that this tool did not write, or that was changed since (a learner's
    work), is kept and reported through `log`; with force=True it is backed up, then replaced.
    `transform(nb, path)` makes the copy (default: `strip`); tools/slides.py writes its decks with
    its own, and names its own command (`remake`) in the message about a kept copy."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = out_dir / MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    written = []
    for path in paths:
        target = out_dir / Path(path).name
        if target.exists() and manifest.get(target.name) != _digest(target):
            if not force:
                log(f"kept {target}: it changed since it was written (your work?); "
                    f"`{remake}` replaces it (a backup is kept)")
                continue
            backup = target.with_name(f"{target.stem}.{time.strftime('%Y%m%d-%H%M%S')}.bak.ipynb")
            shutil.copy2(target, backup)
            log(f"backed up {target} to {backup}")
        nb = nbformat.read(path, as_version=4)
        nbformat.write(transform(nb, Path(path)) if transform else strip(nb), target)
        manifest[target.name] = _digest(target)
        manifest_path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        log(f"wrote {target}")
        written.append(target)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: every notebooks/*.ipynb")
    parser.add_argument("--out", type=Path, default=OUT_DIR, help="folder of the copies (default: student)")
    parser.add_argument("--force", action="store_true",
                        help="replace copies you changed (each is backed up first)")
    args = parser.parse_args(argv)
    if args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out} is a file, not a folder: name a folder for the copies")
    write_copies(args.notebooks or sorted(Path("notebooks").glob("*.ipynb")), args.out, args.force)


if __name__ == "__main__":
    main()
