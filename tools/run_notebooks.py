"""Execute notebooks in place, top to bottom in a fresh kernel, on the CPU, and save outputs."""

import sys
import time
from pathlib import Path

import nbformat
from nbconvert.preprocessors import ExecutePreprocessor


def run(path: Path) -> float:
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    # Run from the notebooks folder so relative paths behave as in JupyterLab.
    ExecutePreprocessor(timeout=600, kernel_name="python3").preprocess(
        nb, {"metadata": {"path": str(path.parent)}})
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)",
                                 "language": "python"}
    nbformat.write(nb, path)
    return time.perf_counter() - start


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        print(f"{arg}: {run(Path(arg)):.1f} s", flush=True)
