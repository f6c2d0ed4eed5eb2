"""Every chapter presents as slides with JupyterLab RISE: each cell carries slideshow metadata."""

import importlib.util
import shutil
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
spec = importlib.util.spec_from_file_location("kvlab_tools_slides", ROOT / "tools" / "slides.py")
slides = importlib.util.module_from_spec(spec)
spec.loader.exec_module(slides)
ALLOWED = {"slide", "subslide", "fragment", "skip", "notes", "-"}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_every_cell_has_a_slide_type_and_cell_0_is_a_slide(path):
    cells = nbformat.read(path, as_version=4).cells
    kinds = [c.metadata.get("slideshow", {}).get("slide_type") for c in cells]
    missing = [i for i, k in enumerate(kinds) if k not in ALLOWED]
    assert not missing, f"cells without a valid slideshow.slide_type: {missing}"
    assert kinds[0] == "slide"
    assert kinds.count("slide") >= 2, "one slide for the whole chapter: mark sections with '## '"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_running_slides_again_changes_nothing(path, tmp_path):
    copy = tmp_path / path.name
    shutil.copy(path, copy)
    assert slides.fix(copy) is False
    assert copy.read_bytes() == path.read_bytes()


def test_slide_rules(tmp_path):
    md, code = nbformat.v4.new_markdown_cell, nbformat.v4.new_code_cell
    setup = code("import sys")
    setup.metadata["tags"] = ["colab-setup"]
    nb = nbformat.v4.new_notebook(cells=[md("# Title"), setup, code("x = 1"), md("## Section"),
                                         md("### Part"), md("plain prose"), code("")])
    out = code("print(1)")
    out.outputs = [nbformat.v4.new_output("stream", text="1\n")]
    nb.cells.append(out)
    path = tmp_path / "demo.ipynb"
    nbformat.write(nb, path)
    assert slides.fix(path) is True
    cells = nbformat.read(path, as_version=4).cells
    assert [c.metadata.slideshow.slide_type for c in cells] == [
        "slide", "skip", "-", "slide", "subslide", "-", "-", "-"]
    assert cells[-1].outputs[0].text == "1\n"  # outputs untouched
    assert slides.fix(path) is False
