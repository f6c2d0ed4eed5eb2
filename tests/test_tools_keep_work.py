"""The course's tools never destroy what they did not create, and say what they wrote.

Each test runs on temporary copies: a fake repository for the site's output checks, a temporary
student/ folder, temporary benchmark folders.
"""

from __future__ import annotations

import json
import shutil

import nbformat
import pytest
from needs import ROOT, load_tool

site = load_tool("site")
student = load_tool("student")
bench_data = load_tool("bench_data")
NOTEBOOK = sorted((ROOT / "notebooks").glob("*.ipynb"))[0]


# --- tools/site.py --out --------------------------------------------------------------------------

@pytest.fixture
def repo(tmp_path):
    """A stand-in repository: a .git folder, notebooks and an unrelated folder beside it."""
    root = tmp_path / "repo"
    (root / ".git").mkdir(parents=True)
    (root / "notebooks").mkdir()
    (root / "notebooks" / "00_welcome.ipynb").write_text("{}")
    (tmp_path / "neighbour").mkdir()
    (tmp_path / "neighbour" / "keep.txt").write_text("mine")
    return root


@pytest.mark.parametrize("where", [".", "..", "notebooks", "kvlab/data"])
def test_site_refuses_the_repository_and_its_folders(repo, where):
    with pytest.raises(site.UnsafeOutputError, match="repository"):
        site.check_output(repo / where, repo)
    assert (repo / ".git").is_dir() and (repo / "notebooks" / "00_welcome.ipynb").exists()


def test_site_refuses_a_folder_it_did_not_build(repo, tmp_path):
    with pytest.raises(site.UnsafeOutputError, match="no .kvlab-site marker"):
        site.check_output(tmp_path / "neighbour", repo)
    assert (tmp_path / "neighbour" / "keep.txt").read_text() == "mine"


def test_site_refuses_a_file(repo, tmp_path):
    with pytest.raises(site.UnsafeOutputError, match="is a file"):
        site.check_output(tmp_path / "neighbour" / "keep.txt", repo)


def test_site_accepts_new_empty_and_earlier_builds(repo, tmp_path):
    site.check_output(tmp_path / "new", repo)
    site.check_output(repo / "_build" / "site", repo)
    (tmp_path / "empty").mkdir()
    site.check_output(tmp_path / "empty", repo)
    old = tmp_path / "old-build"
    old.mkdir()
    (old / site.MARKER).write_text("")
    (old / "index.html").write_text("")
    site.check_output(old, repo)


def test_site_command_line_refuses_the_repository_and_deletes_nothing():
    before = sorted(p.name for p in ROOT.iterdir())
    with pytest.raises(SystemExit, match="refused: .*repository"):
        site.main(["--out", str(ROOT)])
    with pytest.raises(SystemExit, match="refused"):
        site.main(["--out", str(ROOT / "notebooks")])
    assert sorted(p.name for p in ROOT.iterdir()) == before
    assert len(list((ROOT / "notebooks").glob("*.ipynb"))) >= 10


# --- tools/student.py -----------------------------------------------------------------------------

def test_student_keeps_a_copy_the_learner_changed(tmp_path):
    said: list[str] = []
    (copy,) = student.write_copies([NOTEBOOK], tmp_path, log=said.append)
    assert said == [f"wrote {copy}"]
    nb = nbformat.read(copy, as_version=4)
    nb.cells[0].source += "\nmy notes"
    nbformat.write(nb, copy)
    mine = copy.read_text()

    said.clear()
    assert student.write_copies([NOTEBOOK], tmp_path, log=said.append) == []
    assert copy.read_text() == mine
    assert len(said) == 1 and said[0].startswith(f"kept {copy}") and "make student FORCE=1" in said[0]


def test_student_refuses_an_output_that_is_a_file(tmp_path, capsys):
    target = tmp_path / "notes.txt"
    target.write_text("mine")
    with pytest.raises(SystemExit):
        student.main(["--out", str(target), str(NOTEBOOK)])
    assert "is a file, not a folder" in capsys.readouterr().err and target.read_text() == "mine"


def test_student_rewrites_its_own_unchanged_copy(tmp_path):
    (copy,) = student.write_copies([NOTEBOOK], tmp_path, log=lambda _m: None)
    assert student.write_copies([NOTEBOOK], tmp_path, log=lambda _m: None) == [copy]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([copy.name, student.MANIFEST])


def test_student_keeps_a_copy_it_never_wrote(tmp_path):
    foreign = tmp_path / NOTEBOOK.name
    foreign.write_text("a learner's own file")
    assert student.write_copies([NOTEBOOK], tmp_path, log=lambda _m: None) == []
    assert foreign.read_text() == "a learner's own file"


def test_student_force_replaces_after_a_backup(tmp_path):
    foreign = tmp_path / NOTEBOOK.name
    foreign.write_text("a learner's own file")
    said: list[str] = []
    assert student.write_copies([NOTEBOOK], tmp_path, force=True, log=said.append) == [foreign]
    (backup,) = tmp_path.glob(f"{NOTEBOOK.stem}.*.bak.ipynb")
    assert backup.read_text() == "a learner's own file"
    assert any(m.startswith("backed up") for m in said)
    assert json.loads((tmp_path / student.MANIFEST).read_text())[foreign.name]
    nbformat.read(foreign, as_version=4)  # a notebook again


# --- tools/bench_data.py --------------------------------------------------------------------------

def test_bench_data_refuses_an_empty_source_and_changes_nothing(tmp_path):
    source, target = tmp_path / "benchmarks", tmp_path / "shipped"
    source.mkdir()
    target.mkdir()
    (target / "old.json").write_text("{}")
    with pytest.raises(SystemExit, match="holds no"):
        bench_data.ship(source, target, log=lambda _m: None)
    assert (target / "old.json").read_text() == "{}"


def test_bench_data_copies_removes_stale_and_says_so(tmp_path):
    source, target = tmp_path / "benchmarks", tmp_path / "shipped"
    shutil.copytree(ROOT / "benchmarks", source)
    target.mkdir()
    (target / "gone.json").write_text("{}")
    said: list[str] = []
    changed = bench_data.ship(source, target, log=said.append)
    names = sorted(p.name for p in source.glob("*.json"))
    assert sorted(p.name for p in target.glob("*.json")) == names
    assert len(changed) == len(names) + 1 and any("removed" in m and "gone.json" in m for m in said)
    said.clear()
    assert bench_data.ship(source, target, log=said.append) == [] and "already matches" in said[0]
