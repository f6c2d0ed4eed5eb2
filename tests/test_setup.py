"""The set-up a newcomer relies on: environment.yml, pyproject.toml, Makefile and CI agree."""

import re
from pathlib import Path

import pytest
import yaml

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

ROOT = Path(__file__).resolve().parents[1]
CONDA_NAMES = {"pytorch": "torch"}  # conda-forge name -> PyPI name


def name_of(requirement: str) -> str:
    name = re.split(r"[<>=!~\[ ;]", requirement.strip(), maxsplit=1)[0]
    return CONDA_NAMES.get(name, name).lower().replace("_", "-")


def pyproject_names() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        reqs += extra
    return {name_of(r) for r in reqs}


def environment_names() -> set[str]:
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    assert env["channels"] == ["conda-forge"]
    names = set()
    for dep in env["dependencies"]:
        if isinstance(dep, dict):
            names |= {name_of(p) for p in dep["pip"] if not p.startswith("-e")}
        elif name_of(dep) not in {"python", "pip"}:
            names.add(name_of(dep))
    return names


def test_environment_yml_names_the_same_dependencies_as_pyproject():
    assert environment_names() == pyproject_names()


def test_environment_yml_installs_kvlab_itself():
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert "-e ." in pip


def test_colab_preinstalled_versions_satisfy_the_core_pins():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert "torch>=2.2" in deps and "ipywidgets>=7.7" in deps


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    assert "make test" in readme and "make lab" in readme
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test$", ci, flags=re.M)


def test_make_installs_the_cpu_torch_pin_not_a_cuda_build():
    makefile = (ROOT / "Makefile").read_text()
    assert "TORCH   ?= torch==2.13.0" in makefile
    assert re.search(r"pip install -q \$\(TORCH\)\n", makefile)


def test_make_lab_opens_the_welcome_chapter_and_also_starts_as_root():
    recipe = (ROOT / "Makefile").read_text().split("\nlab: ", 1)[1].split("\n\n", 1)[0]
    assert "jupyter lab" in recipe and "notebooks/00_welcome.ipynb" in recipe
    assert "$(if $(filter 0,$(shell id -u)),--allow-root)" in recipe  # Jupyter refuses root otherwise
