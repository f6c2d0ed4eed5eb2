"""Make every chapter a slide deck an instructor can present (JupyterLab RISE), with speaker notes.

    python tools/slides.py [--split-headings] [notebooks…]      # slide metadata of notebooks/ (default: all)
    python tools/slides.py --decks [--force] [--out slides]     # the presenter's copies, with speaker notes

The first form sets every cell's `slideshow.slide_type` metadata in place (nothing a learner sees, so
stored outputs stay valid; a second run changes nothing). Run it again after any content change.
The second (`make slides`) writes each chapter's *deck* into slides/ (not in git): the notebook with the
instructor guide's speaker notes added as cells of slide type "notes". The notes live in
docs/instructor-guide.md and reach only the decks: notebooks/, `make student` and the website carry none.
An instructor presents from the deck (open `slides/03_cache_memory.ipynb`, Run All, Alt+R; T shows the
notes). A deck changed since it was written (cells run while presenting) is kept: `--force` replaces it,
after a backup, as tools/student.py does with a learner's copy.

How it decides, cell by cell:
- cell 0 (title) starts a slide; a markdown cell with a `## ` heading starts a slide, one with a `### `
  heading a sub-slide. RISE starts slides only at cells, so a heading below other text in the same cell
  drags that text onto the new slide: the tool warns, and `--split-headings` splits such cells at the
  heading (the text stays the same, the notebook looks the same; only the slides change);
- set-up is skipped (hidden in the slides, still run by "Run All"): the Colab set-up cell, code cells
  tagged `slides-skip`, and import cells — code whose first statement is an import, more than half of
  whose top-level statements are imports, with no loop, `try`, `with` or definition, and no output but
  printed text. The speaker notes of the first slide
  list what those cells do, so the presenter knows to run all cells before presenting;
- a slide must fit the screen: each cell's height is estimated from its content (wrapped lines of
  prose, lines of code and printed output, images at their PNG size, table rows; constants measured
  in JupyterLab RISE at 1280×800 by tests/ui/test_ui_slides.py), and a cell that would take the
  slide past BUDGET_PX starts a sub-slide;
- a plot or widget gets a sub-slide of its own (with the one short sentence that leads into it,
  when both fit); a short comment after it stays on its slide when it fits, anything else starts a new
  sub-slide. Likewise a cell pushed onto a new sub-slide by the height budget takes the short sentence
  before it along (a sentence ending in ":" stays with its code);
- a worked solution (a cell tagged `solution`) starts a sub-slide: the room sees the question first;
- a `### ` heading right after a bare `## ` heading stays on its slide (no slide with a title alone);
- speaker notes (decks only): the chapter's section of docs/instructor-guide.md is parsed; its "Goals"
  go to the title slide, each "Run live" bullet `§N, …` (or `Part N: …`, or `"Name": …`) to the notebook
  section whose heading has that number (or name), other bullets to the title slide,
  "Discussion" and "Usual mistakes" to the Summary (or the last section), "Exercise…" to the first
  "Try it" / "Exercise" section. Each lands in a markdown cell of type "notes", tagged
  `speaker-notes`, right after the section's heading cell (RISE shows it in the speaker view, T).
  The title slide's notes also say what the hidden set-up cells do.
"""

from __future__ import annotations

import argparse
import ast
import base64
import json
import math
import re
import struct
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import student  # noqa: E402

GUIDE = ROOT / "docs" / "instructor-guide.md"
SKIP_TAGS = {"colab-setup", "slides-skip"}
SOLUTION_TAG = "solution"  # a worked answer (tools/student.py removes them): on a sub-slide of its own
NOTES_TAG = "speaker-notes"
BUDGET_PX = 640  # content height a slide may take; the browser test checks against 700 px
LEAD_IN_LINES = 3  # a markdown cell this short before a plot shares the plot's sub-slide
SHORT_INTRO_PX = 200  # a plot stays on its slide below a heading or a sentence this short

# Heights in CSS pixels as JupyterLab RISE renders a notebook at 1280×800, fitted (least squares) to
# the heights tests/ui/test_ui_slides.py measured on every cell of chapters 00-08: a cell's estimate is
# within about 10 px on average, and the budget leaves room for the rest.
PROSE_CHARS, CODE_CHARS = 165, 150  # characters per rendered line of prose / of printed output
LINE_PX, ITEM_PX, BLOCK_PX, MD_BASE_PX = 18.1, 6.7, 20.4, 17  # prose line, list item, paragraph gap
HEADING_PX = {1: 180, 2: 49, 3: 39}  # the title's `# ` line comes with the Colab badge above it
TABLE_ROW_PX, MATH_PX = 20.1, 48.6
CODE_BASE_PX, CODE_LINE_PX = 22.5, 18.1  # a code cell's input
STREAM_BASE_PX, STREAM_LINE_PX = 6.3, 16.9  # printed output
IMAGE_BASE_PX, SLIDE_WIDTH_PX = 63, 1152  # an inline PNG: its pixel height, shrunk to the slide width
WIDGET_PX = 640  # a live explorer: controls, its 400-px plot area, a readout (03: 678 px with a 450-px area)
HTML_ROW_PX, HTML_BASE_PX, HTML_LINE_PX = 37, 16, 24  # a pandas table's row; lines of other HTML

# --- how tall a cell is on a slide ---------------------------------------------------------------

def _wrapped(text: str, width: int) -> int:
    return max(1, math.ceil(len(text) / width))


def _plain(line: str) -> str:
    """Prose as it renders: links show their text, not their URL; no markup characters."""
    line = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", line)
    return re.sub(r"[*_`$]", "", line)


def markdown_height(source: str) -> float:
    """Estimated height of rendered markdown: headings, paragraphs and lists, tables, maths, code."""
    height, blocks = MD_BASE_PX, re.split(r"\n\s*\n", source.strip())
    for block in blocks:
        lines = [ln for ln in block.splitlines() if ln.strip()]
        if not lines:
            continue
        first = lines[0].lstrip()
        if "colab-badge" in first:  # counted with the title heading below it
            lines, first = lines[1:], (lines[1].lstrip() if len(lines) > 1 else "")
        heading = re.match(r"(#{1,6})\s", first)
        if heading:
            height += HEADING_PX.get(len(heading.group(1)), HEADING_PX[3])
            lines = lines[1:]
            if not lines:
                continue
            first = lines[0].lstrip()
        if first.startswith("```"):
            height += CODE_BASE_PX + CODE_LINE_PX * max(1, len(lines) - 2) + BLOCK_PX
        elif first.startswith("$$"):
            height += MATH_PX * max(1, block.count("$$") // 2) + BLOCK_PX
        elif first.startswith("|"):
            rows = [ln for ln in lines if not re.match(r"\s*\|[\s:|-]+\|\s*$", ln)]
            height += sum(TABLE_ROW_PX * _wrapped(_plain(r), PROSE_CHARS) for r in rows) + BLOCK_PX
        else:  # paragraphs and lists: list items wrap on their own
            items, current = [], ""
            for ln in lines:
                if re.match(r"\s*([-*+]|\d+\.)\s", ln):
                    if current:
                        items.append(current)
                    current = ln.strip()
                else:
                    current += " " + ln.strip()
            items.append(current)
            height += sum(LINE_PX * _wrapped(_plain(i), PROSE_CHARS) for i in items) + BLOCK_PX
            height += ITEM_PX * sum(bool(re.match(r"\s*([-*+]|\d+\.)\s", ln)) for ln in lines)
    return height


def _png_height(data: str) -> float:
    """The PNG's height in pixels (from its header), scaled down if it is wider than the slide."""
    width, height = struct.unpack(">II", base64.b64decode(data[:44])[16:24])
    return IMAGE_BASE_PX + min(height, SLIDE_WIDTH_PX * height / width)


def _text_height(text: str) -> float:
    lines = text.rstrip("\n").split("\n")
    return STREAM_BASE_PX + STREAM_LINE_PX * sum(_wrapped(ln, CODE_CHARS) for ln in lines)


def output_height(output: dict) -> float:
    if output.get("output_type") == "stream":
        return _text_height(output.get("text", ""))
    if output.get("output_type") == "error":
        return _text_height("\n".join(output.get("traceback", [])))
    data = output.get("data", {})
    if "application/vnd.jupyter.widget-view+json" in data:  # an explorer, or a tqdm progress bar
        text = str(data.get("text/plain", ""))
        return WIDGET_PX if re.match(r"[A-Z]\w*\(", text) else _text_height(text)
    if "image/png" in data:
        return _png_height(data["image/png"])
    if "text/html" in data:  # a table (rows), or lines of text such as an explorer's snapshot
        html, text = str(data["text/html"]), str(data.get("text/plain", ""))
        if "<tr" in html:
            return HTML_ROW_PX * html.count("<tr") + STREAM_BASE_PX
        return HTML_BASE_PX + HTML_LINE_PX * (text.count("\n") + 1)
    if "text/markdown" in data:
        return markdown_height(str(data["text/markdown"]))
    return _text_height(str(data.get("text/plain", "")))


def cell_height(cell) -> float:
    """Estimated height of a cell on a slide, in CSS pixels (input and stored outputs)."""
    if cell.cell_type != "code":
        return markdown_height(cell.source)
    height = CODE_BASE_PX + CODE_LINE_PX * max(1, len(cell.source.splitlines()))
    return height + sum(output_height(o) for o in cell.get("outputs", []))


# --- what each cell is on a slide ----------------------------------------------------------------

def heading_level(cell) -> int:
    """2 for a markdown cell with a `## ` heading, 3 for `### ` (the first heading line counts)."""
    if cell.cell_type != "markdown":
        return 0
    match = re.search(r"^(#{1,3})\s", cell.source, flags=re.M)
    return len(match.group(1)) if match and len(match.group(1)) > 1 else 0


def buried_headings(cells: list) -> list[int]:
    """Markdown cells whose section heading is not their first line: RISE can only start a slide at a
    cell, so the text before the heading lands on the new slide. Split such cells at the heading."""
    return [i for i, c in enumerate(cells) if heading_level(c) and not c.source.lstrip().startswith("#")]


def split_at_headings(cells: list) -> list:
    """Markdown cells cut before every `## ` / `### ` heading that is not their first line."""
    out = []
    for cell in cells:
        parts = re.split(r"\n(?=#{2,3}\s)", cell.source) if cell.cell_type == "markdown" else [cell.source]
        parts = [p.strip("\n") for p in parts if p.strip()]
        if len(parts) < 2:
            out.append(cell)
            continue
        for k, part in enumerate(parts):
            piece = nbformat.from_dict({**cell, "source": part, "metadata": dict(cell.metadata)})
            if k and "id" in piece:
                piece.id = f"{cell.id}-{k}"[-64:]
            out.append(piece)
    return out


def is_setup(cell) -> bool:
    """Hidden in the slides: tagged set-up, or a cell of imports (see the module docstring)."""
    if cell.cell_type != "code":
        return False
    if SKIP_TAGS & set(cell.metadata.get("tags", [])):
        return True
    try:
        body = ast.parse(cell.source).body
    except SyntaxError:  # IPython magics: not a plain import cell
        return False
    imports = sum(isinstance(s, (ast.Import, ast.ImportFrom)) for s in body)
    quiet = all(o.get("output_type") == "stream" for o in cell.get("outputs", []))
    starts_with_import = bool(body) and isinstance(body[0], (ast.Import, ast.ImportFrom))
    work = (ast.Try, ast.For, ast.While, ast.With, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    plain = not any(isinstance(s, work) for s in body)  # loops, try, definitions: content, not set-up
    return starts_with_import and 2 * imports > len(body) and plain and quiet


def is_notes(cell) -> bool:
    return NOTES_TAG in cell.metadata.get("tags", [])


def shows_plot(cell) -> bool:
    """A figure or an explorer (a widget whose text form is a container, not a progress bar)."""
    data = [o.get("data", {}) for o in cell.get("outputs", [])]
    return any("image/png" in d or re.match(r"[A-Z]\w*\(", str(d.get("text/plain", "")))
               and "application/vnd.jupyter.widget-view+json" in d for d in data)


def is_solution(cell) -> bool:
    return SOLUTION_TAG in cell.metadata.get("tags", [])


def _short_prose(cell) -> bool:
    """A markdown cell of a sentence or two, without a heading: it leads into, or comments on, a cell."""
    text = cell.source.strip()
    return (cell.cell_type == "markdown" and not text.startswith("#") and not heading_level(cell)
            and len(text.splitlines()) <= LEAD_IN_LINES)


def _only_heading(cell) -> bool:
    """A markdown cell that is a heading line and nothing else."""
    return bool(heading_level(cell)) and len(cell.source.strip().splitlines()) == 1


def slide_types(cells: list) -> list[str]:
    """The RISE slide type of every cell (rules in the module docstring)."""
    kinds: list[str] = []
    used = 0.0  # estimated height of the (sub-)slide being filled
    after_plot = heading_alone = False  # heading_alone: the (sub-)slide so far is one bare heading
    for i, cell in enumerate(cells):
        if is_notes(cell):
            kinds.append("notes")
            continue
        if i > 0 and is_setup(cell):
            kinds.append("skip")
            continue
        height = cell_height(cell)
        if i == 0 or heading_level(cell) == 2:
            kind = "slide"
        elif heading_level(cell) == 3 and not heading_alone:
            kind = "subslide"
        elif is_solution(cell):  # the answer comes after the question, not with it
            kind = "subslide"
        elif after_plot and not (_short_prose(cell) and used + height <= BUDGET_PX):
            kind = "subslide"
        elif used + height > BUDGET_PX or (shows_plot(cell) and used > SHORT_INTRO_PX):
            kind, used = _lead_in(cells, kinds, i, height)
        else:
            kind = "-"
        used = height if kind in ("slide", "subslide") else used + height
        heading_alone = kind in ("slide", "subslide") and _only_heading(cell)
        after_plot = shows_plot(cell) or (after_plot and kind == "-")  # a joined comment: still the plot's
        kinds.append(kind)
    return kinds


def _lead_in(cells: list, kinds: list[str], i: int, height: float) -> tuple[str, float]:
    """Cell i starts a new sub-slide; the short markdown cell that leads into it comes along when both
    fit (a sentence ending in ":" stays with its code, a caption with its plot). Returns cell i's kind
    and the height above it on its sub-slide."""
    j = i - 1
    while kinds[j] in ("notes", "skip"):
        j -= 1
    lead = cells[j]
    fits = cell_height(lead) + height <= BUDGET_PX
    if j > 0 and kinds[j] in ("-", "subslide") and _short_prose(lead) and fits:
        kinds[j] = "subslide"
        return "-", cell_height(lead)
    return "subslide", 0.0


# --- speaker notes from the instructor guide -----------------------------------------------------

def guide_chapters(text: str) -> dict[str, str]:
    """Chapter number ("03") -> its section of the instructor guide (under `### NN …`)."""
    parts = re.split(r"^### (\d\d)\b.*$", text, flags=re.M)
    return {parts[k]: re.split(r"^## ", parts[k + 1], flags=re.M)[0] for k in range(1, len(parts) - 1, 2)}


def _paragraphs(section: str) -> dict[str, str]:
    """'**Goals.** …' paragraphs of a chapter section: label ("Goals", "Run live", …) -> text."""
    found = {}
    for block in re.split(r"\n(?=\*\*[^*\n]+\.\*\*)", "\n" + section):
        match = re.match(r"\*\*([^*\n]+)\.\*\*(.*)", block.strip(), flags=re.S)
        if match:
            found[match.group(1).strip()] = match.group(2).strip()
    return found


def _bullets(text: str) -> list[str]:
    return [" ".join(b.split()) for b in re.split(r"\n\s*- ", "\n" + text) if b.strip()]


def section_number(cell) -> int | None:
    """N of a `## N · …` (or `## Part N: …`) heading in the cell."""
    match = re.search(r"^##\s+(?:Part\s+)?(\d+)\b", cell.source, flags=re.M)
    return int(match.group(1)) if match and cell.cell_type == "markdown" else None


def chapter_notes(section: str, cells: list) -> tuple[dict[int, list[str]], list[str]]:
    """Cell index of a section heading -> its notes; and guide bullets that found no section."""
    paragraphs = _paragraphs(section)
    heads = [i for i, c in enumerate(cells) if heading_level(c) == 2]
    numbered = {section_number(cells[i]): i for i in reversed(heads) if section_number(cells[i]) is not None}

    def first_heading(pattern: str, default: int | None) -> int | None:
        return next((i for i in heads if re.search(pattern, cells[i].source, flags=re.I | re.M)), default)

    notes: dict[int, list[str]] = {}
    lost = []
    if "Goals" in paragraphs:
        notes.setdefault(0, []).append("Goals: " + " ".join(paragraphs["Goals"].split()))
    for bullet in _bullets(paragraphs.get("Run live", "")):
        number = re.match(r"(?:§|Part\s+)(\d+)", bullet)  # "§3, …", "Part 6: …"
        named = re.match(r'"([^"]+)"', bullet)  # '"Your machine": …' names its section
        if number:
            where = numbered.get(int(number.group(1)))
        elif named:
            where = first_heading(r"^##\s+.*" + re.escape(named.group(1)), None)
        else:
            where = 0  # about the whole chapter: the title slide
        if where is None:
            lost.append(bullet)
        else:
            notes.setdefault(where, []).append(bullet)
    last = heads[-1] if heads else 0
    summary = first_heading(r"^##\s+(Summary|Cheat sheet)", last)
    for label in ("Discussion", "Usual mistakes"):
        if label in paragraphs:
            items = _bullets(paragraphs[label])
            notes.setdefault(summary, []).append(f"{label}: " + " ".join(items) if len(items) == 1
                                                 else f"{label}:\n\n" + "\n".join(f"- {b}" for b in items))
    for label, text in paragraphs.items():
        if label.startswith("Exercise"):
            exercise = first_heading(r"^##\s+(\d+\s*\W\s*)?(Try it|Exercise|Part)", summary)
            notes.setdefault(exercise, []).append(f"{label}: " + " ".join(text.split()))
    return notes, lost


def notes_source(lines: list[str]) -> str:
    """The notes cell's text. RISE's speaker view shows a notes cell's source, not its rendering, so
    the text is kept plain: bullets and labels, no bold."""
    body = "\n\n".join(line if re.match(r"(- |[A-Z][\w ]*:)", line) else f"- {line}" for line in lines)
    title = "Speaker notes (from the instructor guide: speaker view, key T)"
    body = re.sub(r"\[([^\]]*)\]\((?!https?:)[^)]*\)", r"\1", body)  # a notebook opened alone has no docs/
    body = re.sub(r"`((?:docs|benchmarks|notebooks)/[^`]*)`", r"\1", body)  # (tests/test_colab.py checks)
    return title + "\n\n" + body.replace("**", "")


# --- applying it to a notebook -------------------------------------------------------------------

def _what_it_sets_up(cell) -> str:
    if "colab-setup" in cell.metadata.get("tags", []):
        return "the Colab set-up (installs kvlab on Colab, nothing elsewhere)"
    try:
        body = ast.parse(cell.source).body
    except SyntaxError:
        body = []
    modules = [a.name.split(".")[0] for s in body if isinstance(s, ast.Import) for a in s.names]
    modules += [s.module.split(".")[0] for s in body if isinstance(s, ast.ImportFrom) and s.module]
    if modules:
        return "the imports (" + ", ".join(dict.fromkeys(modules)) + ") and set-up"
    return "set-up: " + cell.source.strip().splitlines()[0][:80]


def setup_summary(cells: list) -> str | None:
    """What the cells hidden in the slides do, for the title slide's notes."""
    hidden = [_what_it_sets_up(c) for i, c in enumerate(cells) if i > 0 and is_setup(c)]
    if not hidden:
        return None
    return ("Hidden in the slides: " + "; ".join(hidden) + ". Run all cells (Run → Run All Cells) before "
            "presenting, so the live cells find what they need.")


def apply(nb, split: bool = False) -> None:
    """Set the slide type of every cell of `nb` in place, and drop any speaker-notes cell: a learner's
    notebook carries none (`deck` adds them to the presenter's copy). With split=True, first split
    markdown cells at buried headings (split_at_headings)."""
    cells = [c for c in nb.cells if not is_notes(c)]
    if split:
        cells = split_at_headings(cells)
    for cell, kind in zip(cells, slide_types(cells), strict=True):
        cell.metadata["slideshow"] = {**cell.metadata.get("slideshow", {}), "slide_type": kind}
    nb.cells = cells


def deck(nb, guide_text: str | None, chapter: str | None):
    """The presenter's copy of `nb`: its cells and outputs with the guide's speaker notes added as
    markdown cells of slide type "notes" (tagged `speaker-notes`; RISE shows them in the speaker
    view, key T). Returns (the copy, guide bullets that found no section); `nb` is not changed.
    The other cells keep the slide types `apply` gives them: a notes cell takes no room on a slide."""
    copy = nbformat.from_dict(json.loads(json.dumps(nb)))
    apply(copy)
    cells = copy.cells
    section = guide_chapters(guide_text).get(chapter or "", "") if guide_text else ""
    notes, lost = chapter_notes(section, cells) if section else ({}, [])
    summary = setup_summary(cells)
    if summary:
        notes.setdefault(0, []).insert(0, summary)
    # Each notes cell goes after its heading cell and the set-up cells right after it (hidden, so the
    # notes still land on the heading's slide).
    place = {}
    for i in notes:
        j = i
        while j + 1 < len(cells) and is_setup(cells[j + 1]):
            j += 1
        place[j] = i
    new = []
    for j, cell in enumerate(cells):
        new.append(cell)
        if j in place:
            i = place[j]
            note = nbformat.v4.new_markdown_cell(notes_source(notes[i]))
            note.metadata["tags"] = [NOTES_TAG]
            note.metadata["slideshow"] = {"slide_type": "notes"}
            if copy.nbformat_minor >= 5:  # cell ids exist from nbformat 4.5 on; fixed ones keep decks equal
                note.id = f"speaker-notes-{i}"
            else:
                note.pop("id", None)
            new.append(note)
    copy.cells = new
    # A slide of one cell taller than the screen cannot be split at a cell boundary: the deck scrolls
    # it (RISE's `scroll` option) instead of cutting it off.
    copy.metadata["rise"] = {**copy.metadata.get("rise", {}), "scroll": True}
    return copy, lost


def fix(path: Path, split: bool = False) -> bool:
    """Rewrite one notebook's slide metadata (and drop any notes cell); True if it changed.

    Reads, computes and writes in one short step, and writes only if the file did not change
    meanwhile (other tools edit notebooks too): if it did, it starts again from the new file.
    """
    for _ in range(5):
        before = path.read_bytes()
        nb = nbformat.reads(before.decode("utf-8"), as_version=4)
        apply(nb, split)
        for i in buried_headings(nb.cells):
            print(f"{path.name}: cell {i} has its heading below other text (--split-headings splits it)",
                  file=sys.stderr)
        after = nbformat.writes(nb) + "\n"
        if json.loads(after) == json.loads(before):
            return False
        if path.read_bytes() == before:
            path.write_text(after, encoding="utf-8")
            return True
    raise RuntimeError(f"{path} kept changing while slides.py was updating it")


DECKS = ROOT / "slides"  # the presenter's copies (not in git), written by `make slides`


def write_decks(paths: list[Path], out_dir: Path = DECKS, force: bool = False, guide: Path | None = GUIDE,
                log=print) -> list[Path]:
    """Write each notebook's deck (`deck`) into out_dir; return the paths written. A deck changed since
    this tool wrote it (cells run or edited while presenting) is kept, as tools/student.py keeps a
    learner's copy; force=True replaces it after a backup."""
    guide_text = guide.read_text(encoding="utf-8") if guide and guide.is_file() else None

    def make(nb, path: Path):
        chapter = path.name[:2] if path.name[:2].isdigit() else None
        presented, lost = deck(nb, guide_text, chapter)
        for bullet in lost:
            log(f"{path.name}: no section for the guide's note {bullet[:60]!r}…")
        return presented

    return student.write_copies(paths, out_dir, force, log, transform=make,
                                remake="make slides FORCE=1")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="*", type=Path, help="default: every notebooks/*.ipynb")
    parser.add_argument("--split-headings", action="store_true",
                        help="split markdown cells at a heading below other text")
    parser.add_argument("--decks", action="store_true",
                        help="write the presenter's copies, with speaker notes, instead (default: slides/)")
    parser.add_argument("--out", type=Path, default=DECKS, help="folder of the decks (with --decks)")
    parser.add_argument("--force", action="store_true", help="with --decks: replace decks you changed")
    args = parser.parse_args(argv)
    paths = args.notebooks or sorted((ROOT / "notebooks").glob("*.ipynb"))
    if args.decks:
        write_decks(paths, args.out, args.force)
        print(f"slides: open {args.out.name}/NN_name.ipynb in JupyterLab (make lab), then Alt+R; "
              "T shows the speaker notes")
        return
    for p in paths:
        if fix(p, split=args.split_headings):
            print(f"updated {p}")


if __name__ == "__main__":
    main(sys.argv[1:])
