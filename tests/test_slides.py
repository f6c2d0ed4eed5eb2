"""Every chapter presents as slides (JupyterLab RISE): tools/slides.py's rules, and notebooks following them.

The browser test tests/ui/test_ui_slides.py measures the slides themselves; these tests run without a
browser: the slide types, the height estimate, the speaker notes from the instructor guide (in the
presenter's decks only: a learner's notebook carries none), and that running the tool again changes
nothing in any notebook.
"""

import base64
import importlib.util
import shutil
import struct
import zlib
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
spec = importlib.util.spec_from_file_location("kvlab_tools_slides", ROOT / "tools" / "slides.py")
slides = importlib.util.module_from_spec(spec)
spec.loader.exec_module(slides)
ALLOWED = {"slide", "subslide", "fragment", "skip", "notes", "-"}
md, code = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell


def png(width: int, height: int) -> str:
    """A real, tiny grey PNG of the given size, base64-encoded as a notebook stores it."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    raw = b"".join(b"\x00" + b"\x80" * width for _ in range(height))
    data = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    return base64.b64encode(data).decode()


def plot_cell(source: str, width: int = 600, height: int = 300):
    cell = code(source)
    cell.outputs = [nbformat.v4.new_output("display_data", data={"image/png": png(width, height),
                                                                 "text/plain": "<Figure>"})]
    return cell


def run(tmp_path, cells, name="03_demo.ipynb"):
    """Write a notebook, apply the tool, return its cells."""
    path = tmp_path / name
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)
    assert slides.fix(path) is True
    assert slides.fix(path) is False, "a second run changed the notebook"
    return nbformat.read(path, as_version=4).cells


def presented(cells, guide_text=None, chapter="03"):
    """The deck's cells of a notebook of these cells (with the guide's notes)."""
    deck, _ = slides.deck(nbformat.v4.new_notebook(cells=cells), guide_text, chapter)
    return deck.cells


def kinds(cells):
    return [c.metadata.slideshow.slide_type for c in cells]


# --- the notebooks ----------------------------------------------------------------------------------

@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_every_cell_has_a_slide_type_and_cell_0_is_a_slide(path):
    cells = nbformat.read(path, as_version=4).cells
    types = [c.metadata.get("slideshow", {}).get("slide_type") for c in cells]
    missing = [i for i, k in enumerate(types) if k not in ALLOWED]
    assert not missing, f"cells without a valid slideshow.slide_type: {missing}"
    assert types[0] == "slide"
    assert types.count("slide") >= 2, "one slide for the whole chapter: mark sections with '## '"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_running_slides_again_changes_nothing(path, tmp_path):
    """The notebook is what `python tools/slides.py` makes of it (run it after editing a chapter)."""
    copy = tmp_path / path.name
    shutil.copy(path, copy)
    assert slides.fix(copy) is False, f"run `python tools/slides.py {path.relative_to(ROOT)}`"
    assert copy.read_bytes() == path.read_bytes()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_a_learners_notebook_carries_no_speaker_notes(path):
    cells = nbformat.read(path, as_version=4).cells
    notes = [i for i, c in enumerate(cells) if slides.is_notes(c) or "Speaker notes" in c.source
             or c.metadata.get("slideshow", {}).get("slide_type") == "notes"]
    assert not notes, f"cells {notes} are speaker notes: they belong in the decks (make slides)"


def test_every_chapters_deck_has_the_guides_notes_and_the_notebooks_slides(tmp_path):
    """`make slides` writes one deck a chapter: the notebook's cells, outputs and slide types, plus the
    guide's notes as cells of slide type "notes"; a deck changed since (run while presenting) is kept."""
    said = []
    written = slides.write_decks(NOTEBOOKS, tmp_path, log=said.append)
    assert [p.name for p in written] == [p.name for p in NOTEBOOKS]
    for path, deck_path in zip(NOTEBOOKS, written, strict=True):
        nb, deck = nbformat.read(path, as_version=4), nbformat.read(deck_path, as_version=4)
        notes = [c for c in deck.cells if slides.is_notes(c)]
        assert notes and all(c.metadata.slideshow.slide_type == "notes" for c in notes), path.name
        assert notes[0].source.startswith("Speaker notes") and "Goals" in notes[0].source, path.name
        rest = [c for c in deck.cells if not slides.is_notes(c)]
        assert [c.source for c in rest] == [c.source for c in nb.cells]
        assert [c.get("outputs") for c in rest] == [c.get("outputs") for c in nb.cells]
        slides.apply(nb)  # the notebook's slides (test_running_slides_again_changes_nothing: as stored)
        assert kinds(rest) == kinds(nb.cells), f"{path.name}: the notes moved a slide"
    assert not any("no section" in s for s in said), said
    deck = nbformat.read(written[3], as_version=4)
    deck.cells[2].source += "\n# run while presenting"
    nbformat.write(deck, written[3])
    said.clear()
    assert written[3] not in slides.write_decks(NOTEBOOKS, tmp_path, log=said.append)
    assert any(s.startswith(f"kept {written[3]}") and "make slides FORCE=1" in s for s in said), said


def test_an_old_notes_cell_is_dropped_from_a_notebook(tmp_path):
    old = md("Speaker notes (from the instructor guide: speaker view, key T)\n\n- Goals: …")
    old.metadata["tags"] = [slides.NOTES_TAG]
    cells = run(tmp_path, [md("# 03 Title"), old, md("## 1 · Shape"), code("x = 1")])
    assert [c.source.splitlines()[0] for c in cells] == ["# 03 Title", "## 1 · Shape", "x = 1"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_every_run_live_note_of_the_guide_finds_its_section(path):
    """A `§N` bullet in the instructor guide's "Run live" list must match a `## N …` heading of the
    chapter, or its speaker note would be lost (renumbered sections, a renamed chapter)."""
    section = slides.guide_chapters(slides.GUIDE.read_text(encoding="utf-8")).get(path.name[:2])
    if section is None:
        pytest.skip(f"docs/instructor-guide.md has no section for chapter {path.name[:2]} yet")
    cells = [c for c in nbformat.read(path, as_version=4).cells if not slides.is_notes(c)]
    _, lost = slides.chapter_notes(section, cells)
    assert not lost, "guide notes with no matching section heading:\n" + "\n".join(lost)


def test_slides_and_colab_tools_agree(tmp_path):
    """tools/colab.py keeps the set-up cell at index 1; the notes must not push it away (or the two
    tools would undo each other's work on every run)."""
    colab_spec = importlib.util.spec_from_file_location("kvlab_tools_colab", ROOT / "tools" / "colab.py")
    colab = importlib.util.module_from_spec(colab_spec)
    colab_spec.loader.exec_module(colab)
    copy = tmp_path / NOTEBOOKS[0].name
    shutil.copy(NOTEBOOKS[0], copy)
    slides.fix(copy)
    assert colab.fix(copy) is False
    assert slides.fix(copy) is False


# --- the rules ------------------------------------------------------------------------------------

def test_structure_setup_and_outputs(tmp_path):
    setup = code("import sys")
    setup.metadata["tags"] = ["colab-setup"]
    helper = code("def helper():\n    return 1")
    helper.metadata["tags"] = ["slides-skip"]
    printed = code("print(1)")
    printed.outputs = [nbformat.v4.new_output("stream", text="1\n")]
    imports = code("import torch\nimport kvlab\n\n_ = torch.manual_seed(0)")
    mostly_work = code("import torch\ny = torch.ones(3)\nz = y * 2\nprint(z)")  # not a set-up cell
    tries = code("from kvlab import hf\n\ntry:\n    real = hf.load()\nexcept ImportError:\n    real = None")
    source = [md("# Title"), setup, imports, helper, code("x = 1"), md("## Section"), md("### Part"),
              md("plain prose"), printed, mostly_work, tries]
    cells = run(tmp_path, source)
    # "### Part" right after the bare "## Section" stays on its slide: no slide holds a title alone
    assert kinds(cells) == ["slide", "skip", "skip", "skip", "-", "slide", "-", "-", "-", "-", "-"]
    assert cells[8].outputs[0].text == "1\n"  # outputs untouched
    deck = presented(cells)
    assert kinds(deck) == ["slide", "skip", "skip", "skip", "notes", "-", "slide", "-", "-", "-", "-", "-"]
    hidden = deck[4].source  # the title slide's notes (after the hidden cells) say what those do
    assert "Colab set-up" in hidden and "imports (torch, kvlab)" in hidden and "def helper" in hidden


def test_a_run_taller_than_the_budget_continues_on_a_sub_slide(tmp_path):
    long_code = "\n".join(f"x{i} = {i}" for i in range(20))  # about 390 px
    assert 300 < slides.cell_height(code(long_code)) < slides.BUDGET_PX
    cells = run(tmp_path, [md("# Title"), md("## Section")] + [code(long_code) for _ in range(3)])
    assert kinds(cells) == ["slide", "slide", "-", "subslide", "subslide"]


def test_a_plot_gets_a_sub_slide_with_its_lead_in(tmp_path):
    prose = md(" ".join(["A long paragraph of explanation."] * 60))  # several lines of prose
    lead = md("The plot below shows it:")
    comment = md("What the plot shows.")  # a short comment stays with its plot
    longer = md("\n".join(["A longer discussion of it."] * 4))  # anything longer goes on
    cells = run(tmp_path, [md("# Title"), md("## Section"), prose, lead, plot_cell("fig = draw()"), comment,
                           longer, md("## Next\n\nOne line."), plot_cell("fig = draw()")])
    assert kinds(cells) == ["slide", "slide", "-", "subslide", "-", "-", "subslide", "slide", "-"]


def test_a_sentence_leading_into_code_moves_with_it_and_solutions_come_after_their_question(tmp_path):
    long_code = "\n".join(f"x{i} = {i}" for i in range(20))  # about 390 px
    question = md("Exercise: what is x19?")
    solution = code("answer = 19")
    solution.metadata["tags"] = ["solution"]
    cells = run(tmp_path, [md("# Title"), md("## Section"), code(long_code), md("The same, once more:"),
                           code(long_code), question, solution, code("check(answer)")])
    assert kinds(cells) == ["slide", "slide", "-", "subslide", "-", "-", "subslide", "-"]


def test_height_estimate_reads_images_and_grows_with_content():
    short, longer = md("One line."), md("One line.\n\n" + "More text. " * 100)
    assert slides.cell_height(longer) > slides.cell_height(short) + 3 * slides.LINE_PX
    small, tall = plot_cell("f()", 600, 200), plot_cell("f()", 600, 500)
    assert slides.cell_height(tall) - slides.cell_height(small) == pytest.approx(300)
    wide = plot_cell("f()", 2 * slides.SLIDE_WIDTH_PX, 600)  # shown at the slide's width: half as tall
    assert slides.cell_height(wide) - slides.cell_height(small) == pytest.approx(100)


GUIDE = """# Guide

## Chapter by chapter

### 03 How big is the cache? (50 min)

**Goals.** Size the cache.

**Run live.**
- §1, the shape: say it out loud.
- §2, published models.
- Before the chapter: check the projector.

**Discussion.**
- Weights or cache?

**Usual mistakes.** Forgetting the factor 2.

**Exercise and solution.** "Try it: size the cache"; solution after it.

### 04 Next chapter (50 min)

**Goals.** Not this one.

## When something goes wrong
"""


def test_speaker_notes_come_from_the_guide_and_are_rewritten_not_repeated(tmp_path):
    cells = [md("# 03 Title"), md("## 1 · Shape\n\nText."), code("x = 1"), md("## 2 · Published models"),
             md("## Try it: size the cache"), md("## Summary\n\n- done")]
    out = presented(run(tmp_path, cells), GUIDE)
    notes = {i: c.source for i, c in enumerate(out) if slides.is_notes(c)}
    assert [kinds(out)[i] for i in notes] == ["notes"] * 5
    after = {out[i - 1].source.splitlines()[0]: text for i, text in notes.items()}
    assert "Size the cache" in after["# 03 Title"] and "check the projector" in after["# 03 Title"]
    assert "say it out loud" in after["## 1 · Shape"]
    assert "published models" in after["## 2 · Published models"]
    assert "Try it: size the cache" in after["## Try it: size the cache"]
    assert "Weights or cache?" in after["## Summary"] and "factor 2" in after["## Summary"]
    assert "Not this one" not in "".join(notes.values())
    # a deck of a deck: the notes are rewritten, not repeated; the guide changes: the notes follow
    assert [c.source for c in presented(out, GUIDE)] == [c.source for c in out]
    again = presented(out, GUIDE.replace("say it out loud", "ask the room"))
    assert len(again) == len(out)
    assert "ask the room" in "".join(c.source for c in again if slides.is_notes(c))


def test_a_guide_note_for_a_missing_section_is_reported(tmp_path):
    section = slides.guide_chapters(GUIDE)["03"]
    _, lost = slides.chapter_notes(section, [md("# 03 Title"), md("## 1 · Shape")])
    assert lost == ["§2, published models."]


def test_split_headings_cuts_a_cell_before_its_heading_and_keeps_the_text(tmp_path):
    tail_and_heading = md("The end of section 1.\n\n## 2 · Next section\n\nIts first line.\n\n"
                          "### A part\n\nMore.")
    cells = [md("# Title"), md("## 1 · First\n\nText."), tail_and_heading, code("x = 1")]
    assert slides.buried_headings(cells) == [2]
    path = tmp_path / "demo.ipynb"
    nbformat.write(nbformat.v4.new_notebook(cells=cells), path)
    assert slides.fix(path, split=True) is True
    assert slides.fix(path, split=True) is False
    assert slides.fix(path) is False  # a plain run keeps the split
    out = nbformat.read(path, as_version=4).cells
    assert [c.source.splitlines()[0] for c in out] == [
        "# Title", "## 1 · First", "The end of section 1.", "## 2 · Next section", "### A part", "x = 1"]
    assert kinds(out) == ["slide", "slide", "-", "slide", "subslide", "-"]
    assert "\n\n".join(c.source for c in out[2:5]) == tail_and_heading.source
    assert len({c.id for c in out}) == len(out)


def test_guide_bullets_may_name_a_part_or_a_section_by_name():
    section = ('**Run live.**\n- Part 2: the formulas cell.\n- "A first taste": the tiny model writes.\n'
               '- "No such section": lost.\n')
    cells = [md("# 08 Title"), md("## Part 1: misconceptions"), md("## Part 2: the formulas"),
             md("## A first taste")]
    notes, lost = slides.chapter_notes(section, cells)
    assert notes == {2: ["Part 2: the formulas cell."], 3: ['"A first taste": the tiny model writes.']}
    assert lost == ['"No such section": lost.']
