"""Every notebook opens on Colab: a badge to its own file and a set-up cell that installs only there.

Both come from tools/colab.py (the one place the repository is named); these tests check that the
notebooks agree with it, that the script is idempotent, and that the GPU chapter says how to get a GPU.
"""

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from needs import load_tool

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))




colab = load_tool("colab")
ids = [p.name for p in NOTEBOOKS]


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no .ipynb"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_cell_0_starts_with_the_badge_to_this_very_notebook(path):
    cell = nbformat.read(path, as_version=4).cells[0]
    assert cell.cell_type == "markdown"
    first = cell.source.splitlines()[0]
    assert first == colab.badge(path.name)
    url = f"https://colab.research.google.com/github/{colab.REPO}/blob/{colab.BRANCH}/notebooks/{path.name}"
    assert f"({url})" in first
    assert "\n# " in "\n" + cell.source, "cell 0 should also hold the chapter title"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_cell_1_is_the_setup_cell_and_only_it(path):
    cells = nbformat.read(path, as_version=4).cells
    setup = cells[1]
    assert setup.cell_type == "code"
    assert colab.SETUP_TAG in setup.metadata.get("tags", [])
    assert setup.source == colab.setup_source()
    others = [i for i, c in enumerate(cells) if i != 1 and colab.SETUP_TAG in c.metadata.get("tags", [])]
    assert not others, f"more set-up cells at {others}"
    badges = [i for i, c in enumerate(cells) if i and "colab-badge.svg" in c.source]
    assert not badges, f"stray badges in cells {badges}"


def test_setup_installs_from_the_repository_only_under_the_colab_guard():
    src = colab.setup_source()
    assert f"kvlab[hf] @ git+https://github.com/{colab.REPO}@{colab.BRANCH}" in src
    tree = ast.parse(src)
    guards = [node for node in tree.body if isinstance(node, ast.If)]
    assert len(guards) == 1
    assert ast.unparse(guards[0].test) == "'google.colab' in sys.modules"
    assert not guards[0].orelse
    outside = [node for node in tree.body if node is not guards[0]]
    assert all(isinstance(node, ast.Import) for node in outside), "only `import sys` outside the guard"
    assert "pip" in ast.unparse(guards[0])


def test_setup_cell_does_nothing_off_colab(monkeypatch):
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: calls.append(a))
    monkeypatch.delitem(sys.modules, "google.colab", raising=False)
    exec(colab.setup_source(), {})
    assert calls == []


def test_setup_cell_installs_on_colab_kvlab_then_the_model_without_its_dependencies(monkeypatch):
    calls = []
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: calls.append(a[0]))
    monkeypatch.setitem(sys.modules, "google.colab", object())
    exec(colab.setup_source(), {})
    assert len(calls) == 2 and all(c[1:4] == ["-m", "pip", "install"] for c in calls)
    assert calls[0][-1].startswith("kvlab[hf] @ git+https://github.com/")
    assert calls[1][-2:] == ["--no-deps", colab.MODEL]  # its declared dependencies compile llama.cpp


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_running_the_script_again_changes_nothing(path, tmp_path):
    copy = tmp_path / path.name
    shutil.copy(path, copy)
    assert colab.fix(copy) is False
    assert copy.read_bytes() == path.read_bytes()


def test_the_script_repairs_a_notebook_and_is_then_idempotent(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell("[![Open In Colab](https://colab.research.google.com/assets/"
                                      "colab-badge.svg)](https://example.org/old)\n# 99 A title"),
        nbformat.v4.new_code_cell("print('first code cell')"),
    ])
    path = tmp_path / "99_demo.ipynb"
    nbformat.write(nb, path)
    assert colab.fix(path) is True
    cells = nbformat.read(path, as_version=4).cells
    assert cells[0].source == colab.badge("99_demo.ipynb") + "\n# 99 A title"
    assert cells[1].source == colab.setup_source() and cells[2].source == "print('first code cell')"
    before = path.read_bytes()
    assert colab.fix(path) is False and path.read_bytes() == before


def test_the_script_moves_a_misplaced_set_up_cell_right_after_the_title(tmp_path):
    setup = nbformat.v4.new_code_cell(colab.setup_source(), metadata={"tags": [colab.SETUP_TAG]})
    nb = nbformat.v4.new_notebook(cells=[
        nbformat.v4.new_markdown_cell(colab.badge("98_demo.ipynb") + "\n# 98 A title"),
        nbformat.v4.new_markdown_cell("**Speaker notes**"), setup, nbformat.v4.new_code_cell("x = 1")])
    path = tmp_path / "98_demo.ipynb"
    nbformat.write(nb, path)
    assert colab.fix(path) is True
    cells = nbformat.read(path, as_version=4).cells
    assert [c.source.split("\n")[0] for c in cells[2:]] == ["**Speaker notes**", "x = 1"]
    assert cells[1].source == colab.setup_source() and cells[1].metadata["tags"] == [colab.SETUP_TAG]
    assert sum(colab.SETUP_TAG in c.metadata.get("tags", []) for c in cells) == 1


def test_the_gpu_chapter_says_how_to_switch_colab_to_a_gpu():
    gpu = [p for p in NOTEBOOKS if p.name.startswith("06_")]
    assert gpu, "chapter 06 (the GPU chapter) is missing"
    text = "\n".join(c.source for c in nbformat.read(gpu[0], as_version=4).cells if c.cell_type == "markdown")
    assert "Change runtime type" in text


# --- a notebook opened alone (Colab): no path outside it, links absolute and at REPO --------------

MD_LINK = re.compile(r"\]\(\s*([^)\s]+)")
PROJECT_LINK = re.compile(r"https://([\w.-]+)\.github\.io/(kvlab[\w.-]*)|https://github\.com/([\w.-]+)/(kvlab[\w.-]*)")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_no_code_cell_reads_a_path_outside_the_notebook(path):
    cells = nbformat.read(path, as_version=4).cells
    bad = [(i, line.strip()) for i, c in enumerate(cells) if c.cell_type == "code"
           for line in c.source.splitlines() if "../" in line]
    assert not bad, f"on Colab the notebook is alone, nothing lies beside it: {bad}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_links_are_absolute_and_repository_paths_are_links(path):
    cells = nbformat.read(path, as_version=4).cells
    relative = [(i, url) for i, c in enumerate(cells) if c.cell_type == "markdown"
                for url in MD_LINK.findall(c.source) if not re.match(r"^(https?:|mailto:|#|data:)", url)]
    assert not relative, (f"relative links break when the notebook is opened alone; use colab.site_url(…) "
                          f"or colab.repo_url(…): {relative}")
    bare = [(i, m) for i, c in enumerate(cells) if c.cell_type == "markdown"
            for m in re.findall(r"`((?:docs|benchmarks|notebooks)/[^`]*)`", c.source)]
    assert not bare, f"repository paths that do not exist beside a lone notebook; link them instead: {bare}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=ids)
def test_links_to_the_course_site_and_repository_use_repo(path):
    text = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells)
    owner, name = colab.REPO.lower().split("/")
    stale = [m.group(0) for m in PROJECT_LINK.finditer(text)
             if [g.lower() for g in m.groups() if g] != [owner, name]]
    assert not stale, f"links to another repository than REPO={colab.REPO!r}: {stale}"


def test_site_and_repository_urls_follow_repo():
    owner, name = colab.REPO.split("/")
    assert colab.site_url("docs/glossary.html") == f"https://{owner.lower()}.github.io/{name}/docs/glossary.html"
    assert colab.repo_url() == f"https://github.com/{colab.REPO}"
    assert colab.repo_url("benchmarks/") == f"https://github.com/{colab.REPO}/tree/{colab.BRANCH}/benchmarks"
    assert colab.repo_url("docs/glossary.md") == f"https://github.com/{colab.REPO}/blob/{colab.BRANCH}/docs/glossary.md"
