"""The Colab badge and set-up cell of every notebook, generated from one repository URL.

Run `python tools/colab.py` after creating a notebook or changing REPO: it makes cell 0 (the
title, markdown) start with the "Open in Colab" badge and cell 1 the set-up cell, which installs
kvlab only when the notebook runs on Colab. tests/test_colab.py checks that they agree.
"""

import sys
from pathlib import Path

import nbformat

REPO = "kvlab-course/kvlab"  # GitHub owner/name: the one place the repository is named
BRANCH = "main"
SETUP_TAG = "colab-setup"


def badge(notebook: str) -> str:
    url = f"https://colab.research.google.com/github/{REPO}/blob/{BRANCH}/notebooks/{notebook}"
    return f"[![Open In Colab](https://colab.research.google.com/assets/colab-badge.svg)]({url})"


def setup_source() -> str:
    return (
        "# Set-up: on Colab, install kvlab (Colab's own torch, matplotlib and ipywidgets are kept);\n"
        "# anywhere else this cell does nothing.\n"
        "import sys\n"
        "\n"
        "if 'google.colab' in sys.modules:\n"
        "    import subprocess\n"
        "\n"
        f"    subprocess.run([sys.executable, '-m', 'pip', 'install', '-q',\n"
        f"                    'kvlab @ git+https://github.com/{REPO}@{BRANCH}'], check=True)"
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
    setup = nb.cells[1] if len(nb.cells) > 1 else None
    if setup is None or SETUP_TAG not in setup.metadata.get("tags", []):
        setup = nbformat.v4.new_code_cell()
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
