"""The set-up a newcomer relies on: environment.yml, pyproject.toml, Makefile and CI agree; the sdist
carries what the tests need and the wheel the package's data."""

import importlib.util
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
import yaml

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

ROOT = Path(__file__).resolve().parents[1]
CONDA_NAMES = {"pytorch": "torch", "python-build": "build"}  # conda-forge name -> PyPI name


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


def test_the_license_is_an_spdx_expression_with_a_setuptools_that_reads_it():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert data["project"]["license"] == "MIT"
    assert "setuptools>=77" in data["build-system"]["requires"]  # 77 reads SPDX `license = "..."`


def test_make_installs_the_site_extra_and_has_the_site_and_bench_data_targets():
    makefile = (ROOT / "Makefile").read_text()
    assert '-e ".[lab,test,ui,site]"' in makefile
    site = makefile.split("\nsite: ", 1)[1].split("\n\n", 1)[0]
    assert "tools/site.py --out _build/site" in site
    bench = makefile.split("\nbench: ", 1)[1].split("\n\n", 1)[0]
    assert "$(MAKE) bench-data" in bench
    data = makefile.split("\nbench-data:", 1)[1].split("\n\n", 1)[0]
    assert "tools/bench_data.py" in data  # it copies benchmarks/*.json into kvlab/data/benchmarks/


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
    """An sdist and a wheel of this checkout, built without network (the installed setuptools)."""
    if importlib.util.find_spec("build") is None:
        pytest.skip("the `build` package is not installed — pip install -e '.[test]'")
    out = tmp_path_factory.mktemp("dist")
    for kind in ("--sdist", "--wheel"):
        result = subprocess.run([sys.executable, "-m", "build", kind, "--no-isolation", "--outdir", str(out),
                                 str(ROOT)], capture_output=True, text=True)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return out


def test_the_sdist_carries_what_the_tests_need(dists):
    (sdist,) = dists.glob("kvlab-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    needed = ["Makefile", "environment.yml", "pyproject.toml", ".ci/run", "tests/conftest.py",
              "tests/needs.py", "tests/sanitize.cfg", "tests/ui/conftest.py", "site/conf.py"]
    for folder in ("tests", "tools", "notebooks", "docs", "benchmarks"):
        needed += [p.relative_to(ROOT).as_posix() for p in (ROOT / folder).rglob("*")
                   if p.is_file() and "__pycache__" not in p.parts and ".ipynb_checkpoints" not in p.parts]
    missing = sorted(set(needed) - names)
    assert not missing, f"the sdist lacks {missing[:20]}"
    assert not [n for n in names if "__pycache__" in n]


def test_the_wheel_ships_the_package_data_with_the_recorded_results(dists):
    (wheel,) = dists.glob("kvlab-*.whl")
    with zipfile.ZipFile(wheel) as whl:
        names = set(whl.namelist())
        metadata = next(whl.read(n).decode() for n in names if n.endswith(".dist-info/METADATA"))
    data = [p.relative_to(ROOT).as_posix() for p in (ROOT / "kvlab" / "data").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts]
    assert any(d.startswith("kvlab/data/benchmarks/") and d.endswith(".json") for d in data)
    missing = sorted(set(data) - names)
    assert not missing, f"the wheel lacks {missing}"
    assert re.search(r"^License-Expression: MIT$", metadata, flags=re.M)
